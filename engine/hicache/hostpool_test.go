package hicache

import (
	"errors"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/kernels"
)

// The layout counts every part of a page, sizing follows it, and a pool
// larger than the memory available is refused.
func TestSizing(t *testing.T) {
	c := devConfig(kernels.IndexFP8)
	l, err := LayoutOf(c)
	if err != nil {
		t.Fatal(err)
	}
	// Per layer: K and V 4 tokens*4 dims*4 B each, fp8 rows 4*3 B, scales 4*4 B.
	if want := 3 * (2*64 + 12 + 16); l.PageBytes != want {
		t.Fatalf("page bytes %d, want %d", l.PageBytes, want)
	}
	if n, _ := PagesForBytes(c, int64(10*l.PageBytes+1)); n != 10 {
		t.Fatalf("PagesForBytes = %d, want 10", n)
	}
	if n, _ := PagesForRatio(c, 2.5); n != 40 {
		t.Fatalf("PagesForRatio = %d, want 40", n)
	}
	if _, err := PagesForRatio(c, 0); err == nil {
		t.Fatal("ratio 0 accepted")
	}
	if _, err := NewHostPool(c, 10, int64(10*l.PageBytes-1)); !errors.Is(err, ErrHostMemory) {
		t.Fatalf("pool beyond available memory: %v", err)
	}
	h, err := NewHostPool(c, 10, int64(10*l.PageBytes))
	if err != nil {
		t.Fatal(err)
	}
	if h.TotalPages() != 10 || h.FreePages() != 10 || h.Bytes() != int64(10*l.PageBytes) {
		t.Fatalf("pool %d pages, %d free, %d bytes", h.TotalPages(), h.FreePages(), h.Bytes())
	}
	bf := devConfig(kernels.IndexBF16)
	if lb, _ := LayoutOf(bf); lb.PageBytes != 3*(2*64+24) || lb.ScaleBytes != 0 {
		t.Fatalf("bf16 layout %+v", lb)
	}
}

// Backup stores exactly what the device pages hold, in every precision.
func TestBackupCopiesPages(t *testing.T) {
	for _, dt := range append([]kernels.IndexKDType{noIndexer}, dtypes...) {
		t.Run(dtName(dt), func(t *testing.T) {
			r := newRig(t, devConfig(dt), 8, 0)
			snap, _ := r.backupNew(1, 3)
			if !equalBytes(snap, hostBytes(r.host, 1)) {
				t.Fatal("host bytes differ from the device's")
			}
			if r.host.UsedPages() != 3 || r.host.Len(1) != 3 || !r.host.Has(1) {
				t.Fatalf("used %d, len %d", r.host.UsedPages(), r.host.Len(1))
			}
			if _, err := r.host.Backup(1, r.dev, []int32{0}); !errors.Is(err, ErrExists) {
				t.Fatalf("second backup of a key: %v", err)
			}
			oc := devConfig(dt)
			oc.KVDim++
			other, err := kvcache.NewPool(oc)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.host.Backup(2, other, []int32{0}); !errors.Is(err, ErrShape) {
				t.Fatalf("backup from a pool of another shape: %v", err)
			}
			check(t, r)
		})
	}
}

// Eviction takes the least recently used unpinned entry, never a pinned one,
// and is all or nothing.
func TestEvictLRUSkipsPinned(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexFP8), 6, 0)
	r.backupNew(1, 2)
	r.backupNew(2, 2)
	r.backupNew(3, 2)
	r.host.Touch(1) // LRU order now 2, 3, 1
	if _, ev := r.backupNew(4, 2); !slices.Equal(ev, []Key{2}) {
		t.Fatalf("evicted %v, want [2]", ev)
	}
	// Pin 3 with a held load; the next eviction must pass it over.
	r.ld.HoldBeforeLayer(0)
	dst := r.newSeq(2, false)
	l, err := r.ld.Submit(3, dst.Pages())
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, 0)
	if _, ev := r.backupNew(5, 2); !slices.Equal(ev, []Key{1}) { // order was 1, 4, 3(pinned, touched)
		t.Fatalf("evicted %v, want [1]", ev)
	}
	// 6 pages are needed, only 4 are evictable: nothing moves.
	s := r.newSeq(3, true)
	before := r.host.UsedPages()
	if _, err := r.host.Backup(9, r.dev, append(s.Pages(), r.newSeq(3, true).Pages()...)); !errors.Is(err, ErrHostFull) {
		t.Fatalf("oversized backup: %v", err)
	}
	if r.host.UsedPages() != before || !r.host.Has(4) || !r.host.Has(5) {
		t.Fatal("a refused backup evicted entries")
	}
	if err := r.host.Remove(3); !errors.Is(err, ErrPinned) {
		t.Fatalf("remove of a pinned entry: %v", err)
	}
	r.ld.ReleaseHold()
	if err := l.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := r.host.Remove(3); err != nil {
		t.Fatal(err)
	}
	check(t, r)
}
