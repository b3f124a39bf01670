//go:build unix

package procstat

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// CPUOf reads the process's CPU time and its cgroup's throttling.
func CPUOf() (CPU, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return CPU{}, err
	}
	c := CPU{Used: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
	for _, f := range []struct{ path, kind string }{
		{"/sys/fs/cgroup/cpu.stat", "v2"},
		{"/sys/fs/cgroup/cpu/cpu.stat", "v1"},
		{"/sys/fs/cgroup/cpu,cpuacct/cpu.stat", "v1"},
	} {
		if vals, err := readStat(f.path); err == nil {
			c.Cgroup = f.kind
			c.Periods, c.Throttled = vals["nr_periods"], vals["nr_throttled"]
			if us, ok := vals["throttled_usec"]; ok { // v2
				c.ThrottledTime = time.Duration(us) * time.Microsecond
			} else { // v1: nanoseconds
				c.ThrottledTime = time.Duration(vals["throttled_time"])
			}
			break
		}
	}
	return c, nil
}

// readStat reads a "key value" file of counters.
func readStat(path string) (map[string]uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]uint64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64); err == nil {
			out[k] = n
		}
	}
	return out, sc.Err()
}
