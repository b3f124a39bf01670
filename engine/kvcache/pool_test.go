package kvcache

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
)

func newPool(t testing.TB, c Config) *Pool {
	t.Helper()
	p, err := NewPool(c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func smallConfig(pageSize, pages int) Config {
	return Config{Layers: 1, KVDim: 2, PageSize: pageSize, Pages: pages, MaxSeqs: 4, MaxContext: pageSize * pages}
}

func mustCheck(t testing.TB, p *Pool) {
	t.Helper()
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
}

// wantSlots is what Slots must be: position i on page pages[i/ps] at offset i%ps.
func wantSlots(pages []int32, ps, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = pages[i/ps]*int32(ps) + int32(i%ps)
	}
	return out
}

func TestSlotsAcrossPageBoundaries(t *testing.T) {
	for _, ps := range []int{1, 3, 16} {
		t.Run(fmt.Sprint("page", ps), func(t *testing.T) {
			p := newPool(t, smallConfig(ps, 40))
			a, _ := p.NewSeq(1)
			b, _ := p.NewSeq(2)
			// Interleave growth so the two sequences' pages are not contiguous.
			for step := range 3*ps + 2 {
				for _, s := range []*Seq{a, b} {
					if err := p.Reserve(s, 1); err != nil {
						t.Fatal(err)
					}
					if err := p.Commit(s, 1); err != nil {
						t.Fatal(err)
					}
					if s.Len() != step+1 {
						t.Fatalf("Len %d after %d commits", s.Len(), step+1)
					}
				}
			}
			// A multi-token reservation straddling pages.
			if err := p.Reserve(a, ps+2); err != nil {
				t.Fatal(err)
			}
			for _, s := range []*Seq{a, b} {
				n := s.Len() + s.Reserved()
				if got, want := len(s.Pages()), p.Config().PagesFor(n); got != want {
					t.Fatalf("seq %d: %d pages for %d tokens, want %d", s.ID(), got, n, want)
				}
				if got, want := s.Slots(), wantSlots(s.Pages(), ps, n); !slices.Equal(got, want) {
					t.Fatalf("seq %d slots %v, want %v", s.ID(), got, want)
				}
			}
			if ps > 1 && slices.Equal(a.Pages()[:2], []int32{0, 1}) {
				t.Fatalf("pages of interleaved sequences are contiguous: %v", a.Pages())
			}
			// Slots of the two never collide.
			seen := map[int32]bool{}
			for _, s := range []*Seq{a, b} {
				for _, sl := range s.Slots() {
					if seen[sl] {
						t.Fatalf("slot %d used twice", sl)
					}
					seen[sl] = true
				}
			}
			mustCheck(t, p)
		})
	}
}

func TestSlotsIsACappedView(t *testing.T) {
	p := newPool(t, smallConfig(4, 8))
	s, _ := p.NewSeq(1)
	if err := p.Reserve(s, 5); err != nil {
		t.Fatal(err)
	}
	sl := s.Slots()
	if len(sl) != 5 || cap(sl) != 5 {
		t.Fatalf("Slots len %d cap %d, want 5 and 5", len(sl), cap(sl))
	}
	_ = append(sl, 99) // must not write into the row
	if err := p.Reserve(s, 6); err != nil {
		t.Fatal(err)
	}
	if got := s.Slots()[5]; got == 99 {
		t.Fatal("append to Slots wrote into the request-to-token row")
	}
	mustCheck(t, p)
}

func TestReserveIsAllOrNothing(t *testing.T) {
	p := newPool(t, smallConfig(4, 5)) // 20 tokens
	a, _ := p.NewSeq(1)
	b, _ := p.NewSeq(2)
	if err := p.Reserve(a, 10); err != nil { // 3 pages
		t.Fatal(err)
	}
	if err := p.Commit(a, 9); err != nil {
		t.Fatal(err)
	}
	if err := p.Reserve(b, 3); err != nil { // 1 page; 1 left
		t.Fatal(err)
	}
	beforePages, beforeSlots := a.Pages(), slices.Clone(a.Slots())
	beforeFree := p.FreePages()
	// a holds 10 tokens on 3 pages; 9+9 = 18 tokens needs 5 pages, 2 more, 1 free.
	err := p.Reserve(a, 9)
	if !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("Reserve: %v, want ErrOutOfPages", err)
	}
	t.Log(err)
	if p.FreePages() != beforeFree || !slices.Equal(a.Pages(), beforePages) ||
		!slices.Equal(a.Slots(), beforeSlots) || a.Len() != 9 || a.Reserved() != 1 {
		t.Fatalf("failed Reserve changed state: free %d pages %v slots %v len %d reserved %d",
			p.FreePages(), a.Pages(), a.Slots(), a.Len(), a.Reserved())
	}
	mustCheck(t, p)
	// What fits still works, and a reservation within what is held allocates nothing.
	if err := p.Reserve(a, 7); err != nil { // 16 tokens: 4 pages
		t.Fatal(err)
	}
	if p.FreePages() != 0 || a.Reserved() != 7 {
		t.Fatalf("free %d reserved %d", p.FreePages(), a.Reserved())
	}
	if err := p.Reserve(a, 3); err != nil || a.Reserved() != 7 {
		t.Fatalf("smaller Reserve: %v, reserved %d (must not shrink)", err, a.Reserved())
	}
	mustCheck(t, p)
}

func TestReserveContextFull(t *testing.T) {
	c := smallConfig(4, 8)
	c.MaxContext = 10
	p := newPool(t, c)
	s, _ := p.NewSeq(1)
	if err := p.Reserve(s, 10); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(s, 4); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{7, 1 << 62} {
		if err := p.Reserve(s, n); !errors.Is(err, ErrContextFull) {
			t.Fatalf("Reserve(%d) past MaxContext: %v", n, err)
		}
	}
	if s.Len() != 4 || s.Reserved() != 6 || len(s.Pages()) != 3 {
		t.Fatalf("failed Reserve changed the seq")
	}
	if err := p.Reserve(s, -1); err == nil {
		t.Fatal("Reserve(-1) succeeded")
	}
	mustCheck(t, p)
}

func TestCommit(t *testing.T) {
	p := newPool(t, smallConfig(4, 8))
	s, _ := p.NewSeq(1)
	if err := p.Commit(s, 1); !errors.Is(err, ErrNotReserved) {
		t.Fatalf("Commit with nothing reserved: %v", err)
	}
	if err := p.Reserve(s, 3); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(s, 2); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(s, 2); !errors.Is(err, ErrNotReserved) {
		t.Fatalf("Commit beyond reservation: %v", err)
	}
	if err := p.Commit(s, -1); err == nil {
		t.Fatal("Commit(-1) succeeded")
	}
	if s.Len() != 2 || s.Reserved() != 1 || len(s.Slots()) != 3 {
		t.Fatalf("len %d reserved %d slots %d", s.Len(), s.Reserved(), len(s.Slots()))
	}
	// Reserve counts from Len: 2 beyond Len 2 is already held.
	if err := p.Reserve(s, 1); err != nil || s.Reserved() != 1 {
		t.Fatalf("Reserve(1): %v, reserved %d", err, s.Reserved())
	}
	mustCheck(t, p)
}

func TestTruncateFreesExactlyTheRightPages(t *testing.T) {
	p := newPool(t, smallConfig(4, 10))
	other, _ := p.NewSeq(9)
	if err := p.Reserve(other, 5); err != nil {
		t.Fatal(err)
	}
	otherPages := other.Pages()
	s, _ := p.NewSeq(1)
	if err := p.Reserve(s, 18); err != nil { // 5 pages
		t.Fatal(err)
	}
	if err := p.Commit(s, 14); err != nil {
		t.Fatal(err)
	}
	pages := s.Pages()
	free0 := p.FreePages()
	for _, tc := range []struct {
		n, wantLen, wantRes, wantPages int
	}{
		{17, 14, 3, 5}, // drops reserved room only, within the last page
		{16, 14, 2, 4}, // last page freed
		{13, 13, 0, 4}, // below Len: reservation gone
		{12, 12, 0, 3}, // page boundary
		{9, 9, 0, 3},
		{8, 8, 0, 2},
		{0, 0, 0, 0},
	} {
		if err := p.Truncate(s, tc.n); err != nil {
			t.Fatalf("Truncate(%d): %v", tc.n, err)
		}
		if s.Len() != tc.wantLen || s.Reserved() != tc.wantRes {
			t.Fatalf("Truncate(%d): len %d reserved %d, want %d %d", tc.n, s.Len(), s.Reserved(), tc.wantLen, tc.wantRes)
		}
		if !slices.Equal(s.Pages(), pages[:tc.wantPages]) {
			t.Fatalf("Truncate(%d): pages %v, want %v", tc.n, s.Pages(), pages[:tc.wantPages])
		}
		if got := p.FreePages(); got != free0+len(pages)-tc.wantPages {
			t.Fatalf("Truncate(%d): %d free, want %d", tc.n, got, free0+len(pages)-tc.wantPages)
		}
		if !slices.Equal(s.Slots(), wantSlots(pages, 4, tc.n)) {
			t.Fatalf("Truncate(%d): slots %v", tc.n, s.Slots())
		}
		// The freed pages are free in the allocator; the kept ones are not.
		for i, pg := range pages {
			if p.alloc.allocated(pg) != (i < tc.wantPages) {
				t.Fatalf("Truncate(%d): page %d allocated=%v", tc.n, pg, p.alloc.allocated(pg))
			}
		}
		mustCheck(t, p)
	}
	if err := p.Truncate(s, 1); err == nil {
		t.Fatal("Truncate beyond the footprint succeeded")
	}
	if !slices.Equal(other.Pages(), otherPages) || other.Reserved() != 5 {
		t.Fatal("Truncate of one seq touched another")
	}
	// The row beyond the footprint reads -1, so a stale slot cannot alias.
	row := p.row(s)
	for pos, v := range row[:18] {
		if v != -1 {
			t.Fatalf("row position %d holds %d after truncation", pos, v)
		}
	}
}

func TestReleaseOnce(t *testing.T) {
	p := newPool(t, smallConfig(4, 8))
	a, _ := p.NewSeq(1)
	b, _ := p.NewSeq(2)
	if err := p.Reserve(a, 9); err != nil {
		t.Fatal(err)
	}
	if err := p.Reserve(b, 4); err != nil {
		t.Fatal(err)
	}
	aPages, bPages := a.Pages(), b.Pages()
	if err := p.Release(a); err != nil {
		t.Fatal(err)
	}
	if p.FreePages() != 8-len(bPages) || p.Live() != 1 {
		t.Fatalf("free %d live %d", p.FreePages(), p.Live())
	}
	for _, pg := range aPages {
		if p.alloc.allocated(pg) {
			t.Fatalf("page %d still allocated", pg)
		}
	}
	if !a.Released() || a.Slots() != nil || len(a.Pages()) != 0 {
		t.Fatal("released seq still shows a footprint")
	}
	// Reuse a's pages for a new sequence, then release a again: it must not
	// free the new owner's pages.
	c, err := p.NewSeq(3)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Reserve(c, 9); err != nil {
		t.Fatal(err)
	}
	free := p.FreePages()
	if err := p.Release(a); !errors.Is(err, ErrReleased) {
		t.Fatalf("second Release: %v, want ErrReleased", err)
	}
	for name, f := range map[string]func() error{
		"Reserve":  func() error { return p.Reserve(a, 1) },
		"Commit":   func() error { return p.Commit(a, 0) },
		"Truncate": func() error { return p.Truncate(a, 0) },
	} {
		if err := f(); !errors.Is(err, ErrReleased) {
			t.Errorf("%s on a released seq: %v", name, err)
		}
	}
	if p.FreePages() != free || p.Live() != 2 || !slices.Equal(b.Pages(), bPages) {
		t.Fatal("operations on a released seq changed the pool")
	}
	// The id is free again once released.
	if _, err := p.NewSeq(1); err != nil {
		t.Fatalf("NewSeq of a released id: %v", err)
	}
	mustCheck(t, p)
}

func TestRowsAndIDs(t *testing.T) {
	c := smallConfig(2, 8)
	c.MaxSeqs = 2
	p := newPool(t, c)
	a, err := p.NewSeq(10)
	if err != nil || a.Row() != 0 {
		t.Fatalf("first seq: %v row %d", err, a.Row())
	}
	if _, err := p.NewSeq(10); !errors.Is(err, ErrDuplicateSeq) {
		t.Fatalf("duplicate id: %v", err)
	}
	if _, err := p.NewSeq(11); err != nil {
		t.Fatal(err)
	}
	if _, err := p.NewSeq(12); !errors.Is(err, ErrNoRow) {
		t.Fatalf("third seq on 2 rows: %v", err)
	}
	if got, ok := p.Seq(10); !ok || got != a {
		t.Fatal("Seq(10) lookup")
	}
	if err := p.Release(a); err != nil {
		t.Fatal(err)
	}
	if _, ok := p.Seq(10); ok {
		t.Fatal("released seq still found")
	}
	d, err := p.NewSeq(12)
	if err != nil || d.Row() != 0 {
		t.Fatalf("NewSeq after release: %v row %d", err, d.Row())
	}
	other := newPool(t, c)
	if err := other.Reserve(d, 1); !errors.Is(err, ErrForeignSeq) {
		t.Fatalf("seq of another pool: %v", err)
	}
	if err := p.Release(nil); !errors.Is(err, ErrForeignSeq) {
		t.Fatalf("nil seq: %v", err)
	}
	mustCheck(t, p)
}

func TestWriteKV(t *testing.T) {
	c := smallConfig(3, 4)
	c.Layers, c.KVDim = 2, 3
	p := newPool(t, c)
	s, _ := p.NewSeq(1)
	if err := p.Reserve(s, 5); err != nil {
		t.Fatal(err)
	}
	for pos, slot := range s.Slots() {
		for l := range 2 {
			f := float32(100*l + 10*pos)
			p.WriteKV(l, slot, []float32{f, f + 1, f + 2}, []float32{-f, -f - 1, -f - 2})
		}
	}
	for pos, slot := range s.Slots() {
		for l := range 2 {
			f := float32(100*l + 10*pos)
			k := p.K(l)[int(slot)*3 : int(slot)*3+3]
			v := p.V(l)[int(slot)*3 : int(slot)*3+3]
			if !slices.Equal(k, []float32{f, f + 1, f + 2}) || !slices.Equal(v, []float32{-f, -f - 1, -f - 2}) {
				t.Fatalf("layer %d pos %d: K %v V %v", l, pos, k, v)
			}
		}
	}
	defer func() {
		if recover() == nil {
			t.Fatal("WriteKV with a short row did not panic")
		}
	}()
	p.WriteKV(0, s.Slots()[0], []float32{1}, []float32{1, 2, 3})
}

func TestWriteToFreePagePanicsUnderInvariants(t *testing.T) {
	if !invariants {
		t.Skip("needs -tags invariants or -race")
	}
	p := newPool(t, smallConfig(4, 4))
	defer func() {
		if recover() == nil {
			t.Fatal("WriteKV to a free page did not panic")
		}
	}()
	p.WriteKV(0, 5, []float32{1, 2}, []float32{3, 4})
}

// TestCheckCatchesCorruption breaks each invariant by hand and expects Check
// to name it (and, in invariants builds, the next mutation to panic).
func TestCheckCatchesCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(p *Pool, a, b *Seq)
	}{
		{"page owned by two seqs", func(p *Pool, a, b *Seq) { b.pages[0] = a.pages[0] }},
		{"owned page is free", func(p *Pool, a, b *Seq) {
			pg := a.pages[len(a.pages)-1]
			p.alloc.state[pg] = pageFree
			p.alloc.free = append(p.alloc.free, pg)
			p.alloc.freeCount.Add(1)
		}},
		{"leaked page", func(p *Pool, a, b *Seq) { a.pages = a.pages[:len(a.pages)-1]; a.reserved -= 4 }},
		{"row slot wrong", func(p *Pool, a, b *Seq) { p.row(a)[1]++ }},
		{"too few pages for length", func(p *Pool, a, b *Seq) { a.reserved += 4 }},
		{"live counter drift", func(p *Pool, a, b *Seq) { p.live.Add(1) }},
		{"row free and held", func(p *Pool, a, b *Seq) { p.freeRows = append(p.freeRows, int32(a.row)) }},
		{"row leaked", func(p *Pool, a, b *Seq) { p.freeRows = p.freeRows[:len(p.freeRows)-1] }},
		{"free stack duplicate", func(p *Pool, a, b *Seq) {
			p.alloc.free = append(p.alloc.free, p.alloc.free[0])
			p.alloc.freeCount.Add(1)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t, smallConfig(4, 8))
			a, _ := p.NewSeq(1)
			b, _ := p.NewSeq(2)
			if err := p.Reserve(a, 9); err != nil {
				t.Fatal(err)
			}
			if err := p.Reserve(b, 5); err != nil {
				t.Fatal(err)
			}
			mustCheck(t, p)
			tc.corrupt(p, a, b)
			err := p.Check()
			if err == nil {
				t.Fatal("Check found nothing")
			}
			t.Log(err)
			if !invariants {
				return
			}
			defer func() {
				if r := recover(); r == nil {
					t.Fatal("mutation on a corrupt pool did not panic")
				}
			}()
			_, _ = p.NewSeq(3)
		})
	}
}

// TestCountersReadableOffLoop reads the debug counters from other goroutines
// while the loop mutates the pool; run under -race.
func TestCountersReadableOffLoop(t *testing.T) {
	p := newPool(t, smallConfig(2, 32))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if f, tot, l := p.FreePages(), p.TotalPages(), p.Live(); f < 0 || f > tot || l < 0 || l > 4 {
					panic(fmt.Sprintf("free %d total %d live %d", f, tot, l))
				}
			}
		}()
	}
	for i := range 500 {
		s, err := p.NewSeq(uint64(i))
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Reserve(s, 1+i%40); err != nil {
			t.Fatal(err)
		}
		if err := p.Release(s); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
}

func TestNoIndexer(t *testing.T) {
	p := newPool(t, smallConfig(4, 4))
	if p.IndexKeys(0) != nil {
		t.Fatal("index keys without an indexer")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("WriteIndexK without an indexer did not panic")
		}
	}()
	p.WriteIndexK(nil, 0, 0, []float32{1})
}
