package serve

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestFaultList: names are unique, fit the switch array, each applies to a
// role, and a switch refuses a server of another role.
func TestFaultList(t *testing.T) {
	if len(faultSpecs) > maxFaults {
		t.Fatalf("%d fault switches, room for %d", len(faultSpecs), maxFaults)
	}
	seen := map[string]bool{}
	for _, f := range faultSpecs {
		if seen[f.Name] || f.Name == "" || f.Doc == "" || len(f.Roles) == 0 {
			t.Errorf("fault %+v: duplicate, unnamed, undocumented or of no role", f)
		}
		seen[f.Name] = true
	}
	for _, tt := range []pdproto.Type{pdproto.TypeKVChunk, pdproto.TypeHeartbeat} {
		if !seen[FaultDrop(tt)] || !seen[FaultDelay(tt)] {
			t.Errorf("no drop or delay switch for %s", tt)
		}
	}
	if FaultDrop(pdproto.TypeAbortAck) != "drop-abort-ack" {
		t.Errorf("FaultDrop(ABORT_ACK) = %q", FaultDrop(pdproto.TypeAbortAck))
	}
	if err := checkFault(FaultDrop(pdproto.TypeKVChunk), pdproto.RolePrefill); err == nil {
		t.Error("a prefill took drop-kv-chunk, which only a decode receives")
	}
}

// TestFaultStallLastRank: with stall-last-rank on, rank 1 stops before its
// next collective; rank 0 waits in it, the watchdog names rank 1 missing,
// nothing progresses; switched off, the request completes.
func TestFaultStallLastRank(t *testing.T) {
	var mu sync.Mutex
	var stalls []dist.Stall
	e := newEngine(t, tinyModel(t), Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 2,
		Heartbeat: 10 * time.Millisecond, CollectiveWatchdog: 50 * time.Millisecond, OnStall: func(s dist.Stall) {
			mu.Lock()
			stalls = append(stalls, s)
			mu.Unlock()
		}})
	if err := e.SetFault(FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	s, err := e.Submit(context.Background(), Request{Prompt: testmodel.Prompts(3, 1, 8, 8, e.vocab)[0], MaxTokens: 4, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	waitfor.Check(t, "a stall waiting for rank 1", 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.ContainsFunc(stalls, func(s dist.Stall) bool {
			return slices.Equal(s.Arrived, []int{0}) && len(s.Missing) == 1 && s.Missing[0].Rank == 1 && !s.Missing[0].InCollective
		})
	})
	if fin := e.View().Snapshot().Totals.Finished; fin != 0 {
		t.Fatalf("%d requests finished with rank 1 stalled", fin)
	}
	if err := e.SetFault(FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	if toks, fin := collect(t, s, 10*time.Second); len(toks) != 4 || fin.Reason != ReasonLength {
		t.Fatalf("after the stall: %d tokens, %q", len(toks), fin.Reason)
	}
}

// TestFaultPDMessages: drop-kv-chunk fails the decode's transfers by its
// timeout and counts the drops; delay-kv-chunk holds each chunk 250ms in
// the receive loop, so the request takes at least that long and still
// completes; pd-loop-exit ends the decode's KV loop at its first chunk
// (for good: only a restart brings it back).
func TestFaultPDMessages(t *testing.T) {
	cfg := Config{TP: 1, PageSize: 4, KVTokens: 512, MaxRunning: 4, PD: PDConfig{TransferTimeout: 300 * time.Millisecond}}
	pp := newPDPair(t, cfg)
	q := Request{Prompt: testmodel.Prompts(9, 1, 10, 10, pp.prefill.vocab)[0], MaxTokens: 3, IgnoreEOS: true}
	room := uint64(80000)
	run := func() ([]int32, Finish, time.Duration) {
		t.Helper()
		room++
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		start := time.Now()
		toks, dfin, _ := pp.run(t, ctx, q, room)
		return toks, dfin, time.Since(start)
	}
	set := func(name string, on bool) {
		t.Helper()
		if err := pp.decode.SetFault(name, on); err != nil {
			t.Fatal(err)
		}
	}

	set(FaultDrop(pdproto.TypeKVChunk), true)
	if _, fin, _ := run(); !strings.Contains(fin.Reason, "KV not received within 300ms") {
		t.Errorf("drop-kv-chunk: decode finish %q", fin.Reason)
	}
	if n := pp.decode.PD().Links()[0].Faulted; n == 0 {
		t.Error("drop-kv-chunk: no drop counted")
	}
	set(FaultDrop(pdproto.TypeKVChunk), false)

	set(FaultDelay(pdproto.TypeKVChunk), true)
	if toks, fin, took := run(); len(toks) != 3 || fin.Reason != ReasonLength || took < faultDelay {
		t.Errorf("delay-kv-chunk: %d tokens, %q, in %v (the chunk alone waits %v)", len(toks), fin.Reason, took, faultDelay)
	}
	set(FaultDelay(pdproto.TypeKVChunk), false)

	set(FaultPDLoopExit, true)
	if _, fin, _ := run(); !strings.HasPrefix(fin.Reason, "error: pd:") {
		t.Errorf("pd-loop-exit: decode finish %q", fin.Reason)
	}
	in := pp.decode.PD().Links()[0].Inbox
	if in.Alive || !strings.Contains(in.ExitReason, "fault pd-loop-exit") {
		t.Errorf("pd-loop-exit: the KV loop alive %v, exit reason %q", in.Alive, in.ExitReason)
	}
}

// TestFaultStallLastRankClose: an engine closes with a rank held by
// stall-last-rank: the held rank sees the stop.
func TestFaultStallLastRankClose(t *testing.T) {
	e := newEngine(t, tinyModel(t), Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 2, CloseTimeout: 10 * time.Second})
	if err := e.SetFault(FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- e.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return with a rank stalled")
	}
}
