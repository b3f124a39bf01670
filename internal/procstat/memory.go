package procstat

// Memory is the memory a process may use: the machine's, and the
// tightest limit of the cgroups it is in (its own or an ancestor's),
// whichever is smaller.
type Memory struct {
	Machine int64 // MemTotal
	// Cgroup is the tightest cgroup memory limit over the process's
	// cgroup and its ancestors, 0 when none is set; CgroupFile is the file
	// it was read from.
	Cgroup     int64
	CgroupFile string
}

// Limit is the smaller of the machine's memory and the cgroup limit.
func (m Memory) Limit() int64 {
	if m.Cgroup > 0 && m.Cgroup < m.Machine {
		return m.Cgroup
	}
	return m.Machine
}
