//go:build !unix

package procstat

import "errors"

// MemoryOf is not implemented on this system.
func MemoryOf() (Memory, error) {
	return Memory{}, errors.New("procstat: memory limits are read on unix systems only")
}

// MemInfo is not implemented on this system.
func MemInfo(field string) (int64, error) {
	return 0, errors.New("procstat: /proc/meminfo is read on unix systems only")
}
