//go:build unix

package procstat

import (
	"slices"
	"testing"
)

// The cpu.stat files come from the process's own cgroups, most specific
// first, then their ancestors', then the mounts' roots; a root cgroup or
// a path that climbs is not joined.
func TestCgroupStatFiles(t *testing.T) {
	paths := func(fs []statFile) []string {
		var out []string
		for _, f := range fs {
			out = append(out, f.kind+" "+f.path)
		}
		return out
	}
	roots := []string{"v2 /sys/fs/cgroup/cpu.stat", "v1 /sys/fs/cgroup/cpu/cpu.stat", "v1 /sys/fs/cgroup/cpu,cpuacct/cpu.stat"}
	tests := []struct {
		own  string
		want []string
	}{
		{"0::/\n", roots},
		{"0::/system.slice/pdserve.service\n", append([]string{
			"v2 /sys/fs/cgroup/system.slice/pdserve.service/cpu.stat", "v2 /sys/fs/cgroup/unified/system.slice/pdserve.service/cpu.stat",
			"v2 /sys/fs/cgroup/system.slice/cpu.stat", "v2 /sys/fs/cgroup/unified/system.slice/cpu.stat"}, roots...)},
		{"4:memory:/x\n2:cpu,cpuacct:/kubepods/pod1\n0::/\n", append([]string{
			"v1 /sys/fs/cgroup/cpu/kubepods/pod1/cpu.stat", "v1 /sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/cpu.stat",
			"v1 /sys/fs/cgroup/cpu/kubepods/cpu.stat", "v1 /sys/fs/cgroup/cpu,cpuacct/kubepods/cpu.stat"}, roots...)},
		{"1:cpu:/../../etc\n", roots},
		{"", roots},
	}
	for _, tt := range tests {
		if got := paths(cgroupStatFiles(tt.own)); !slices.Equal(got, tt.want) {
			t.Errorf("%q:\n got %q\nwant %q", tt.own, got, tt.want)
		}
	}
}
