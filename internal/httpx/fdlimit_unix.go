//go:build unix

package httpx

import "syscall"

// descriptorLimit is the process's soft limit on open file descriptors
// (the Go runtime raises it to the hard limit at start-up); 0 when it
// cannot be read or is unlimited.
func descriptorLimit() int {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil || r.Cur > 1<<30 {
		return 0
	}
	return int(r.Cur)
}
