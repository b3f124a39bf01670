//go:build unix

package procstat

import (
	"bufio"
	"os"
	"path"
	"slices"
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
	own, _ := os.ReadFile("/proc/self/cgroup")
	var chosen map[string]uint64
	for _, f := range cgroupStatFiles(string(own)) {
		vals, err := readStat(f.path)
		if err != nil {
			continue
		}
		if _, ok := vals["nr_periods"]; !ok && f.kind == "v2" {
			continue // a v2 cgroup without the cpu controller (a hybrid host): its v1 one holds the quota
		}
		if chosen == nil || vals["nr_periods"] > 0 {
			chosen, c.Cgroup = vals, f.kind
		}
		if vals["nr_periods"] > 0 {
			break // the nearest cgroup that enforces a quota: the process's own, or an ancestor's
		}
	}
	if chosen != nil {
		c.Periods, c.Throttled = chosen["nr_periods"], chosen["nr_throttled"]
		if us, ok := chosen["throttled_usec"]; ok { // v2
			c.ThrottledTime = time.Duration(us) * time.Microsecond
		} else { // v1: nanoseconds
			c.ThrottledTime = time.Duration(chosen["throttled_time"])
		}
	}
	return c, nil
}

// statFile is a cgroup's cpu.stat and the cgroup version it belongs to.
type statFile struct{ path, kind string }

// cgroupStatFiles lists the cpu.stat files that may hold the quota
// counters of the cgroup the process is in (own is /proc/self/cgroup),
// most specific first: its own cgroup's under each usual mount of v2 and
// v1, then its ancestors' (a quota set on a parent slice throttles the
// whole subtree), then the mounts' roots, which are its own cgroup inside
// a container with a cgroup namespace. CPUOf takes the first that
// enforces a quota. The process is read, not assumed, because it can be
// moved between cgroups while it runs.
func cgroupStatFiles(own string) []statFile {
	return cgroupFiles(own, "cpu", "cpu.stat", "cpu.stat")
}

// cgroupFiles lists, as cgroupStatFiles does, a controller's file in the
// process's cgroup and its ancestors under each usual mount, then at the
// mounts' roots: v2's file under the unified hierarchy, v1's under the
// controller's own mount (ctrl, and for cpu its cpu,cpuacct twin).
func cgroupFiles(own, ctrl, v2File, v1File string) []statFile {
	var out []statFile
	for line := range strings.Lines(own) {
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 || parts[2] == "/" || strings.Contains(parts[2], "..") {
			continue
		}
		var mounts []string
		kind, file := "v1", v1File
		switch ctrls := strings.Split(parts[1], ","); {
		case parts[0] == "0" && parts[1] == "":
			mounts, kind, file = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}, "v2", v2File
		case slices.Contains(ctrls, ctrl):
			mounts = v1Mounts(ctrl)
		}
		for dir := parts[2]; dir != "/" && dir != "" && dir != "."; dir = path.Dir(dir) {
			for _, m := range mounts {
				out = append(out, statFile{m + dir + "/" + file, kind})
			}
		}
	}
	out = append(out, statFile{"/sys/fs/cgroup/" + v2File, "v2"})
	for _, m := range v1Mounts(ctrl) {
		out = append(out, statFile{m + "/" + v1File, "v1"})
	}
	return out
}

// v1Mounts are where cgroup v1 mounts controller ctrl.
func v1Mounts(ctrl string) []string {
	if ctrl == "cpu" {
		return []string{"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"}
	}
	return []string{"/sys/fs/cgroup/" + ctrl}
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
