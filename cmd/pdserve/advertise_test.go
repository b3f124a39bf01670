package main

import (
	"strings"
	"testing"
)

func TestAdvertiseHostDefaultsToAConcreteBindAddress(t *testing.T) {
	for _, c := range []struct{ bind, advertise, want string }{
		{"127.0.0.1", "", "127.0.0.1"},
		{"10.231.0.2", "", "10.231.0.2"},
		{"0.0.0.0", "10.231.0.2", "10.231.0.2"},
		{"::", "prefill-0.pd", "prefill-0.pd"},
		{"0.0.0.0", "[fd00::2]", "fd00::2"},
	} {
		got, err := advertiseHost(c.bind, c.advertise, "--host")
		if err != nil || got != c.want {
			t.Errorf("advertiseHost(%q, %q) = %q, %v; want %q", c.bind, c.advertise, got, err, c.want)
		}
	}
}

func TestAdvertiseHostRefusesAWildcard(t *testing.T) {
	for _, c := range []struct{ bind, advertise, want string }{
		{"0.0.0.0", "", "--pd-host \"0.0.0.0\" binds every address"},
		{"::", "", "set --advertise-host (PD_ADVERTISE_HOST)"},
		{"10.231.0.2", "0.0.0.0", "--advertise-host \"0.0.0.0\" is every address"},
		{"127.0.0.1", "::", "--advertise-host \"::\" is every address"},
	} {
		_, err := advertiseHost(c.bind, c.advertise, "--pd-host")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("advertiseHost(%q, %q): %v; want an error saying %q", c.bind, c.advertise, err, c.want)
		}
		if _, ok := err.(usageError); !ok {
			t.Errorf("advertiseHost(%q, %q): %T; want a usage error", c.bind, c.advertise, err)
		}
	}
}

func TestPDServerRefusesToAdvertiseAWildcard(t *testing.T) {
	for _, role := range []string{"prefill", "decode"} {
		for _, args := range [][]string{{"--host", "0.0.0.0"}, {"--pd-host", "0.0.0.0"}, {"--advertise-host", "::"}} {
			_, stderr, code := run(t, append([]string{role, "--port", "0"}, args...)...)
			if code != 2 || !strings.Contains(stderr, "every address") {
				t.Errorf("pdserve %s %v: exit %d: %s; want exit 2 naming the wildcard", role, args, code, stderr)
			}
		}
	}
}
