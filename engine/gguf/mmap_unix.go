//go:build darwin || dragonfly || freebsd || linux || netbsd || openbsd

package gguf

import (
	"fmt"
	"os"
	"syscall"
)

// mapFile maps size bytes of fh read-only and shared, so the weights live in
// the page cache once however many processes serve the same file. The
// mapping outlives fh.
func mapFile(fh *os.File, size int) (data []byte, mapped bool, err error) {
	data, err = syscall.Mmap(int(fh.Fd()), 0, size, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, false, fmt.Errorf("mmap: %w", err)
	}
	return data, true, nil
}

func unmapFile(data []byte) error {
	return syscall.Munmap(data)
}
