package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
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

// TestAbortDrillOverlapBrokenGroupDiagnosed: the overlap loop at TP 2
// without a collective timeout, overlap-local-decision on at both
// servers: the mass-abort drill of 60 sessions breaks each server's rank
// group on the collective layer's mismatch (rank 0's AllReduceMin against
// rank 1's Broadcast) and the engines stop with it. Within 10 s of the
// drill's start a plain diagnose names it: rank-divergence on each server
// with every rank's loop (overlap), step, phase and where it stopped, the
// broken communicator with the mismatch, the fault switch and the remedy;
// and each server's /health answers 503 with the broken group's reason.
// The exact findings of the rules that name the break (rank-divergence,
// engine-stalled, fault-switch-on), piped, with the values that change
// from run to run masked; the PD queue findings the drill leaves depend on
// where its sessions were and are not compared.
func TestAbortDrillOverlapBrokenGroupDiagnosed(t *testing.T) {
	saved := testConfig
	testConfig.Schedule = serve.ScheduleOverlap // CollectiveTimeout stays 0: the engine stops with a broken group
	c := newCluster(t)
	testConfig = saved
	servers := []struct{ url, name, role string }{{c.prefill.ts.URL, "PREFILL", "prefill"}, {c.decode.ts.URL, "DECODE", "decode"}}
	for _, s := range servers {
		if code, _, errOut := c.pdctl(t, false, "--server", s.url, "fault", "on", "overlap-local-decision"); code != exitOK {
			t.Fatalf("fault on: exit %d: %s", code, errOut)
		}
	}
	start := time.Now()
	c.pdctl(t, false, "abort", "--sessions", "60", "--max-tokens", "100", "--drain-timeout", "1s", "--check", "0")

	// Each server's /health: 503, the control communicator broken on the
	// mismatch.
	health := func(url string) (int, server.HealthResponse) {
		resp, err := http.Get(url + "/health")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var h server.HealthResponse
		if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, h
	}
	for _, s := range servers {
		waitfor.For(t, s.name+"'s group broken", drillBreakBound, func() bool {
			code, h := health(s.url)
			return code == http.StatusServiceUnavailable && len(h.Broken) > 0
		})
	}

	code, stdout, stderr := c.pdctl(t, false, "diagnose")
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("diagnose answered %v after the drill started, want within 10s", took)
	}

	// The engines stopped: what they show now is what diagnose sampled.
	const doc = "in the overlap loop the highest TP rank takes the idle branch when its own PD socket filed no mail since its last iteration, while its peers enter the agreed poll: a collective mismatch or a hang (the overlap-schedule desync)"
	var stalled, diverged, switches string
	for _, s := range servers {
		cl := client.New(s.url, "", nil)
		steps, err := cl.Steps(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		col, err := cl.Collectives(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		ctl := col.Comm(debug.CommControl)
		if ctl == nil || !ctl.Broken || !strings.Contains(ctl.BrokenReason, "dist: collective mismatch at seq ") ||
			!strings.Contains(ctl.BrokenReason, "rank 0 AllReduceMin") || !strings.Contains(ctl.BrokenReason, "rank 1 Broadcast") {
			t.Fatalf("%s: control communicator %+v, want broken on rank 0's AllReduceMin against rank 1's Broadcast", s.name, ctl)
		}
		code, h := health(s.url)
		want := []server.HealthBroken{{Comm: debug.CommControl, Reason: ctl.BrokenReason}}
		if code != http.StatusServiceUnavailable || h.Status != server.HealthUnhealthy || fmt.Sprint(h.Broken) != fmt.Sprint(want) ||
			!strings.Contains(h.Reason, "the control communicator is broken: "+ctl.BrokenReason) {
			t.Errorf("%s: /health %d %q, reason %q, broken %+v; want 503 with %+v", s.name, code, h.Status, h.Reason, h.Broken, want)
		}
		if len(steps.Ranks) != 2 {
			t.Fatalf("%s: %d step records", s.name, len(steps.Ranks))
		}
		var where, ranks []string
		for _, r := range steps.Ranks {
			if r.Loop != serve.ScheduleOverlap {
				t.Errorf("%s rank %d: loop %q", s.name, r.Rank, r.Loop)
			}
			var seqs []string
			for _, comm := range col.Comms {
				cr := comm.Rank(r.Rank)
				seqs = append(seqs, fmt.Sprintf("%s: last entered seq %d, last completed %d", comm.Name, cr.LastEntered, cr.LastCompleted))
			}
			where = append(where, fmt.Sprintf("rank %d=overlap loop, step %d (%s), not in a collective (%s)", r.Rank, r.Step, r.Phase, strings.Join(seqs, "; ")))
			ranks = append(ranks, fmt.Sprintf("rank %d at step %d (%s, last step ended * before the sample), not in a collective", r.Rank, r.Step, r.Phase))
		}
		stalled += "critical\tengine-stalled\t" + s.name + "\t-\tno rank of the " + s.role + " server finished a step in *\t" +
			"window=* over * samples (threshold 1s); ranks=" + strings.Join(ranks, "; ") + "; seen=*\t" +
			"the engine loop is stuck: read the ranks' stacks (pdctl bundle, or GET " + s.name + "/debug/v1/stacks?rank=N) and the collectives (rank-divergence); a fault switch such as stall-last-rank holds a rank on purpose (fault-switch-on); restart the server if it does not move.\n"
		diverged += "critical\trank-divergence\t" + s.name + "\t-\tthe rank group of the " + s.role + " server is broken: its control communicator is broken (the ranks entered different collectives)\t" +
			strings.Join(where, "; ") + "; control communicator=broken: " + ctl.BrokenReason + "; fault switch=overlap-local-decision on: " + doc + "; seen=*\t" +
			"the ranks took different branches before a collective, or one rank is stuck outside the collectives: capture a bundle (pdctl bundle -o FILE.tar.gz) with the flight recorders and stacks, " +
			"switch off the fault switches on (pdctl fault off overlap-local-decision --server " + s.name + "), then restart the server; " +
			"a server started with --collective-timeout above 0 (pdserve's default) rebuilds a broken group itself and serves on.\n"
		switches += "warning\tfault-switch-on\t" + s.name + "\t-\tthe " + s.role + " server runs with the fault switch on: overlap-local-decision\toverlap-local-decision=" + doc + "; seen=*\t" +
			"unless a drill needs it, switch it off (pdctl fault off overlap-local-decision --server " + s.name + "); a server started with --fault keeps it across restarts until the flag is removed.\n"
	}
	// Findings come by severity and rule; the servers' order within a
	// rule follows discovery and is not compared.
	want := stalled + diverged + switches

	volatile := regexp.MustCompile(`(ended |a step in |window=)[0-9.]+(?:µs|ms|s)|(over )[0-9]+`)
	var kept []string
	for _, line := range strings.SplitAfter(stdout, "\n") {
		cells := strings.Split(line, "\t")
		if len(cells) < 2 {
			continue
		}
		switch cells[1] {
		case "rank-divergence", "engine-stalled", "fault-switch-on":
			kept = append(kept, volatile.ReplaceAllString(line, "$1$2*"))
		case "pd-queue-stuck", "pd-entry-overdue", "requests-failing":
		default:
			t.Errorf("unexpected finding: %q", line)
		}
	}
	sortServers := func(lines []string) string {
		slices.SortStableFunc(lines, func(a, b string) int {
			fa, fb := strings.Split(a, "\t"), strings.Split(b, "\t")
			return cmp.Or(cmp.Compare(fa[0], fb[0]), cmp.Compare(fa[1], fb[1]), cmp.Compare(fa[2], fb[2]))
		})
		return strings.Join(lines, "")
	}
	got := sortServers(kept)
	want = sortServers(strings.SplitAfter(want, "\n")[:6])
	if code != exitFindings || got != want || !strings.HasPrefix(stderr, "sampling 2 servers every 1s for 5s…\n") ||
		!regexp.MustCompile(`\npdctl: diagnose: [0-9]+ findings \([0-9]+ critical, [0-9]+ warning\)\n$`).MatchString(stderr) {
		t.Errorf("exit %d\nstdout:\n%s\ngot:\n%s\nwant:\n%s\nstderr:\n%s", code, stdout, got, want, stderr)
	}
}
