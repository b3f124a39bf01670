package model

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// A model's identity: a fingerprint of the weights taken at load, and a
// watch on the file they were loaded from. Servers publish both, so that
// servers of one cluster that serve different weights, or a file changed
// under a running server (outputs change, since the weights are mapped
// from it), can be named.

// fingerprintSamples and fingerprintBlock size the sampled hash: the
// file's head (header, metadata and tensor table, up to the data section)
// and this many blocks spread evenly over the tensor data, about 256 KiB
// read, whatever the model's size.
const (
	fingerprintSamples = 64
	fingerprintBlock   = 4 << 10
)

// sampledHash hashes the head of r (size bytes, its data section at
// dataOffset) and fingerprintSamples blocks of its data: "sha256s:" and 16
// hex digits.
func sampledHash(r io.ReaderAt, size int64, dataOffset uint64) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "%d\n", size)
	head := min(int64(dataOffset), size)
	if _, err := io.Copy(h, io.NewSectionReader(r, 0, head)); err != nil {
		return "", err
	}
	span := size - head
	buf := make([]byte, fingerprintBlock)
	for i := range int64(fingerprintSamples) {
		if span <= 0 {
			break
		}
		off := head + span*i/fingerprintSamples
		n, err := r.ReadAt(buf[:min(int64(len(buf)), size-off)], off)
		if err != nil && err != io.EOF {
			return "", err
		}
		h.Write(buf[:n])
	}
	return "sha256s:" + hex.EncodeToString(h.Sum(nil))[:16], nil
}

// FileCheck is what a check of the model's file found.
type FileCheck struct {
	Path        string
	Fingerprint string // taken at load
	Changed     bool
	Why         string // what changed; empty when nothing did
	Checked     time.Time
}

// fileWatch is the model file's identity at load.
type fileWatch struct {
	path        string
	info        os.FileInfo
	fingerprint string
	dataOffset  uint64

	mu   sync.Mutex
	last FileCheck
}

func newFileWatch(path string, dataOffset uint64) (*fileWatch, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	info, err := fh.Stat()
	if err != nil {
		return nil, err
	}
	fp, err := sampledHash(fh, info.Size(), dataOffset)
	if err != nil {
		return nil, fmt.Errorf("model: fingerprint of %s: %w", path, err)
	}
	w := &fileWatch{path: path, info: info, fingerprint: fp, dataOffset: dataOffset}
	w.last = FileCheck{Path: path, Fingerprint: fp}
	return w, nil
}

// Fingerprint is the sampled hash of the weights taken at load; empty for a
// model that was not opened from a file.
func (m *Model) Fingerprint() string {
	if m.watch == nil {
		return ""
	}
	return m.watch.fingerprint
}

// CheckFile compares the model's file with what was loaded: the same file
// (device and inode), size and modification time, and the same sampled
// hash. At most one check runs per every; a call within it returns the
// last one. Without a file it reports nothing changed.
func (m *Model) CheckFile(now time.Time, every time.Duration) FileCheck {
	w := m.watch
	if w == nil {
		return FileCheck{}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.last.Checked.IsZero() && now.Sub(w.last.Checked) < every {
		return w.last
	}
	c := FileCheck{Path: w.path, Fingerprint: w.fingerprint, Checked: now}
	c.Why = w.changed()
	c.Changed = c.Why != ""
	w.last = c
	return c
}

// changed says what changed in the file since it was loaded; "" when
// nothing did.
func (w *fileWatch) changed() string {
	fh, err := os.Open(w.path)
	if err != nil {
		return fmt.Sprintf("the file cannot be opened: %v", err)
	}
	defer fh.Close()
	info, err := fh.Stat()
	if err != nil {
		return fmt.Sprintf("the file cannot be read: %v", err)
	}
	switch {
	case !os.SameFile(info, w.info):
		return "another file is at its path (the weights served are the old file's until a restart)"
	case info.Size() != w.info.Size():
		return fmt.Sprintf("its size changed, from %d to %d bytes, under the running server", w.info.Size(), info.Size())
	case !info.ModTime().Equal(w.info.ModTime()):
		return fmt.Sprintf("it was written at %s, after the server loaded it", info.ModTime().UTC().Format(time.RFC3339))
	}
	fp, err := sampledHash(fh, info.Size(), w.dataOffset)
	if err != nil {
		return fmt.Sprintf("the file cannot be read: %v", err)
	}
	if fp != w.fingerprint {
		return fmt.Sprintf("its content changed under the running server (sampled hash %s, %s at load)", fp, w.fingerprint)
	}
	return ""
}
