package main

import (
	"encoding/json"
	"io"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// TestTopOnce: piped (or with --once) top prints one sample as tables:
// the servers, the ranks, the findings; --json gives the sample and the
// findings.
func TestTopOnce(t *testing.T) {
	c := newCluster(t)
	ranks := "PREFILL\t0\t*\t*\tidle\t*\t*\t*\t-\tbootstrap=0 active=0 inflight=0\t0/0/32\n" +
		"PREFILL\t1\t*\t*\tidle\t*\t*\t*\t*\tbootstrap=0 active=0 inflight=0\t0/0/32\n" +
		"DECODE\t0\t*\t*\tidle\t*\t*\t*\t-\tprealloc=0 transfer=0 aborting=0\t0/0/32\n" +
		"DECODE\t1\t*\t*\tidle\t*\t*\t*\t*\tprealloc=0 transfer=0 aborting=0\t0/0/32\n"
	servers := "ROUTER\trouter\t-\tup\t-\t-\t-\t-\t0\t-\t-\t-\n" +
		"PREFILL\tprefill\t2\tup\t0\t0\t0\t0\t0\tfp8\toff\t-\n" +
		"DECODE\tdecode\t2\tup\t0\t0\t0\t0\t0\tfp8\toff\t-\n"
	checkRun(t, c, exitOK, servers+"\n"+ranks+"\n", "", "top")

	// The index-K precision and the host tier of each server: the decode
	// switched to bf16 alone (no request runs), the prefill's tier on. The
	// pair then disagrees on what its handshake compares: a finding.
	if _, err := c.decode.eng.SetIndexK(t.Context(), kernels.IndexBF16, time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetHiCache(t.Context(), true); err != nil {
		t.Fatal(err)
	}
	checkRun(t, c, exitFindings, "ROUTER\trouter\t-\tup\t-\t-\t-\t-\t0\t-\t-\t-\n"+
		"PREFILL\tprefill\t2\tup\t0\t0\t0\t0\t0\tfp8\ton 0/512\t-\n"+
		"DECODE\tdecode\t2\tup\t0\t0\t0\t0\t0\tbf16\toff\t-\n\n"+ranks+"\n"+
		"critical\tconfig-mismatch\tDECODE\t-\tthis decode server and prefill server PREFILL disagree on index_k_dtype: every request routed to the pair fails at the handshake\n",
		"pdctl: top: 1 finding (1 critical)\n", "top")
	if _, err := c.decode.eng.SetIndexK(t.Context(), kernels.IndexFP8, time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetHiCache(t.Context(), false); err != nil {
		t.Fatal(err)
	}

	// A fault switch shows, and the rule that names it.
	if _, err := client.New(c.decode.ts.URL, "", nil).SetFault(t.Context(), "drop-heartbeat", true); err != nil {
		t.Fatal(err)
	}
	checkRun(t, c, exitFindings,
		"ROUTER\trouter\t-\tup\t-\t-\t-\t-\t0\t-\t-\t-\n"+
			"PREFILL\tprefill\t2\tup\t0\t0\t0\t0\t0\tfp8\toff\t-\n"+
			"DECODE\tdecode\t2\tup\t0\t0\t0\t0\t0\tfp8\toff\tfaults on: drop-heartbeat\n\n"+ranks+"\n"+
			"warning\tfault-switch-on\tDECODE\t-\tthe decode server runs with the fault switch on: drop-heartbeat\n",
		"pdctl: top: 1 finding (1 warning)\n", "top", "--once")

	code, stdout, stderr := c.pdctl(t, false, "top", "--json")
	var out topOutput
	if err := json.Unmarshal([]byte(stdout), &out); err != nil || code != exitFindings {
		t.Fatalf("--json: exit %d, %v\n%s\n%s", code, err, stdout, stderr)
	}
	if len(out.Sample.Servers) != 2 || !out.Sample.Servers[1].Reachable || out.Sample.Servers[1].Steps == nil ||
		len(out.Sample.HiCache) != 2 || out.Sample.HiCache["DECODE"] == nil || len(out.Sample.HiCache["DECODE"].Ranks) != 2 ||
		len(out.Findings) != 1 || out.Findings[0].Rule != "fault-switch-on" || out.Findings[0].Rank != nil ||
		out.Sample.Router == nil || !out.Sample.Router.Reachable || out.Sample.Router.URL != "ROUTER" {
		t.Errorf("--json: %+v", out)
	}
	if !strings.Contains(stdout, `"rank": null`) {
		t.Errorf("--json: the server-level finding's rank is not null:\n%s", stdout)
	}
	// Each server's sample carries the settings it publishes: the rules
	// judge it by its own timeouts.
	if st := out.Sample.Servers[1].Settings; st == nil || st.PD == nil || st.Role != "decode" ||
		debug.Duration(st.PD.TransferTimeoutMS) != testConfig.PD.TransferTimeout ||
		debug.Duration(st.PD.AbortAckTimeoutMS) != testConfig.PD.AbortAckTimeout || !slices.Equal(st.FaultsOn, []string{"drop-heartbeat"}) {
		t.Errorf("--json: the decode's settings %+v", st)
	}

	// On a terminal with --once: aligned, headers.
	code, stdout, _ = c.pdctl(t, true, "top", "--once")
	got := regexp.MustCompile(` {2,}`).ReplaceAllString(stdout, "  ")
	if code != exitFindings || !strings.HasPrefix(got, "SERVER  ROLE  TP  STATE  WAIT  PREFILL  RUN  ABORT  FAILED  INDEX-K  HICACHE  DETAIL\n") ||
		!strings.Contains(got, "\nSERVER  RANK  STEP  Δ  PHASE  AGE  CTRL SEQ  FWD SEQ  COLLECTIVE  PD QUEUES  KV USED/CACHED/TOTAL\n") ||
		!strings.Contains(got, "\nSEVERITY  RULE  SERVER  RANK  SUMMARY\nwarning  fault-switch-on  DECODE  -  ") {
		t.Errorf("terminal: exit %d\n%s", code, stdout)
	}

	for _, args := range [][]string{{"top", "--interval", "0s"}, {"top", "--window", "-1s"}} {
		if code, _, _ := c.pdctl(t, false, args...); code != exitUsage {
			t.Errorf("%q: exit %d, want %d", args, code, exitUsage)
		}
	}
	if code, _, stderr := c.pdctl(t, true, "top", "--json"); code != exitUsage || !strings.Contains(stderr, "--json needs --once") {
		t.Errorf("--json on a terminal without --once: exit %d, %q", code, stderr)
	}
}

// TestTopStalledRank: with stall-last-rank on at the decode, top marks the
// divergence: rank 0 waits in a collective, the rank-divergence rule names
// it.
func TestTopStalledRank(t *testing.T) {
	c := newCluster(t)
	dc := client.New(c.decode.ts.URL, "", nil)
	if _, err := dc.SetFault(t.Context(), "stall-last-rank", true); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "decode rank 0 waiting in a control collective", 10*time.Second, func() bool {
		col, err := dc.Collectives(t.Context())
		w := col.Comm(debug.CommControl).Rank(0)
		return err == nil && w != nil && w.Waiting != nil && w.Waiting.DurationMS > 200
	})
	code, stdout, _ := c.pdctl(t, false, "top", "--collective-wait", "100ms")
	var rules []string
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		if cells := strings.Split(line, "\t"); len(cells) == 5 {
			rules = append(rules, cells[0]+" "+cells[1]+" "+cells[2]+" "+cells[3])
		}
	}
	if want := []string{"critical rank-divergence DECODE 0", "warning fault-switch-on DECODE -"}; code != exitFindings || !slices.Equal(rules, want) {
		t.Errorf("exit %d, findings %q, want %q\n%s", code, rules, want, stdout)
	}
	// The finding names the call with its communicator and its phase.
	if !regexp.MustCompile(`\trank 0 waits in control seq \d+ Broadcast \(input\) for .* while rank 1 is not in a collective \(last control seq \d+\)\n`).MatchString(stdout) {
		t.Errorf("no decode rank 0 waiting in a control Broadcast:\n%s", stdout)
	}
}

// TestTopLive runs the live view on a pipe standing in for a terminal: it
// draws the cluster behind the router, and q ends it with exit 0.
func TestTopLive(t *testing.T) {
	c := newCluster(t)
	in, keys := io.Pipe()
	defer keys.Close()
	var out syncbuf.Buffer
	f := &factory{In: in, Out: &out, ErrOut: io.Discard, Build: testBuild, OutTTY: true,
		Getenv: func(k string) string {
			if k == "PDCTL_ROUTER" {
				return c.router
			}
			return ""
		}}
	f.screen.width, f.screen.height = 250, 60
	done := make(chan exitCode, 1)
	go func() { done <- run(t.Context(), f, []string{"top", "--interval", "50ms"}) }()
	waitfor.For(t, "a frame with both servers and a finding section", 10*time.Second, func() bool {
		s := out.String()
		return strings.Contains(s, c.prefill.ts.URL) && strings.Contains(s, c.decode.ts.URL) && strings.Contains(s, "FINDINGS")
	})
	if _, err := keys.Write([]byte("q")); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-done:
		if code != exitOK {
			t.Fatalf("exit %d", code)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("q did not end top")
	}
}
