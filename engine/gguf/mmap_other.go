//go:build !(darwin || dragonfly || freebsd || linux || netbsd || openbsd)

package gguf

import (
	"io"
	"os"
)

// mapFile reads the whole file into memory on platforms where this package
// does not use mmap. Behaviour is the same except for memory use.
func mapFile(fh *os.File, size int) (data []byte, mapped bool, err error) {
	data = make([]byte, size)
	if _, err := io.ReadFull(fh, data); err != nil {
		return nil, false, err
	}
	return data, false, nil
}

func unmapFile([]byte) error { return nil }
