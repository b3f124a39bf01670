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
}
