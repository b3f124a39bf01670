//go:build unix

package procstat

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// MemoryOf reads the machine's memory and the process's cgroup limits.
func MemoryOf() (Memory, error) {
	total, err := MemInfo("MemTotal")
	if err != nil {
		return Memory{}, fmt.Errorf("reading the machine's memory: %w", err)
	}
	m := Memory{Machine: total}
	own, _ := os.ReadFile("/proc/self/cgroup")
	for _, f := range cgroupFiles(string(own), "memory", "memory.max", "memory.limit_in_bytes") {
		b, err := os.ReadFile(f.path)
		if err != nil {
			continue
		}
		v := strings.TrimSpace(string(b))
		if v == "max" {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		// v1 writes "no limit" as a huge page-rounded number.
		if err != nil || n <= 0 || n >= 1<<62 {
			continue
		}
		if m.Cgroup == 0 || n < m.Cgroup {
			m.Cgroup, m.CgroupFile = n, f.path
		}
	}
	return m, nil
}

// MemInfo reads field (MemTotal, MemAvailable, ...) from /proc/meminfo,
// in bytes.
func MemInfo(field string) (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == field+":" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%s in /proc/meminfo: %w", field, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("no %s in /proc/meminfo", field)
}
