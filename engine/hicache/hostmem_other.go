//go:build !unix

package hicache

// mapHost allocates a host pool's memory on the Go heap where there is no
// mmap; unmapHost leaves it to the garbage collector.
func mapHost(n int) ([]byte, error) { return make([]byte, n), nil }

func unmapHost([]byte) error { return nil }
