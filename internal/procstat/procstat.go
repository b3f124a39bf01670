// Package procstat reads a process's resident set from Linux's /proc, for
// the tests and soaks that check memory goes back to the OS, and its CPU
// time and its cgroup's throttling, which servers publish so that a slow
// server can say why (cpu.go).
package procstat

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Resident is the resident set size (VmRSS) of process pid in bytes; pid
// 0 is this process. It fails where there is no /proc.
func Resident(pid int) (int64, error) { return status(pid, "VmRSS:") }

// Peak is the peak resident set size (VmHWM) of process pid in bytes:
// the most it ever held, which a brief spike between two readings of
// Resident would not show.
func Peak(pid int) (int64, error) { return status(pid, "VmHWM:") }

// status reads a size field of pid's /proc status, in bytes.
func status(pid int, field string) (int64, error) {
	path := "/proc/self/status"
	if pid != 0 {
		path = fmt.Sprintf("/proc/%d/status", pid)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, field); ok {
			f := strings.Fields(rest)
			if len(f) == 2 && f[1] == "kB" {
				kb, err := strconv.ParseInt(f[0], 10, 64)
				return kb << 10, err
			}
		}
	}
	return 0, fmt.Errorf("%s has no %s", path, strings.TrimSuffix(field, ":"))
}
