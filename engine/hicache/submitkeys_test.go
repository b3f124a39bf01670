package hicache

import (
	"context"
	"errors"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache/kvtest"
)

// SubmitKeys loads several entries as one load in one ring slot: layer i of
// every entry lands before layer i is marked, Join by any key shares the
// load, the entries are pinned until it ends, and the bytes arrive exactly.
func TestSubmitKeysLoadsEntriesLayerByLayer(t *testing.T) {
	for _, dt := range dtypes {
		t.Run(dtName(dt), func(t *testing.T) {
			c := devConfig(dt)
			r := newRig(t, c, 3, 1) // host full; one ring slot: one load takes it
			snap1, _ := r.backupNew(1, 1)
			snap2, _ := r.backupNew(2, 2)
			dst := r.newSeq(3, true)
			pages := dst.Pages()
			r.ld.HoldBeforeLayer(1)
			l, err := r.ld.SubmitKeys([]Key{1, 2}, pages)
			if err != nil {
				t.Fatal(err)
			}
			waitHeld(t, r.ld, 1)
			ctx := ctxT(t)
			if err := l.WaitKV(ctx, 0); err != nil {
				t.Fatal(err)
			}
			if err := l.WaitIndexK(ctx, 0); err != nil {
				t.Fatal(err)
			}
			got1, got2 := kvtest.PageBytes(r.dev, pages[:1]), kvtest.PageBytes(r.dev, pages[1:])
			if !layerEqual(got1, snap1, 0, false) || !layerEqual(got2, snap2, 0, false) ||
				!layerEqual(got1, snap1, 0, true) || !layerEqual(got2, snap2, 0, true) {
				t.Fatal("layer 0 of some entry is not on the device once layer 0 is marked")
			}
			if !blocks(t, func(ctx context.Context) error { return l.WaitKV(ctx, 1) }) {
				t.Fatal("WaitKV(1) passed with the loader held at 1")
			}
			if j, ok := r.ld.Join(2); !ok || j != l {
				t.Fatal("Join by the second key does not share the load")
			} else if err := j.Abort(ctx); err != nil {
				t.Fatal(err)
			}
			if !r.host.Pinned(1) || !r.host.Pinned(2) {
				t.Fatal("entries of a running load are not pinned")
			}
			if _, err := r.host.Backup(3, r.dev, pages[:1]); !errors.Is(err, ErrHostFull) {
				t.Fatalf("backup evicted a pinned entry: %v", err)
			}
			if _, err := r.ld.SubmitKeys([]Key{2}, pages[:2]); !errors.Is(err, ErrLoading) && !errors.Is(err, ErrShape) {
				t.Fatalf("second load of a loading key: %v", err)
			}
			r.ld.ReleaseHold()
			if err := l.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if !equalBytes(kvtest.PageBytes(r.dev, pages[:1]), snap1) || !equalBytes(kvtest.PageBytes(r.dev, pages[1:]), snap2) {
				t.Fatal("device pages differ from the host bytes")
			}
			if r.host.Pinned(1) || r.host.Pinned(2) || r.ld.InFlight() != 0 {
				t.Fatal("a finished load still pins or is in flight")
			}
			for _, bad := range [][]Key{nil, {1, 1}, {1, 9}} {
				if _, err := r.ld.SubmitKeys(bad, pages[:2]); err == nil {
					t.Fatalf("SubmitKeys(%v) succeeded", bad)
				}
			}
			if _, err := r.ld.SubmitKeys([]Key{1, 2}, pages[:2]); !errors.Is(err, ErrShape) {
				t.Fatalf("SubmitKeys into too few pages: %v", err)
			}
			r.release(dst)
			check(t, r)
		})
	}
}
