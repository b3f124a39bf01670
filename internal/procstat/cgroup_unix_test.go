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

// The memory limit files come from the same walk: memory.max under the
// unified hierarchy, memory.limit_in_bytes under v1's memory mount.
func TestCgroupMemoryFiles(t *testing.T) {
	var got []string
	for _, f := range cgroupFiles("5:memory:/kubepods/pod1\n0::/user.slice\n", "memory", "memory.max", "memory.limit_in_bytes") {
		got = append(got, f.kind+" "+f.path)
	}
	want := []string{
		"v1 /sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes", "v1 /sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes",
		"v2 /sys/fs/cgroup/user.slice/memory.max", "v2 /sys/fs/cgroup/unified/user.slice/memory.max",
		"v2 /sys/fs/cgroup/memory.max", "v1 /sys/fs/cgroup/memory/memory.limit_in_bytes",
	}
	if !slices.Equal(got, want) {
		t.Errorf("got %q\nwant %q", got, want)
	}
}

// MemoryOf reads this machine: a positive total, and a limit no larger.
func TestMemoryOf(t *testing.T) {
	m, err := MemoryOf()
	if err != nil {
		t.Fatal(err)
	}
	if m.Machine <= 0 || m.Limit() <= 0 || m.Limit() > m.Machine || (m.Cgroup > 0) != (m.CgroupFile != "") {
		t.Errorf("%+v, limit %d", m, m.Limit())
	}
}
