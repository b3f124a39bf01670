//go:build !unix

package procstat

import (
	"errors"
)

// CPUOf is not implemented on this system.
func CPUOf() (CPU, error) {
	return CPU{}, errors.New("procstat: CPU time is read on unix systems only")
}
