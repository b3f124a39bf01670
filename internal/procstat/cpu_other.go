//go:build !unix

package procstat

import (
	"errors"
	"time"
)

// CPU is what the process can see of its CPU time (see cpu.go).
type CPU struct {
	Used               time.Duration
	Periods, Throttled uint64
	ThrottledTime      time.Duration
	Cgroup             string
}

// CPUOf is not implemented on this system.
func CPUOf() (CPU, error) {
	return CPU{}, errors.New("procstat: CPU time is read on unix systems only")
}
