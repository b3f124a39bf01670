//go:build unix

package hicache

import "syscall"

// mapHost maps n bytes of zeroed anonymous memory for a host pool, outside
// the Go heap: the pool is one large buffer that lives as long as the tier,
// and on the heap it would raise the garbage collector's target by its own
// size and go back to the OS only when the scavenger got to it. Mapped, its
// pages become resident as the tier fills them and are returned the moment
// the pool is closed (unmapHost).
func mapHost(n int) ([]byte, error) {
	return syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
}

// unmapHost returns mapHost's memory to the OS.
func unmapHost(b []byte) error { return syscall.Munmap(b) }
