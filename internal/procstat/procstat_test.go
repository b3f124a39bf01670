package procstat

import (
	"os"
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
	// The peak holds at least what is resident, and grows with a page
	// touched beyond it.
	rss, err1 := Resident(0)
	peak, err2 := Peak(0)
	if err1 != nil || err2 != nil || peak < rss {
		t.Fatalf("peak %d, resident %d: %v %v", peak, rss, err1, err2)
	}
	big := make([]byte, 64<<20)
	for i := range big {
		big[i] = 1
	}
	if after, err := Peak(0); err != nil || after < rss+60<<20 {
		t.Fatalf("after touching 64 MiB the peak is %d, resident before %d: %v", after, rss, err)
	}
	_ = big[len(big)-1]
}
