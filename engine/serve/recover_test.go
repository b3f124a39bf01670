package serve

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRecoverStalledCollective: with stall-last-rank on and a short
// collective timeout, rank 0 waits in the step input's broadcast for rank
// 1; past the timeout the engine gives the group up, fails the request in
// flight with the stalled collective as its reason, rebuilds the group
// (counted, the failed group's flight recorder kept) and serves again: the
// next 20 requests' greedy outputs equal a reference engine's, and the
// pools balance.
func TestRecoverStalledCollective(t *testing.T) {
	m := tinyModel(t)
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, Heartbeat: 10 * time.Millisecond,
		CollectiveWatchdog: 50 * time.Millisecond, CollectiveTimeout: 500 * time.Millisecond}
	e := newEngine(t, m, cfg)
	ref := newEngine(t, m, Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4})
	boot := e.sup.cur().boot

	if err := e.SetFault(FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	s, err := e.Submit(context.Background(), Request{Prompt: testmodel.Prompts(3, 1, 8, 8, e.vocab)[0], MaxTokens: 4, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, fin := collect(t, s, 10*time.Second)
	// The switch goes off at once: the rebuilt group's last rank stalls
	// too while it is on, and would break that group as well after the
	// collective timeout, leaving another failure the last one.
	if err := e.SetFault(FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	const want = "error: engine restarted: rank 1 did not reach control seq "
	if !strings.HasPrefix(fin.Reason, want) || !strings.HasSuffix(fin.Reason, "within 500ms") {
		t.Fatalf("finish %q, want %q...within 500ms", fin.Reason, want)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the request failed after %v", took)
	}
	waitfor.Check(t, "the restart counted", 10*time.Second, func() bool { return e.View().Snapshot().Totals.Restarts >= 1 })
	switch f := e.View().LastFailure(); {
	case f == nil:
		t.Fatal("no last failure after a restart")
	case f.Boot == boot:
		if f.Reason != strings.TrimPrefix(fin.Reason, "error: engine restarted: ") {
			t.Fatalf("last failure %q, want the finish's reason %q", f.Reason, fin.Reason)
		}
	default:
		// The switch went off only after the rebuilt group had stalled
		// past the timeout as well (a loaded machine, slow to run this
		// goroutine): that group's failure is the last one.
		if !strings.HasPrefix(f.Reason, "rank 1 did not reach control seq ") {
			t.Fatalf("last failure of a later group %+v, want the stalled rank", f)
		}
		waitfor.Check(t, "the second restart counted", 10*time.Second, func() bool { return e.View().Restarts() >= 2 })
	}
	f := e.View().LastFailure()
	if len(f.Collectives) != 2 || f.Collectives[0].Name != CommControl || len(f.Collectives[0].Ranks[0].Records) == 0 {
		t.Fatalf("the failed group's collectives: %+v", f.Collectives)
	}
	if e.sup.cur().boot == boot || e.View().Restarts() < 1 {
		t.Fatalf("boot %d after the restart (was %d), %d restarts", e.sup.cur().boot, boot, e.View().Restarts())
	}

	prompts := testmodel.Prompts(21, 20, 4, 12, e.vocab)
	for i, p := range prompts {
		q := Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true}
		got, gs := submitCollect(t, e, q)
		exp, es := submitCollect(t, ref, q)
		if !slices.Equal(got, exp) || gs.Reason != ReasonLength || es.Reason != ReasonLength {
			t.Fatalf("prompt %d after the restart: %v (%s), reference %v (%s)", i, got, gs.Reason, exp, es.Reason)
		}
	}
	checkPools(t, e)
}

func submitCollect(t *testing.T, e *Engine, q Request) ([]int32, Finish) {
	t.Helper()
	s, err := e.Submit(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	return collect(t, s, 20*time.Second)
}

// TestRecoverPDPrefill: a prefill that rebuilds its group keeps its
// endpoints and sends a new boot number: the decode's room with the old
// incarnation fails, and the next requests succeed.
func TestRecoverPDPrefill(t *testing.T) {
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, Heartbeat: 10 * time.Millisecond,
		CollectiveWatchdog: 50 * time.Millisecond, CollectiveTimeout: 500 * time.Millisecond}
	pp := newPDPair(t, cfg)
	q := Request{Prompt: testmodel.Prompts(5, 1, 10, 10, pp.prefill.vocab)[0], MaxTokens: 3, IgnoreEOS: true}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ref, fin, _ := pp.run(t, ctx, q, 5000)
	if fin.Reason != ReasonLength {
		t.Fatalf("before the fault: %q", fin.Reason)
	}
	if err := pp.prefill.SetFault(FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	// The switch goes off as soon as the prefill's restart fails its
	// request, before the decode's side of the room ends: the rebuilt
	// group stalls again while the switch is on, and a second restart
	// would fail the next request too.
	ps, ds := pp.submit(t, ctx, q, 5001)
	_, pfin := collect(t, ps, 30*time.Second)
	waitfor.Check(t, "the prefill's restart", 10*time.Second, func() bool { return pp.prefill.View().Snapshot().Totals.Restarts >= 1 })
	if err := pp.prefill.SetFault(FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	dtoks, dfin := collect(t, ds, 30*time.Second)
	// The decode's side fails, unless its KV had all gone out before the
	// last rank stalled: the iteration that admits a room whose
	// TRANSFER_INFO came first can also prefill it and send its KV, and the
	// stall comes only at the top of the next one. Such a decode needs
	// nothing more from the prefill and finishes with the reference tokens.
	decodeOK := strings.HasPrefix(dfin.Reason, "error:") || dfin.Reason == ReasonLength && slices.Equal(dtoks, ref)
	if !strings.HasPrefix(pfin.Reason, "error: engine restarted: ") || !decodeOK {
		t.Fatalf("in flight at the restart: prefill %q, decode %v %q (reference %v)", pfin.Reason, dtoks, dfin.Reason, ref)
	}
	// Under load the rebuilt group may have stalled past the timeout
	// before the switch went off, and restarted once more: a request
	// racing that restart fails on the changed incarnation, as it must.
	// Once a request passes, the restarts are over and the next ones pass.
	room := uint64(5002)
	var toks []int32
	passed := waitfor.Poll(10*time.Second, func() bool {
		toks, fin, _ = pp.run(t, ctx, q, room)
		room++
		if fin.Reason == ReasonLength && slices.Equal(toks, ref) {
			return true
		}
		if !strings.Contains(fin.Reason, "restarted") && !strings.Contains(fin.Reason, "prefill peer failed or went away") {
			t.Fatalf("after the restart: %v %q, want %v", toks, fin.Reason, ref)
		}
		return false
	})
	if !passed {
		t.Fatalf("after the restart, still failing after 10s: %v %q, want %v", toks, fin.Reason, ref)
	}
	for i := range 3 {
		toks, fin, _ := pp.run(t, ctx, q, room+uint64(i))
		if fin.Reason != ReasonLength || !slices.Equal(toks, ref) {
			t.Fatalf("after the restart, request %d: %v %q, want %v", i, toks, fin.Reason, ref)
		}
	}
	checkPools(t, pp.prefill)
	checkPools(t, pp.decode)
}
