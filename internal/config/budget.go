package config

import (
	"fmt"
	"strconv"
	"strings"
)

// Budget is a flag value for an amount of memory given either as bytes
// (512MiB, 2GB, plain bytes) or as a share of the memory the process may
// use (0.25 or 25%: of the machine's memory, or its cgroup's limit when
// that is smaller), as SGLang's mem_fraction_static and vLLM's
// gpu_memory_utilization take a share of the device.
type Budget struct {
	Bytes    int64   // set when given as bytes
	Fraction float64 // set when given as a share, in (0, 1]
}

// IsZero says whether no budget was given.
func (b *Budget) IsZero() bool { return b.Bytes == 0 && b.Fraction == 0 }

// Of is the budget in bytes out of limit, the memory the process may use.
func (b *Budget) Of(limit int64) int64 {
	if b.Fraction > 0 {
		return int64(b.Fraction * float64(limit))
	}
	return b.Bytes
}

func (b *Budget) String() string {
	switch {
	case b.Fraction > 0: // as a percentage, which Set reads back as a share
		return strconv.FormatFloat(100*b.Fraction, 'g', -1, 64) + "%"
	case b.Bytes > 0:
		return FormatBytes(b.Bytes)
	}
	return "0"
}

func (b *Budget) Type() string { return "budget" }

// Set reads a share (a number in (0, 1] with a decimal point, or a
// percentage) or a size in bytes.
func (b *Budget) Set(s string) error {
	t := strings.TrimSpace(s)
	if p, ok := strings.CutSuffix(t, "%"); ok {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || !(v > 0) || v > 100 {
			return fmt.Errorf("%q is not a share of memory: want a percentage in (0, 100]", s)
		}
		*b = Budget{Fraction: v / 100}
		return nil
	}
	if v, err := strconv.ParseFloat(t, 64); err == nil && strings.Contains(t, ".") {
		if !(v > 0) || v > 1 {
			return fmt.Errorf("%q is not a share of memory: want a number in (0, 1], e.g. 0.25, or a size such as 2GiB", s)
		}
		*b = Budget{Fraction: v}
		return nil
	}
	n, err := ParseBytes(t)
	if err != nil {
		return fmt.Errorf("%w; or a share of memory such as 0.25 or 25%%", err)
	}
	*b = Budget{Bytes: n}
	return nil
}
