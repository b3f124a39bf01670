package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestHiCache shows and switches the host tier of live servers through
// pdctl: a prefill and a decode server behind the router (the decode,
// which keeps no tier, skipped), and a colocated server without a prefix
// cache (skipped); a server that refuses (another switch pending) or
// cannot be reached makes the exit status 1. The steps run in order.
func TestHiCache(t *testing.T) {
	c := newCluster(t)
	plain := newNode(t, c.m, serve.Config{PageSize: 4, KVTokens: 128, MaxRunning: 4, DisablePrefixCache: true}, server.Options{})
	// 32 device pages of 4 tokens per rank, the host pool twice that.
	const off = "\toff\twrite-through\t0/0\tunlimited\t0\t0\t0\t0\n"
	const on = "\ton\twrite-through\t0/256\tunlimited\t0\t0\t0\t0\n"
	const noTier = "a decode server keeps no host tier (its prompt KV comes from the prefill)"
	steps := []struct {
		name   string
		args   []string
		before func()
		code   exitCode
		stdout string
		stderr string
	}{
		{
			name: "status, all off; the decode keeps no tier",
			args: []string{"hicache", "status"},
			stdout: "PREFILL\tprefill\t0" + off + "PREFILL\tprefill\t1" + off +
				"DECODE\tdecode\t-\tn/a: " + noTier + "\t-\t-\t-\t-\t-\t-\t-\n",
		},
		{
			name:   "on",
			args:   []string{"hicache", "on"},
			stdout: "PREFILL\tprefill\ton\nDECODE\tdecode\tskipped: " + noTier + "\n",
		},
		{
			name:   "on again",
			args:   []string{"hicache", "on"},
			stdout: "PREFILL\tprefill\ton (already)\nDECODE\tdecode\tskipped: " + noTier + "\n",
		},
		{
			name:   "status, on; a server without a prefix cache",
			args:   []string{"--server", c.prefill.ts.URL, "--server", plain.ts.URL, "hicache", "status"},
			stdout: "PREFILL\tprefill\t0" + on + "PREFILL\tprefill\t1" + on + "PLAIN\tcolocated\t-\tn/a: no prefix cache\t-\t-\t-\t-\t-\t-\t-\n",
		},
		{
			name: "off; a server without a prefix cache is skipped",
			args: []string{"--server", c.prefill.ts.URL, "--server", plain.ts.URL, "hicache", "off"},
			stdout: "PREFILL\tprefill\toff\n" +
				"PLAIN\tcolocated\tskipped: no prefix cache on this server\n",
		},
		{
			name:   "only servers without a host tier",
			args:   []string{"--server", plain.ts.URL, "--server", c.decode.ts.URL, "hicache", "on"},
			code:   exitError,
			stdout: "PLAIN\tcolocated\tskipped: no prefix cache on this server\nDECODE\tdecode\tskipped: " + noTier + "\n",
			stderr: "pdctl: no server has a host tier to switch on (it needs the prefix cache, and a decode server keeps none)\n",
		},
		{
			name: "an unreachable server",
			args: []string{"--server", c.prefill.ts.URL, "--server", "http://127.0.0.1:1", "hicache", "off"},
			code: exitFindings,
			stdout: "PREFILL\tprefill\toff (already)\n" +
				"http://127.0.0.1:1\t-\tunreachable: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\n",
			stderr: "pdctl: 1 server of 2 unreachable\n",
		},
		{
			// The prefill's last rank held and rank 0 waiting for it in a
			// collective: its loops cannot take the switch.
			name: "on, not taken in time",
			before: func() {
				if err := c.prefill.eng.SetFault(serve.FaultStallLastRank, true); err != nil {
					t.Fatal(err)
				}
				waitfor.For(t, "the prefill's rank 0 waiting for rank 1", 10*time.Second, func() bool {
					var cr debug.CollectivesResponse
					err := client.New(c.prefill.ts.URL, "", nil).GetJSON(t.Context(), "/debug/v1/collectives?stall=100ms", &cr)
					ctrl := cr.Comm(debug.CommControl)
					return err == nil && ctrl != nil && slices.ContainsFunc(ctrl.Stalls, func(s debug.Stall) bool { return slices.Contains(s.Arrived, 0) })
				})
			},
			args:   []string{"--server", c.prefill.ts.URL, "hicache", "on"},
			stdout: "PREFILL\tprefill\ton (pending: not yet taken by every rank)\n",
		},
		{
			name: "off while on is pending: refused",
			args: []string{"--server", c.prefill.ts.URL, "hicache", "off"},
			code: exitError,
			stdout: "PREFILL\tprefill\trefused: PREFILL" + debug.HiCacheOffPath +
				": 409 another hicache switch is pending: retry once GET /debug/v1/hicache shows it taken\n",
			stderr: "pdctl: 1 server refused the switch\n",
		},
		{
			name:   "usage",
			args:   []string{"hicache", "on", "now"},
			code:   exitUsage,
			stderr: "pdctl: on takes no arguments, got [\"now\"]\nRun 'pdctl hicache on --help' for usage.\n",
		},
		{
			name:   "no command",
			args:   []string{"hicache"},
			code:   exitUsage,
			stderr: "pdctl: hicache needs a command: status, on or off\nRun 'pdctl hicache --help' for usage.\n",
		},
	}
	for _, st := range steps {
		if st.before != nil {
			st.before()
		}
		code, stdout, stderr := c.pdctl(t, false, st.args...)
		stdout = strings.ReplaceAll(stdout, plain.ts.URL, "PLAIN")
		if code != st.code || stdout != st.stdout || stderr != st.stderr {
			t.Errorf("%s: exit %d, want %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s\nwant:\n%s", st.name, code, st.code, stdout, st.stdout, stderr, st.stderr)
		}
	}

	// Released, the prefill's loops take the pending switch.
	if err := c.prefill.eng.SetFault(serve.FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the prefill's tier on", 10*time.Second, func() bool {
		_, stdout, _ := c.pdctl(t, false, "--server", c.prefill.ts.URL, "hicache", "status", "--json")
		var out struct{ Servers []serverHiCache }
		return json.Unmarshal([]byte(stdout), &out) == nil && len(out.Servers) == 1 && out.Servers[0].HiCache != nil && out.Servers[0].HiCache.On
	})
	// pdctl status shows it per rank.
	if _, stdout, _ := c.pdctl(t, false, "--server", c.prefill.ts.URL, "status"); strings.Count(stdout, "\ton 0/256\n") != 2 {
		t.Errorf("status:\n%s", stdout)
	}
}
