package main

import (
	"strings"
	"testing"
)

func TestRouterUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"router"}, "at least one --prefill and one --decode"},
		{[]string{"router", "--prefill", "http://127.0.0.1:1"}, "at least one --prefill and one --decode"},
		{[]string{"router", "--decode", "http://127.0.0.1:1"}, "at least one --prefill and one --decode"},
		{[]string{"router", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"}, "server URL"},
		{[]string{"router", "--prefill", "ftp://a:1", "--decode", "http://127.0.0.1:2"}, "want http://host:port"},
		{[]string{"router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"}, "given twice"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--health-interval", "0s"}, "must be positive"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--port", "70000"}, "--port"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--shutdown-timeout", "0s"}, "--shutdown-timeout 0s must be positive"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--max-queued", "-1"}, "--max-queued -1"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "extra"}, "unknown command"},
		{[]string{"router", "--no-such-flag"}, "unknown flag"},
	} {
		_, stderr, code := run(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}

func TestRouterEnv(t *testing.T) {
	t.Setenv("PD_PREFILL", "http://127.0.0.1:1,http://127.0.0.1:2")
	t.Setenv("PD_DECODE", "not-a-url")
	_, stderr, code := run(t, "router")
	if code != 2 || !strings.Contains(stderr, `"not-a-url"`) {
		t.Errorf("exit %d, stderr %q; want the decode URL from PD_DECODE refused", code, stderr)
	}
	t.Setenv("PD_MAX_QUEUED", "12")
	out, stderr, code := run(t, "config", "router")
	if code != 0 || !strings.Contains(out, "PD_PREFILL") || !strings.Contains(out, "env") || !strings.Contains(out, "PD_MAX_QUEUED") || !strings.Contains(out, "12") {
		t.Errorf("config router: exit %d %q %q", code, out, stderr)
	}
}
