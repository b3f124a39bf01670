//go:build unix

package procstat

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// MemoryOf reads the machine's memory and the process's cgroup limits.
func MemoryOf() (Memory, error) {
	total, err := memTotal()
	if err != nil {
		return Memory{}, err
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

// memTotal reads MemTotal from /proc/meminfo, in bytes.
func memTotal() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("reading the machine's memory: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("reading the machine's memory: %w", err)
			}
			return kb << 10, nil
		}
	}
	return 0, errors.New("reading the machine's memory: no MemTotal in /proc/meminfo")
}
