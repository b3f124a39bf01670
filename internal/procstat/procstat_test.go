//go:build unix

package procstat

import (
	"os"
	"syscall"
	"testing"
)

// This process's resident set, asked for as itself and by its pid, is a
// plausible size; a process that does not exist is an error.
func TestResident(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skipf("no /proc here: %v", err)
	}
	for _, pid := range []int{0, os.Getpid()} {
		n, err := Resident(pid)
		if err != nil || n < 1<<20 || n > 1<<40 {
			t.Fatalf("Resident(%d) = %d, %v", pid, n, err)
		}
	}
	if _, err := Resident(1 << 30); err == nil {
		t.Fatal("a process that does not exist has a resident set")
	}
	// The peak holds at least what is resident, and grows with pages
	// touched beyond it: fresh ones, mapped for the test, since the Go
	// heap may reuse pages an earlier run made resident.
	rss, err1 := Resident(0)
	peak, err2 := Peak(0)
	if err1 != nil || err2 != nil || peak < rss {
		t.Fatalf("peak %d, resident %d: %v %v", peak, rss, err1, err2)
	}
	big, err := syscall.Mmap(-1, 0, 64<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(big)
	for i := 0; i < len(big); i += os.Getpagesize() {
		big[i] = 1
	}
	if after, err := Peak(0); err != nil || after < rss+60<<20 {
		t.Fatalf("after touching 64 MiB the peak is %d, resident before %d: %v", after, rss, err)
	}
}
