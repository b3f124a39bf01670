package config

import (
	"testing"

	"github.com/spf13/pflag"
)

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]int64{
		"0": 0, "1073741824": 1 << 30, "512MiB": 512 << 20, "2GiB": 2 << 30, "2gib": 2 << 30, "1.5GiB": 3 << 29,
		"2GB": 2e9, "1kB": 1000, "1KB": 1000, "4KiB": 4096, "100B": 100, " 3 MiB ": 3 << 20, "1TiB": 1 << 40, "0.5B": 0,
	} {
		got, err := ParseBytes(in)
		if err != nil || got != want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "-1GiB", "MiB", "12XB", "1e9", "lots", "1..2GB", "9223372036854775807KiB", "1e30GiB"} {
		if got, err := ParseBytes(in); err == nil {
			t.Errorf("ParseBytes(%q) = %d, want an error", in, got)
		}
	}
}

func TestFormatBytesRoundTrip(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 512 << 20: "512MiB", 2e9: "2GB", 1536 << 20: "1536MiB", 1000001: "1000001", 1 << 40: "1TiB"} {
		got := FormatBytes(n)
		if got != want {
			t.Errorf("FormatBytes(%d) = %q, want %q", n, got, want)
		}
		if back, err := ParseBytes(got); err != nil || back != n {
			t.Errorf("ParseBytes(FormatBytes(%d)) = %d, %v", n, back, err)
		}
	}
}

func TestParseRate(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "2GB/s": 2e9, "500MiB/s": 500 << 20, "1000000": 1e6, "1MB": 1e6} {
		got, err := ParseRate(in)
		if err != nil || got != want {
			t.Errorf("ParseRate(%q) = %d, %v; want %d", in, got, err, want)
		}
		if back, err := ParseRate(FormatRate(got)); err != nil || back != got {
			t.Errorf("ParseRate(FormatRate(%d)) = %d, %v", got, back, err)
		}
	}
	for _, in := range []string{"/s", "-5/s", "fast", "2GB/h"} {
		if got, err := ParseRate(in); err == nil {
			t.Errorf("ParseRate(%q) = %d, want an error", in, got)
		}
	}
	if FormatRate(0) != "0" || FormatRate(2e9) != "2GB/s" {
		t.Errorf("FormatRate: %q %q", FormatRate(0), FormatRate(2e9))
	}
}

// Bytes and Rate are flag values: set from the command line or a PD_*
// variable, shown in their units.
func TestBytesRateFlags(t *testing.T) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	var b Bytes
	var r Rate
	fs.Var(&b, "size", "a size")
	fs.Var(&r, "rate", "a rate")
	if err := fs.Parse([]string{"--size", "512MiB"}); err != nil {
		t.Fatal(err)
	}
	if err := ApplyEnv(fs, func(k string) string { return map[string]string{"PD_RATE": "2GB/s"}[k] }); err != nil {
		t.Fatal(err)
	}
	if b != 512<<20 || r != 2e9 {
		t.Errorf("size %d, rate %d", b, r)
	}
	got := map[string]Entry{}
	for _, e := range Effective(fs) {
		got[e.Name] = e
	}
	if got["size"].Value != "512MiB" || got["rate"].Value != "2GB/s" || got["rate"].Source != "env" {
		t.Errorf("effective: %+v", got)
	}
	if err := fs.Parse([]string{"--size", "big"}); err == nil {
		t.Error("--size big accepted")
	}
}
