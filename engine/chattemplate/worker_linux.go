package chattemplate

import (
	"bufio"
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// limitMemory bounds the worker's address space to what it maps now plus
// extra (RLIMIT_AS): past it an allocation fails, and the Go runtime ends
// the worker.
func limitMemory(extra int64) error {
	now, err := vmSize()
	if err != nil {
		return err
	}
	limit := uint64(now + extra)
	return syscall.Setrlimit(syscall.RLIMIT_AS, &syscall.Rlimit{Cur: limit, Max: limit})
}

// vmSize is the process's mapped address space, from /proc/self/status.
func vmSize() (int64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmSize:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmSize in /proc/self/status")
}
