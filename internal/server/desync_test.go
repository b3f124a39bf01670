package server

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// pollHealth asks srv for /health until ok accepts the answer, failing the
// test at the deadline.
func pollHealth(t *testing.T, e *env, what string, within time.Duration, ok func(int, HealthResponse) bool) (int, HealthResponse) {
	t.Helper()
	var code int
	var h HealthResponse
	waitfor.NoError(t, what, within, func() error {
		if code, h = healthOf(t, e.srv); !ok(code, h) {
			return fmt.Errorf("last /health: %d %+v", code, h)
		}
		return nil
	})
	return code, h
}

// durations masks the times in a health reason, which change from run to
// run.
var durations = regexp.MustCompile(`for [0-9.]+(?:µs|ms|s|m[0-9.]+s)`)

// TestHealthNamesTheStalledCollective: with stall-last-rank on at TP 2,
// rank 1 stops before its next collective and rank 0 waits in the step
// input's broadcast; once the loop has not iterated for --stall-after,
// /health answers 503 saying which rank waits in which collective (control
// seq, op) and that rank 1 is in none (its last seq), in words and as
// data. With the switch off the ranks meet again and /health is 200.
func TestHealthNamesTheStalledCollective(t *testing.T) {
	const stallAfter = 300 * time.Millisecond
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 2}, Options{StallAfter: stallAfter})
	pollHealth(t, e, "healthy at start", 10*time.Second, func(code int, h HealthResponse) bool { return code == 200 })
	// Rank 1 must have completed a control collective before it stalls, so
	// the reason names its last one; /health is 200 before the first.
	waitControlCompleted(t, e, 10*time.Second)
	if err := e.eng.SetFault(serve.FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	on := time.Now()
	_, h := pollHealth(t, e, "503 with the stall", 10*time.Second, func(code int, h HealthResponse) bool { return code == 503 })
	took := time.Since(on)
	t.Logf("%v after the fault: %s", took.Round(time.Millisecond), h.Reason)
	// The loop iterates every heartbeat (50ms) even idle, so it is seen
	// stalled one stall bound after its last iteration began.
	if bound := stallAfter + 2*time.Second; took > bound {
		t.Errorf("503 came %v after the fault, want within %v", took, bound)
	}
	if len(h.Stalls) != 1 {
		t.Fatalf("stalls %+v, want one: %+v", h.Stalls, h)
	}
	st := h.Stalls[0]
	if st.Comm != debug.CommControl || st.Op != "Broadcast" || len(st.Arrived) != 1 || st.Arrived[0] != 0 ||
		len(st.Missing) != 1 || st.Missing[0].Rank != 1 || st.Missing[0].InCollective || st.Missing[0].Seq != st.Seq-1 {
		t.Errorf("stall %+v, want control Broadcast with rank 0 arrived and rank 1 not in a collective, one seq behind", st)
	}
	want := fmt.Sprintf("engine loop has not iterated for * (limit 300ms): rank 0 waits in control seq %d Broadcast for *; "+
		"rank 1 is not in a collective (last control seq %d %s)", st.Seq, st.Missing[0].Seq, st.Missing[0].Op)
	if got := durations.ReplaceAllString(h.Reason, "for *"); h.Status != HealthUnhealthy || got != want {
		t.Errorf("status %q, reason\n%q\nwant\n%q", h.Status, got, want)
	}
	if len(h.Ranks) != 2 || h.Ranks[0].Rank != 0 || len(h.Ranks[0].Waiting) != 1 || h.Ranks[1].Rank != 1 || len(h.Ranks[1].Waiting) != 0 {
		t.Fatalf("ranks %+v", h.Ranks)
	}
	if w := h.Ranks[0].Waiting[0]; w.Comm != debug.CommControl || w.Seq != st.Seq || w.Op != "Broadcast" || w.WaitedMS <= 0 {
		t.Errorf("rank 0 waits in %+v, want control seq %d Broadcast", w, st.Seq)
	}
	if h.Ranks[0].Phase == "" || h.Ranks[1].Phase == "" || h.Broken != nil {
		t.Errorf("ranks %+v, broken %+v", h.Ranks, h.Broken)
	}

	if err := e.eng.SetFault(serve.FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	_, h = pollHealth(t, e, "200 once the switch is off", 10*time.Second, func(code int, h HealthResponse) bool { return code == 200 })
	if h.Status != HealthOK || h.Reason != "" || h.Ranks != nil || h.Stalls != nil {
		t.Errorf("healthy again: %+v", h)
	}
}

// waitControlCompleted polls until every rank has completed at least one
// collective on the control communicator.
func waitControlCompleted(t *testing.T, e *env, within time.Duration) {
	t.Helper()
	waitfor.For(t, "a control collective completed on every rank", within, func() bool {
		for _, g := range e.eng.View().Collectives() {
			if g.Name != debug.CommControl {
				continue
			}
			done := len(g.Ranks) > 0
			for _, r := range g.Ranks {
				done = done && r.LastCompleted > 0
			}
			if done {
				return true
			}
		}
		return false
	})
}

// brokenGroup is a communicator broken as the overlap-schedule desync
// breaks one: rank 0 enters the step input's broadcast while rank 1 comes
// back from its other branch with another collective, a barrier, at the
// same seq: a mismatch on both ranks, and the group broken for good.
func brokenGroup(t *testing.T) *dist.Group {
	t.Helper()
	g, err := dist.NewGroup(2, dist.Options{Name: debug.CommControl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	errs := make([]error, 2)
	var wg sync.WaitGroup
	wg.Go(func() { _, errs[0] = g.Rank(0).BroadcastBytes(ctx, 0, []byte("step input")) })
	wg.Go(func() { errs[1] = g.Rank(1).Barrier(ctx) })
	wg.Wait()
	var me *dist.MismatchError
	for r, err := range errs {
		if !errors.As(err, &me) {
			t.Fatalf("rank %d: %v, want a mismatch", r, err)
		}
	}
	return g
}

// TestHealthBrokenGroupIsUnhealthy: a communicator that broke on a
// mismatch makes the server unhealthy at once, whatever the loop's age,
// naming the communicator and why it broke; a healthy one (a group rebuilt
// after the break) leaves the answer alone.
func TestHealthBrokenGroupIsUnhealthy(t *testing.T) {
	now := time.Now()
	steps := []serve.StepRecord{{Rank: 0, Step: 7, Phase: "idle"}, {Rank: 1, Step: 7, Phase: "idle"}}
	fresh, err := dist.NewGroup(2, dist.Options{Name: debug.CommForward})
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	broken := brokenGroup(t).Snapshot()
	if broken.Broken == "" || !strings.Contains(broken.Broken, "Barrier") {
		t.Fatalf("the group did not break on the mismatch: %+v", broken)
	}

	var resp HealthResponse
	if judgeHealth(&resp, serve.Health{LoopAge: time.Millisecond}, 5*time.Second, []dist.Snapshot{broken, fresh.Snapshot()}, nil, steps, now) != true {
		t.Fatal("a broken group is healthy")
	}
	if want := "the control communicator is broken: " + broken.Broken; resp.Status != HealthUnhealthy || resp.Reason != want {
		t.Errorf("status %q, reason %q, want %q", resp.Status, resp.Reason, want)
	}
	if len(resp.Broken) != 1 || resp.Broken[0] != (HealthBroken{Comm: debug.CommControl, Reason: broken.Broken}) || len(resp.Ranks) != 2 || resp.Ranks[1].Phase != "idle" {
		t.Errorf("broken %+v, ranks %+v", resp.Broken, resp.Ranks)
	}

	// The engine failed on the break too: both are said, the failure first.
	resp = HealthResponse{}
	judgeHealth(&resp, serve.Health{Err: "serve: rank 0: step input: mismatch"}, 5*time.Second, []dist.Snapshot{broken}, nil, steps, now)
	if want := "engine failed: serve: rank 0: step input: mismatch; the control communicator is broken: " + broken.Broken; resp.Reason != want {
		t.Errorf("reason %q, want %q", resp.Reason, want)
	}

	resp = HealthResponse{Status: HealthOK}
	if judgeHealth(&resp, serve.Health{LoopAge: time.Millisecond}, 5*time.Second, []dist.Snapshot{fresh.Snapshot()}, nil, steps, now) ||
		resp.Status != HealthOK || resp.Reason != "" || resp.Ranks != nil || resp.Broken != nil {
		t.Errorf("a healthy group: %+v", resp)
	}
}

// After the engine gives a stalled group up and rebuilds it, /debug/v1/
// collectives keeps the failed group beside the live one: the reason (the
// stalled collective), the old boot number and its flight recorders.
func TestCollectivesKeepTheRecoveredGroup(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 2,
		CollectiveWatchdog: 200 * time.Millisecond, CollectiveTimeout: 500 * time.Millisecond}, Options{})
	var before debug.CollectivesResponse
	getJSON(t, e, "/debug/v1/collectives", &before)
	if before.LastFailure != nil {
		t.Fatalf("a failure before any: %+v", before.LastFailure)
	}
	if err := e.eng.SetFault(serve.FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the engine recovering", 20*time.Second, func() bool { return e.eng.View().Restarts() != 0 })
	if err := e.eng.SetFault(serve.FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	var got debug.CollectivesResponse
	getJSON(t, e, "/debug/v1/collectives", &got)
	f := got.LastFailure
	switch {
	case f == nil:
		t.Fatal("no last_failure after a recovery")
	case !strings.Contains(f.Reason, "did not reach control seq") || f.Boot == "" || len(f.Comms) != 2:
		t.Fatalf("last_failure %+v", f)
	case f.Comms[0].Name != serve.CommControl || len(f.Comms[0].Ranks) != 2 || len(f.Comms[0].Ranks[0].Records) == 0:
		t.Fatalf("the failed control group %+v", f.Comms[0])
	}
}
