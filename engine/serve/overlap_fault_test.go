package serve

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// overlapFaultBound is how long after its first PD request a server with
// overlap-local-decision on may take to break its group: the request's
// first iteration with no new mail for rank 1 comes within a few steps.
const overlapFaultBound = 5 * time.Second

// TestFaultOverlapLocalDecision: with overlap-local-decision on, in the
// overlap loop at TP 2, rank 1 of the decode (then of the prefill) takes
// the idle branch on its own empty mail while rank 0 enters the poll: the
// request fails at once with the collective mismatch as the restart's
// reason (rank 0's poll, or room, AllReduceMin against rank 1's step-input
// Broadcast), the engine rebuilds its group, and with the switch off the
// next 20 requests give the reference tokens. In the lock-step loop the
// same switch changes nothing.
func TestFaultOverlapLocalDecision(t *testing.T) {
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, Heartbeat: 10 * time.Millisecond, Schedule: ScheduleOverlap,
		CollectiveWatchdog: 50 * time.Millisecond, CollectiveTimeout: 500 * time.Millisecond,
		// The peer of a server that restarted ends its side of the room
		// within these.
		PD: PDConfig{BootstrapTimeout: 2 * time.Second, InflightTimeout: 2 * time.Second}}
	pp := newPDPair(t, cfg)
	q := Request{Prompt: testmodel.Prompts(7, 1, 10, 10, pp.prefill.vocab)[0], MaxTokens: 4, IgnoreEOS: true}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ref, fin, _ := pp.run(t, ctx, q, 7000)
	if fin.Reason != ReasonLength {
		t.Fatalf("before the fault: %q", fin.Reason)
	}
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		if err := rankcore.CheckLog(&rankcore.Overlap, controlLog(e.View().Collectives()[0])); err != nil {
			t.Fatalf("%s before the fault: %v", e.cfg.Role, err)
		}
	}
	room := uint64(7001)
	for _, side := range []struct {
		name string
		e    *Engine
	}{{"prefill", pp.prefill}, {"decode", pp.decode}} {
		e := side.e
		// The room the last side's restart failed may still wait on this
		// side for its peer's word; with the switch on, its iteration
		// would break the group before the request does.
		pp.drained(t, 10*time.Second)
		boot := e.sup.cur().boot
		if err := e.SetFault(FaultOverlapLocalDecision, true); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		ps, ds := pp.submit(t, ctx, q, room)
		room++
		s, other := ds, ps
		if e == pp.prefill {
			s, other = ps, ds
		}
		_, f := collect(t, s, 30*time.Second)
		took := time.Since(start)
		t.Logf("%s: the group broke %v after the request: %s", side.name, took.Round(time.Millisecond), f.Reason)
		if !strings.HasPrefix(f.Reason, "error: engine restarted: ") || !strings.Contains(f.Reason, "dist: collective mismatch") ||
			!strings.Contains(f.Reason, "rank 0 AllReduceMin") || !strings.Contains(f.Reason, "rank 1 Broadcast") {
			t.Fatalf("%s: finish %q, want the restart on rank 0's AllReduceMin against rank 1's step input", side.name, f.Reason)
		}
		if took > overlapFaultBound {
			t.Errorf("%s: the group broke %v after the request, want within %v", side.name, took, overlapFaultBound)
		}
		collect(t, other, 30*time.Second) // the peer server's side fails too
		waitfor.Check(t, side.name+"'s restart", 10*time.Second, func() bool { return e.View().Restarts() >= 1 && e.sup.cur().boot != boot })
		if err := e.SetFault(FaultOverlapLocalDecision, false); err != nil {
			t.Fatal(err)
		}
		if lf := e.View().LastFailure(); lf == nil || lf.Boot != boot || "error: engine restarted: "+lf.Reason != f.Reason {
			t.Fatalf("%s: last failure %v, want boot %d and the finish's reason", side.name, lf != nil, boot)
		}
		checkPartedAtIdle(t, side.name, e.View().LastFailure().Collectives[0])
	}
	// The prefill restarted first, then the decode (whose new
	// incarnation hears the prefill's new boot number afresh).
	for i := range 20 {
		toks, dfin, pfin := pp.run(t, ctx, q, room)
		room++
		if dfin.Reason != ReasonLength || pfin.Reason != ReasonLength || !slices.Equal(toks, ref) {
			t.Fatalf("request %d after the restarts: %v, decode %q, prefill %q; want %v", i, toks, dfin.Reason, pfin.Reason, ref)
		}
	}
	checkPools(t, pp.prefill)
	checkPools(t, pp.decode)

	// The lock-step loop has no local branch: the switch is inert there.
	ls := cfg
	ls.Schedule = ScheduleLockstep
	lp := newPDPair(t, ls)
	for _, e := range []*Engine{lp.prefill, lp.decode} {
		if err := e.SetFault(FaultOverlapLocalDecision, true); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 5 {
		toks, dfin, _ := lp.run(t, ctx, q, 8000+uint64(i))
		if dfin.Reason != ReasonLength || !slices.Equal(toks, ref) {
			t.Fatalf("lockstep with the switch on, request %d: %v %q", i, toks, dfin.Reason)
		}
	}
	if lp.prefill.View().Restarts()+lp.decode.View().Restarts() != 0 {
		t.Fatalf("lockstep restarted with the switch on")
	}
	for _, e := range []*Engine{lp.prefill, lp.decode} {
		if err := rankcore.CheckLog(&rankcore.Lockstep, controlLog(e.View().Collectives()[0])); err != nil {
			t.Fatalf("lockstep %s with the switch on: %v", e.cfg.Role, err)
		}
	}
}

// TestFaultOverlapLocalDecisionRoles: the switch is a PD one.
func TestFaultOverlapLocalDecisionRoles(t *testing.T) {
	e := newEngine(t, tinyModel(t), Config{TP: 2, PageSize: 4, KVTokens: 128, Schedule: ScheduleOverlap})
	if err := e.SetFault(FaultOverlapLocalDecision, true); err == nil || !strings.Contains(err.Error(), "applies to [prefill decode] servers") {
		t.Fatalf("colocated: %v", err)
	}
}
