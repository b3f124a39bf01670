package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// drillBreakBound is how long after the drill starts a cluster with
// overlap-local-decision on may take to break a server's rank group.
const drillBreakBound = 5 * time.Second

func newScheduleCluster(t *testing.T, schedule string) *cluster {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	cfg := testConfig
	cfg.Schedule = schedule
	cfg.CollectiveWatchdog, cfg.CollectiveTimeout = time.Second, 2*time.Second
	cc := clustertest.New(t, clustertest.Options{Model: m, Config: cfg,
		Router: router.Options{HealthInterval: 20 * time.Millisecond}, HealthyWithin: 10 * time.Second})
	return &cluster{m: m, prefill: nodeOf(cc.Prefill), decode: nodeOf(cc.Decode), registry: cc.Registry, router: cc.Router.URL}
}

func restarts(c *cluster) uint64 {
	return c.prefill.eng.View().Restarts() + c.decode.eng.View().Restarts()
}

// TestAbortDrillOverlapLocalDecision: with overlap-local-decision on
// (pdctl fault on, both servers, the overlap loop, TP 2), the mass-abort
// drill of 60 sessions breaks a server's rank group in 10 runs of 10
// within drillBreakBound (rank 1 takes the idle branch on its own empty
// mail while rank 0 polls: a collective mismatch), and the server
// recovers (its collective timeout is set); with the switch off the drill
// passes, in both loops, and no group breaks.
func TestAbortDrillOverlapLocalDecision(t *testing.T) {
	c := newScheduleCluster(t, serve.ScheduleOverlap)
	var worst time.Duration
	for run := range 10 {
		before := restarts(c)
		for _, s := range []string{c.prefill.ts.URL, c.decode.ts.URL} {
			if code, _, errOut := c.pdctl(t, false, "--server", s, "fault", "on", "overlap-local-decision"); code != exitOK {
				t.Fatalf("fault on: exit %d: %s", code, errOut)
			}
		}
		start := time.Now()
		c.pdctl(t, false, "abort", "--sessions", "60", "--max-tokens", "100", "--drain-timeout", "3s", "--check", "0")
		waitfor.For(t, fmt.Sprintf("run %d: a rank group broken and rebuilt", run), drillBreakBound, func() bool { return restarts(c) > before })
		took := time.Since(start)
		worst = max(worst, took)
		for _, s := range []string{c.prefill.ts.URL, c.decode.ts.URL} {
			if code, _, errOut := c.pdctl(t, false, "--server", s, "fault", "off", "overlap-local-decision"); code != exitOK {
				t.Fatalf("fault off: exit %d: %s", code, errOut)
			}
		}
		t.Logf("run %d: broke and recovered within %v (restarts %d → %d)", run, took.Round(time.Millisecond), before, restarts(c))
	}
	t.Logf("10 of 10 runs broke a group, the slowest within %v", worst.Round(time.Millisecond))
}

// TestAbortDrillHealthyBothLoops: with no fault switch on, the drill of 60
// sessions passes (queues drained, the check requests served) in the
// lock-step and the overlap loop, and no rank group breaks.
func TestAbortDrillHealthyBothLoops(t *testing.T) {
	for _, schedule := range []string{serve.ScheduleLockstep, serve.ScheduleOverlap} {
		t.Run(schedule, func(t *testing.T) {
			c := newScheduleCluster(t, schedule)
			code, out, errOut := c.pdctl(t, false, "abort", "--sessions", "60", "--max-tokens", "100", "--drain-timeout", "10s")
			if code != exitOK || restarts(c) != 0 {
				t.Fatalf("exit %d, %d restarts\nstdout:\n%s\nstderr:\n%s", code, restarts(c), out, errOut)
			}
		})
	}
}

// TestDiagnoseRestartAfterTheStorm: the overlap fault breaks a server's
// rank group under the drill and the server rebuilds it; a diagnose whose
// window opens after that names the rebuild from the server's state (its
// restart count and last failure), with the failed group's calls, the
// fault switch and the remedy that switches it off.
func TestDiagnoseRestartAfterTheStorm(t *testing.T) {
	c := newScheduleCluster(t, serve.ScheduleOverlap)
	for _, s := range []string{c.prefill.ts.URL, c.decode.ts.URL} {
		if code, _, errOut := c.pdctl(t, false, "--server", s, "fault", "on", "overlap-local-decision"); code != exitOK {
			t.Fatalf("fault on: exit %d: %s", code, errOut)
		}
	}
	c.pdctl(t, false, "abort", "--sessions", "60", "--max-tokens", "100", "--drain-timeout", "3s", "--check", "0")
	waitfor.For(t, "a rank group broken and rebuilt", drillBreakBound, func() bool { return restarts(c) > 0 })
	start := time.Now()
	code, findings, keys := diagnoseJSON(t, c, "--window", "1s", "--interval", "500ms")
	t.Logf("named in %v: %q", time.Since(start).Round(time.Millisecond), keys)
	if code != exitFindings {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
	named := 0
	for _, f := range findings {
		if f.Rule != "engine-restarts" {
			continue
		}
		named++
		var last bool
		for _, e := range f.Evidence {
			last = last || e.Key == "last failure"
		}
		if !last || !strings.Contains(f.Remedy, "pdctl fault off overlap-local-decision") {
			t.Errorf("%s: %+v", f.Where(), f)
		}
	}
	if named == 0 {
		t.Fatalf("no engine-restarts finding: %q", keys)
	}
}
