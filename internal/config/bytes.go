package config

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Sizes and rates in flags and PD_* variables: a number of bytes, plain
// ("1073741824") or with a unit ("512MiB", "1.5GiB", "2GB"). The binary
// units KiB, MiB, GiB and TiB are powers of 1024, the decimal ones kB, MB,
// GB and TB powers of 1000, B is a byte; units are case-insensitive and a
// fraction is rounded down to whole bytes. A rate takes the same with an
// optional "/s" ("2GB/s").

// units by descending size: String writes a value in the first that divides
// it exactly.
var units = []struct {
	name string
	size int64
}{
	{"TiB", 1 << 40}, {"TB", 1e12}, {"GiB", 1 << 30}, {"GB", 1e9},
	{"MiB", 1 << 20}, {"MB", 1e6}, {"KiB", 1 << 10}, {"kB", 1e3},
}

// ParseBytes reads a non-negative number of bytes with an optional unit.
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := strings.IndexFunc(t, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	num, unit := t, ""
	if i >= 0 {
		num, unit = t[:i], strings.TrimSpace(t[i:])
	}
	if num == "" {
		return 0, fmt.Errorf("%q is not a size: want bytes, e.g. 1073741824, 512MiB or 2GB", s)
	}
	mult := int64(-1)
	switch {
	case unit == "" || strings.EqualFold(unit, "B"):
		mult = 1
	default:
		for _, u := range units {
			if strings.EqualFold(unit, u.name) {
				mult = u.size
			}
		}
	}
	if mult < 0 {
		return 0, fmt.Errorf("%q: unknown unit %q (want B, kB, MB, GB, TB, KiB, MiB, GiB or TiB)", s, unit)
	}
	if !strings.Contains(num, ".") {
		n, err := strconv.ParseInt(num, 10, 64)
		if err != nil || n > math.MaxInt64/mult {
			return 0, fmt.Errorf("%q is not a size in bytes that fits 64 bits", s)
		}
		return n * mult, nil
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f*float64(mult) >= math.MaxInt64 {
		return 0, fmt.Errorf("%q is not a size in bytes that fits 64 bits", s)
	}
	return int64(f * float64(mult)), nil
}

// FormatBytes writes n in the largest unit that divides it exactly, else
// in bytes: 536870912 → "512MiB", 2000000000 → "2GB", 1000001 → "1000001".
func FormatBytes(n int64) string {
	if n != 0 {
		for _, u := range units {
			if n%u.size == 0 {
				return strconv.FormatInt(n/u.size, 10) + u.name
			}
		}
	}
	return strconv.FormatInt(n, 10)
}

// ParseRate reads a non-negative number of bytes per second: a size with
// an optional "/s".
func ParseRate(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if base, ok := strings.CutSuffix(t, "/s"); ok {
		t = base
	}
	n, err := ParseBytes(t)
	if err != nil {
		return 0, fmt.Errorf("%q is not a rate: want bytes per second, e.g. 2GB/s, 500MiB/s or 0", s)
	}
	return n, nil
}

// FormatRate writes n bytes per second as ParseRate reads it: "2GB/s", or
// "0".
func FormatRate(n int64) string {
	if n == 0 {
		return "0"
	}
	return FormatBytes(n) + "/s"
}

// Bytes is a flag value of a size in bytes (pflag.Value), read by
// ParseBytes and written by FormatBytes.
type Bytes int64

func (b *Bytes) String() string { return FormatBytes(int64(*b)) }
func (b *Bytes) Type() string   { return "bytes" }
func (b *Bytes) Set(s string) error {
	n, err := ParseBytes(s)
	if err != nil {
		return err
	}
	*b = Bytes(n)
	return nil
}

// Rate is a flag value of bytes per second (pflag.Value), read by
// ParseRate and written by FormatRate.
type Rate int64

func (r *Rate) String() string { return FormatRate(int64(*r)) }
func (r *Rate) Type() string   { return "rate" }
func (r *Rate) Set(s string) error {
	n, err := ParseRate(s)
	if err != nil {
		return err
	}
	*r = Rate(n)
	return nil
}
