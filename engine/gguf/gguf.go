// Package gguf reads and writes GGUF files, the container llama.cpp uses for
// model weights and metadata.
//
// Open maps a file read-only and validates all of its structure up front:
// header, metadata, tensor infos, and that every tensor's bytes lie inside
// the file. After a successful Open, TensorData is a bounds-safe, zero-copy
// slice of the mapping, so loading a model costs no copy of the weights and
// the page cache is shared between processes serving the same file.
//
// Files come from outside the process and are treated as hostile: a
// truncated, corrupt or unsupported file yields an error wrapping ErrFormat
// that says what is wrong and where, never a panic, and no count read from a
// file causes an allocation larger than the file itself justifies.
//
// Writer produces GGUF v3 files (for the built-in model generator and tests).
//
// Format reference: all integers are little-endian. A file is the magic
// "GGUF", a uint32 version, uint64 tensor and metadata counts, the metadata
// key/value pairs, the tensor infos, padding to general.alignment (default
// 32), then the data section holding each tensor at its aligned offset.
package gguf

import (
	"errors"
	"fmt"
)

// ErrFormat is wrapped by every error that describes a malformed,
// truncated or unsupported file, so callers can tell bad input from I/O
// failures with errors.Is.
var ErrFormat = errors.New("gguf: invalid file")

// ErrClosed is returned by data accessors of a File after Close.
var ErrClosed = errors.New("gguf: file is closed")

// ErrNotFound is wrapped by TensorData when the file has no tensor of the
// requested name.
var ErrNotFound = errors.New("gguf: not found")

// DefaultAlignment is the data alignment of a file without
// general.alignment.
const DefaultAlignment = 32

// KeyAlignment is the metadata key that overrides DefaultAlignment. Its
// value must be a UINT32 power of two.
const KeyAlignment = "general.alignment"

// Magic is the four bytes every GGUF file starts with.
const Magic = "GGUF"

// Version is the version Writer writes. The reader accepts 2 and 3, which
// share one layout (3 only added big-endian files, which this package does
// not read).
const Version = 3

// formatError is a problem with a file's content. The message names the
// problem and where it is (offset, key or tensor); path is filled in by Open.
type formatError struct {
	path string
	msg  string
}

func (e *formatError) Error() string {
	if e.path != "" {
		return "gguf: " + e.path + ": " + e.msg
	}
	return "gguf: " + e.msg
}

func (e *formatError) Unwrap() error { return ErrFormat }

func formatErr(format string, args ...any) error {
	return &formatError{msg: fmt.Sprintf(format, args...)}
}

// withContext prefixes a formatError's message with where in the file's
// structure the problem was found ("metadata key 3", "element 7").
func withContext(err error, format string, args ...any) error {
	var fe *formatError
	if errors.As(err, &fe) {
		return &formatError{path: fe.path, msg: fmt.Sprintf(format, args...) + ": " + fe.msg}
	}
	return err
}
