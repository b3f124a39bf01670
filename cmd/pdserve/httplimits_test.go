package main

import (
	"strings"
	"testing"
)

// The listener limits and readiness flags exist on the router and every
// engine role, take their PD_* variables, and refuse what cannot work.
func TestHTTPLimitFlags(t *testing.T) {
	t.Setenv("PD_BODY_TIMEOUT", "7s")
	t.Setenv("PD_MAX_CONNECTIONS", "99")
	for _, cmd := range []string{"router", "serve", "prefill", "decode"} {
		out, stderr, code := run(t, "config", cmd)
		if code != 0 {
			t.Fatalf("config %s: exit %d %s", cmd, code, stderr)
		}
		for _, want := range []string{"PD_HEADER_TIMEOUT", "PD_BODY_TIMEOUT", "7s", "PD_MAX_CONNECTIONS", "99", "PD_READY_FAILURE_RATE", "PD_READY_WINDOW"} {
			if !strings.Contains(out, want) {
				t.Errorf("config %s: no %s in %q", cmd, want, out)
			}
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--body-timeout", "0s"}, "--body-timeout"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--max-connections", "0"}, "--max-connections"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--ready-failure-rate", "1.5"}, "--ready-failure-rate"},
	} {
		_, stderr, code := run(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}
