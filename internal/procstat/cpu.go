package procstat

import "time"

// CPU is what the process can see of its CPU time: used, and what its
// cgroup's quota held back.
type CPU struct {
	// Used is the process's user and system time.
	Used time.Duration
	// Periods, Throttled and ThrottledTime are the cgroup's CPU quota
	// counters (cgroup v2 cpu.stat, or v1 cpu/cpu.stat): enforcement
	// periods, periods in which the quota ran out, and the time held back.
	// All zero without a quota, or where no cgroup file could be read.
	Periods, Throttled uint64
	ThrottledTime      time.Duration
	// Cgroup names the file read: "v2", "v1" or "" for none.
	Cgroup string
}
