package hicache

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache/kvtest"

	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// A load lands the host bytes on the device pages bit for bit, in every
// precision and with no indexer.
func TestLoadRoundTrip(t *testing.T) {
	for _, dt := range append([]kernels.IndexKDType{noIndexer}, dtypes...) {
		t.Run(dtName(dt), func(t *testing.T) {
			r := newRig(t, devConfig(dt), 8, 0)
			snap, _ := r.backupNew(1, 3)
			dst := r.newSeq(3, true) // stale data the load must overwrite
			l, err := r.ld.Submit(1, dst.Pages())
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Wait(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			got := kvtest.PageBytes(r.dev, dst.Pages())
			if !equalBytes(got, snap) || !equalBytes(got, hostBytes(r.host, 1)) {
				t.Fatal("device pages differ from the host bytes")
			}
			if r.host.Pinned(1) || r.ld.InFlight() != 0 {
				t.Fatal("a finished load still pins its entry or is in flight")
			}
			r.release(dst)
			check(t, r)
		})
	}
}

// With the loader held before layer i, both gates of layers < i pass, both
// gates of layers >= i block, the device holds the host bytes exactly for
// the layers done and stale bytes from layer i on; after release every gate
// passes and the pages equal the host's.
func TestGatesHoldAtLayer(t *testing.T) {
	for _, dt := range dtypes {
		c := devConfig(dt)
		for hold := range c.Layers {
			t.Run(dtName(dt)+"/layer"+string(rune('0'+hold)), func(t *testing.T) {
				r := newRig(t, c, 8, 0)
				snap, _ := r.backupNew(1, 2)
				dst := r.newSeq(2, true)
				stale := kvtest.PageBytes(r.dev, dst.Pages())
				r.ld.HoldBeforeLayer(hold)
				l, err := r.ld.Submit(1, dst.Pages())
				if err != nil {
					t.Fatal(err)
				}
				waitHeld(t, r.ld, hold)
				ctx := ctxT(t)
				for layer := range c.Layers {
					if layer < hold {
						if err := l.WaitKV(ctx, layer); err != nil {
							t.Fatalf("WaitKV(%d): %v", layer, err)
						}
						if err := l.WaitIndexK(ctx, layer); err != nil {
							t.Fatalf("WaitIndexK(%d): %v", layer, err)
						}
						continue
					}
					if !blocks(t, func(ctx context.Context) error { return l.WaitKV(ctx, layer) }) {
						t.Fatalf("WaitKV(%d) passed with the loader held at %d", layer, hold)
					}
					if !blocks(t, func(ctx context.Context) error { return l.WaitIndexK(ctx, layer) }) {
						t.Fatalf("WaitIndexK(%d) passed with the loader held at %d", layer, hold)
					}
				}
				now := kvtest.PageBytes(r.dev, dst.Pages())
				for layer := range c.Layers {
					want := snap
					if layer >= hold {
						want = stale
					}
					if !layerEqual(now, want, layer, false) || !layerEqual(now, want, layer, true) {
						t.Fatalf("layer %d holds neither what it should (held at %d)", layer, hold)
					}
				}
				if kv, ix, over := l.Progress(); kv != hold || ix != hold || over {
					t.Fatalf("progress %d/%d over=%v, want %d", kv, ix, over, hold)
				}
				r.ld.ReleaseHold()
				for layer := range c.Layers {
					if err := l.WaitIndexK(ctx, layer); err != nil {
						t.Fatal(err)
					}
					if err := l.WaitKV(ctx, layer); err != nil {
						t.Fatal(err)
					}
				}
				if err := l.Wait(ctx); err != nil {
					t.Fatal(err)
				}
				if !equalBytes(kvtest.PageBytes(r.dev, dst.Pages()), hostBytes(r.host, 1)) {
					t.Fatal("after the load the device differs from the host")
				}
				if err := l.WaitKV(ctx, c.Layers); err == nil {
					t.Fatal("a wait for a layer beyond the model passed")
				}
				check(t, r)
			})
		}
	}
}

// An abort mid-way stops the loader, fails the waiters of later layers,
// frees the ring slot and leaves the host entry intact and unpinned; a queued
// load aborts without starting.
func TestAbortMidway(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexBF16), 8, 2)
	snap, _ := r.backupNew(1, 2)
	r.backupNew(2, 1)
	dst, dst2 := r.newSeq(2, true), r.newSeq(1, true)
	stale2 := kvtest.PageBytes(r.dev, dst2.Pages())
	r.ld.HoldBeforeLayer(1)
	l, err := r.ld.Submit(1, dst.Pages())
	if err != nil {
		t.Fatal(err)
	}
	queued, err := r.ld.Submit(2, dst2.Pages())
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, 1)
	ctx := ctxT(t)
	if err := queued.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if err := queued.Wait(ctx); !errors.Is(err, ErrAborted) {
		t.Fatalf("queued load after abort: %v", err)
	}
	if err := l.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitKV(ctx, 2); !errors.Is(err, ErrAborted) {
		t.Fatalf("wait on an aborted load: %v", err)
	}
	if err := l.WaitIndexK(ctx, 0); !errors.Is(err, ErrAborted) {
		t.Fatalf("wait on an aborted load: %v", err)
	}
	if !equalBytes(hostBytes(r.host, 1), snap) || r.host.Pinned(1) || r.host.Pinned(2) {
		t.Fatal("the abort touched the host entry or left it pinned")
	}
	if !equalBytes(kvtest.PageBytes(r.dev, dst2.Pages()), stale2) {
		t.Fatal("an aborted queued load wrote the device")
	}
	if r.ld.InFlight() != 0 {
		t.Fatalf("%d loads in flight after the aborts", r.ld.InFlight())
	}
	r.release(dst) // the caller frees the aborted load's pages
	r.ld.ReleaseHold()
	// Both slots are free again: two loads take them.
	dst3 := r.newSeq(2, false)
	l3, err := r.ld.Submit(1, dst3.Pages())
	if err != nil {
		t.Fatal(err)
	}
	l4, err := r.ld.Submit(2, dst2.Pages())
	if err != nil {
		t.Fatal(err)
	}
	if err := l3.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l4.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !equalBytes(kvtest.PageBytes(r.dev, dst3.Pages()), snap) {
		t.Fatal("reload after abort differs")
	}
	check(t, r)
}

// The producer ring hands out slots in order and refuses a slot whose load
// has not finished its last layer.
func TestRingRefusesBusySlot(t *testing.T) {
	c := devConfig(kernels.IndexFP8)
	r := newRig(t, c, 8, 2)
	for k := range Key(3) {
		r.backupNew(k+1, 1)
	}
	d1, d2, d3 := r.newSeq(1, false), r.newSeq(1, false), r.newSeq(1, false)
	r.ld.HoldBeforeLayer(c.Layers - 1)
	a, err := r.ld.Submit(1, d1.Pages())
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, c.Layers-1)
	if kv, _, _ := a.Progress(); kv != c.Layers-1 {
		t.Fatalf("held load has %d layers done", kv)
	}
	b, err := r.ld.Submit(2, d2.Pages())
	if err != nil {
		t.Fatal(err)
	}
	if a.Slot() != 0 || b.Slot() != 1 {
		t.Fatalf("slots %d, %d", a.Slot(), b.Slot())
	}
	if _, err := r.ld.Submit(3, d3.Pages()); !errors.Is(err, ErrSlotBusy) {
		t.Fatalf("reuse of a slot whose last layer is not done: %v", err)
	}
	if r.host.Pinned(3) {
		t.Fatal("a refused load left its entry pinned")
	}
	r.ld.ReleaseHold()
	ctx := ctxT(t)
	if err := a.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	c3, err := r.ld.Submit(3, d3.Pages())
	if err != nil {
		t.Fatal(err)
	}
	if c3.Slot() != 0 {
		t.Fatalf("third load in slot %d, want 0", c3.Slot())
	}
	// The old handle of slot 0 still answers for its own, finished load.
	if err := a.WaitKV(ctx, c.Layers-1); err != nil {
		t.Fatal(err)
	}
	for _, l := range []*Load{b, c3} {
		if err := l.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	check(t, r)
}

// Concurrent hits on one key share one load; it stops only when every
// holder aborted.
func TestJoinSharesLoad(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexFP8), 8, 0)
	snap, _ := r.backupNew(1, 2)
	dst := r.newSeq(2, false)
	r.ld.HoldBeforeLayer(1)
	l, err := r.ld.Submit(1, dst.Pages())
	if err != nil {
		t.Fatal(err)
	}
	j, ok := r.ld.Join(1)
	if !ok || j != l {
		t.Fatal("Join did not return the load in flight")
	}
	if _, err := r.ld.Submit(1, r.newSeq(2, false).Pages()); !errors.Is(err, ErrLoading) {
		t.Fatalf("second load of a loading key: %v", err)
	}
	waitHeld(t, r.ld, 1)
	ctx := ctxT(t)
	if err := j.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	r.ld.ReleaseHold()
	if err := l.Wait(ctx); err != nil {
		t.Fatalf("one holder's abort stopped the shared load: %v", err)
	}
	if !equalBytes(kvtest.PageBytes(r.dev, dst.Pages()), snap) {
		t.Fatal("shared load differs")
	}
	if _, ok := r.ld.Join(1); ok {
		t.Fatal("Join found a finished load")
	}
	if err := l.Abort(ctx); err != nil { // the last holder of a finished load
		t.Fatal(err)
	}

	// Once its last holder aborts, a load is not joined, even before the
	// loader has stopped it, and a new load of the key may start.
	r.ld.HoldBeforeLayer(1)
	dst2 := r.newSeq(2, false)
	l2, err := r.ld.Submit(1, dst2.Pages())
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, 1)
	gone, cancel := context.WithCancel(ctx)
	cancel()
	if err := l2.Abort(gone); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	if _, ok := r.ld.Join(1); ok {
		t.Fatal("Join found a load whose last holder aborted")
	}
	if err := l2.Wait(ctx); !errors.Is(err, ErrAborted) {
		t.Fatalf("aborted load ended with %v", err)
	}
	r.ld.ReleaseHold()
	r.release(dst2)
	check(t, r)
}

// Pacing makes a load take at least its bytes over the budget.
func TestPacing(t *testing.T) {
	c := devConfig(kernels.IndexBF16)
	r := newRig(t, c, 8, 0)
	r.backupNew(1, 2)
	bytes := int64(2 * r.host.Layout().PageBytes)
	want := 60 * time.Millisecond
	r.ld.SetBandwidth(bytes * int64(time.Second) / int64(want))
	start := time.Now()
	l, err := r.ld.Submit(1, r.newSeq(2, false).Pages())
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if got := time.Since(start); got < want*9/10 {
		t.Fatalf("paced load took %v, want at least %v", got, want)
	}
	r.ld.SetBandwidth(0)
	if r.ld.Bandwidth() != 0 {
		t.Fatal("bandwidth not reset")
	}
}

// Close with a running and a queued load returns, fails both loads' waiters,
// unpins their entries and leaves no goroutine behind.
func TestCloseWithLoadsInFlight(t *testing.T) {
	before := runtime.NumGoroutine()
	r := newRig(t, devConfig(kernels.IndexFP8), 8, 0)
	r.backupNew(1, 2)
	r.backupNew(2, 2)
	r.ld.HoldBeforeLayer(1)
	a, err := r.ld.Submit(1, r.newSeq(2, false).Pages())
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.ld.Submit(2, r.newSeq(2, false).Pages())
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, 1)
	r.ld.Close()
	select {
	case <-r.ld.exited:
	default:
		t.Fatal("Close returned before the goroutine exited")
	}
	ctx := ctxT(t)
	for _, l := range []*Load{a, b} {
		if err := l.WaitKV(ctx, 2); !errors.Is(err, ErrClosed) {
			t.Fatalf("wait after Close: %v", err)
		}
	}
	if r.host.Pinned(1) || r.host.Pinned(2) || !r.host.Has(1) || !r.host.Has(2) {
		t.Fatal("Close left entries pinned or dropped them")
	}
	if _, err := r.ld.Submit(1, []int32{10, 11}); !errors.Is(err, ErrClosed) {
		t.Fatalf("submit after Close: %v", err)
	}
	r.ld.Close() // idempotent
	waitfor.NoError(t, "the loader's goroutines ending", 10*time.Second, func() error {
		if n := runtime.NumGoroutine(); n > before {
			return fmt.Errorf("%d goroutines, %d before", n, before)
		}
		return nil
	})
	check(t, r)
}

// Held between layer i's KV and its index-K, the KV gate of layer i passes
// and the index-K gate blocks, with the device holding the new KV and the
// stale index keys: the state the incident's indexer read.
func TestIndexKGateSeparate(t *testing.T) {
	for _, dt := range dtypes {
		t.Run(dtName(dt), func(t *testing.T) {
			c := devConfig(dt)
			r := newRig(t, c, 8, 0)
			snap, _ := r.backupNew(1, 2)
			dst := r.newSeq(2, true)
			stale := kvtest.PageBytes(r.dev, dst.Pages())
			const hold = 1
			r.ld.HoldBeforeIndexK(hold)
			l, err := r.ld.Submit(1, dst.Pages())
			if err != nil {
				t.Fatal(err)
			}
			waitHeldAt(t, r.ld, hold, true)
			ctx := ctxT(t)
			if err := l.WaitKV(ctx, hold); err != nil {
				t.Fatal(err)
			}
			if !blocks(t, func(ctx context.Context) error { return l.WaitIndexK(ctx, hold) }) {
				t.Fatal("index-K gate passed before the layer's index keys landed")
			}
			if kv, ix, _ := l.Progress(); kv != hold+1 || ix != hold {
				t.Fatalf("progress %d/%d, want %d/%d", kv, ix, hold+1, hold)
			}
			now := kvtest.PageBytes(r.dev, dst.Pages())
			if !layerEqual(now, snap, hold, false) || !layerEqual(now, stale, hold, true) {
				t.Fatal("layer's KV should be loaded and its index keys stale")
			}
			r.ld.ReleaseHold()
			if err := l.WaitIndexK(ctx, hold); err != nil {
				t.Fatal(err)
			}
			if err := l.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if !equalBytes(kvtest.PageBytes(r.dev, dst.Pages()), snap) {
				t.Fatal("device differs after the load")
			}
		})
	}
}
