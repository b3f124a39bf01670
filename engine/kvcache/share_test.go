package kvcache

import (
	"errors"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// cacheOf runs a sequence of tokens through the pool and hands its full
// pages to the cache, returning them.
func cacheOf(t *testing.T, p *Pool, id uint64, tokens int) []int32 {
	t.Helper()
	s, err := p.NewSeq(id)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Reserve(s, tokens); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(s, tokens); err != nil {
		t.Fatal(err)
	}
	var got []int32
	if err := p.ReleaseTo(s, func(full []int32) { got = full }); err != nil {
		t.Fatal(err)
	}
	return got
}

func TestReleaseToMovesFullPagesOnce(t *testing.T) {
	p := newPool(t, smallConfig(4, 8))
	s, _ := p.NewSeq(1)
	if err := p.Reserve(s, 14); err != nil { // 4 pages
		t.Fatal(err)
	}
	if err := p.Commit(s, 10); err != nil { // 2 full pages, 1 partly written, 1 reserved only
		t.Fatal(err)
	}
	pages := s.Pages()
	var full []int32
	calls := 0
	if err := p.ReleaseTo(s, func(f []int32) {
		calls++
		full = f
		mustCheck(t, p) // the pool is consistent while keep runs
	}); err != nil {
		t.Fatal(err)
	}
	if calls != 1 || !slices.Equal(full, pages[:2]) {
		t.Fatalf("keep called %d times with %v, want once with %v", calls, full, pages[:2])
	}
	if p.FreePages() != 6 || p.CachedPages() != 2 || p.Live() != 0 {
		t.Fatalf("free %d cached %d live %d, want 6 2 0", p.FreePages(), p.CachedPages(), p.Live())
	}
	for i, pg := range pages {
		if p.Cached(pg) != (i < 2) || p.Refs(pg) != map[bool]int{true: 1, false: 0}[i < 2] {
			t.Fatalf("page %d: cached %v refs %d", pg, p.Cached(pg), p.Refs(pg))
		}
	}
	if err := p.ReleaseTo(s, func([]int32) { t.Fatal("keep called for a released seq") }); !errors.Is(err, ErrReleased) {
		t.Fatalf("second ReleaseTo: %v", err)
	}
	// Freeing the cached pages returns them; freeing them again fails and changes nothing.
	if err := p.FreeCached(full); err != nil {
		t.Fatal(err)
	}
	if p.FreePages() != 8 || p.CachedPages() != 0 {
		t.Fatalf("free %d cached %d", p.FreePages(), p.CachedPages())
	}
	if err := p.FreeCached(full[:1]); !errors.Is(err, ErrNotCached) {
		t.Fatalf("FreeCached of a free page: %v", err)
	}
	mustCheck(t, p)
}

func TestNewSeqWithPrefixShares(t *testing.T) {
	p := newPool(t, smallConfig(4, 10))
	prefix := cacheOf(t, p, 1, 9) // 2 full pages cached, the third freed
	if len(prefix) != 2 || p.FreePages() != 8 {
		t.Fatalf("prefix %v, %d free", prefix, p.FreePages())
	}
	a, err := p.NewSeqWithPrefix(2, prefix, 8)
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.NewSeqWithPrefix(3, prefix[:1], 4)
	if err != nil {
		t.Fatal(err)
	}
	if a.Len() != 8 || a.Shared() != 2 || !slices.Equal(a.Slots(), wantSlots(prefix, 4, 8)) {
		t.Fatalf("a: len %d shared %d slots %v", a.Len(), a.Shared(), a.Slots())
	}
	if p.FreePages() != 8 || p.Refs(prefix[0]) != 3 || p.Refs(prefix[1]) != 2 {
		t.Fatalf("sharing allocated pages: free %d refs %d %d", p.FreePages(), p.Refs(prefix[0]), p.Refs(prefix[1]))
	}
	// New tokens go to fresh pages of the sequence's own.
	if err := p.Reserve(a, 3); err != nil {
		t.Fatal(err)
	}
	own := a.Pages()[2]
	if slices.Contains(prefix, own) || p.Refs(own) != 1 || p.Cached(own) {
		t.Fatalf("a's new page %d: refs %d cached %v", own, p.Refs(own), p.Cached(own))
	}
	// The cache cannot free pages in use.
	if err := p.FreeCached(prefix[1:]); !errors.Is(err, ErrSharedPage) {
		t.Fatalf("FreeCached of a page in use: %v", err)
	}
	mustCheck(t, p)
	// Releasing a sharer leaves the cached pages alone.
	if err := p.Release(b); err != nil {
		t.Fatal(err)
	}
	if p.Refs(prefix[0]) != 2 || !p.Cached(prefix[0]) || p.FreePages() != 7 {
		t.Fatalf("after releasing b: refs %d free %d", p.Refs(prefix[0]), p.FreePages())
	}
	// a finishes with 11 tokens: its shared pages stay in the cache (not
	// handed over twice), page 3 is partly written and freed.
	if err := p.Commit(a, 3); err != nil {
		t.Fatal(err)
	}
	var full []int32
	if err := p.ReleaseTo(a, func(f []int32) { full = f }); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(full, prefix) || p.CachedPages() != 2 || p.FreePages() != 8 {
		t.Fatalf("full %v cached %d free %d", full, p.CachedPages(), p.FreePages())
	}
	for _, pg := range prefix {
		if p.Refs(pg) != 1 {
			t.Fatalf("page %d refs %d after all sharers left", pg, p.Refs(pg))
		}
	}
	mustCheck(t, p)
}

func TestNewSeqWithPrefixRejects(t *testing.T) {
	c := smallConfig(4, 10)
	c.MaxSeqs = 2
	c.MaxContext = 8
	p := newPool(t, c)
	prefix := cacheOf(t, p, 1, 8)
	cached := p.CachedPages()
	live, _ := p.NewSeq(5)
	if err := p.Reserve(live, 2); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		id     uint64
		pages  []int32
		tokens int
		want   error
	}{
		{"tokens not whole pages", 2, prefix, 7, ErrBadPrefix},
		{"tokens not the pages' worth", 2, prefix, 4, ErrBadPrefix},
		{"page out of range", 2, []int32{99}, 4, ErrBadPage},
		{"page not cached", 2, live.Pages(), 4, ErrNotCached},
		{"page listed twice", 2, []int32{prefix[0], prefix[0]}, 8, ErrDoubleFree},
		{"live id", 5, prefix, 8, ErrDuplicateSeq},
	} {
		free := p.FreePages()
		if _, err := p.NewSeqWithPrefix(tc.id, tc.pages, tc.tokens); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if p.FreePages() != free || p.Live() != 1 || p.CachedPages() != cached || p.Refs(prefix[0]) != 1 {
			t.Errorf("%s: failed NewSeqWithPrefix changed the pool", tc.name)
		}
		mustCheck(t, p)
	}
	if _, err := p.NewSeqWithPrefix(6, append(slices.Clone(prefix), prefix[0]+100), 12); !errors.Is(err, ErrContextFull) {
		t.Errorf("prefix past MaxContext: %v", err)
	}
	if _, err := p.NewSeq(6); err != nil {
		t.Fatal(err)
	}
	if _, err := p.NewSeqWithPrefix(7, prefix, 8); !errors.Is(err, ErrNoRow) {
		t.Errorf("no row: %v", err)
	}
	if p.Refs(prefix[0]) != 1 {
		t.Fatal("failed NewSeqWithPrefix took a reference")
	}
	mustCheck(t, p)
}

func TestTruncateKeepsSharedPagesReadOnly(t *testing.T) {
	p := newPool(t, smallConfig(4, 10))
	prefix := cacheOf(t, p, 1, 12) // 3 pages
	s, err := p.NewSeqWithPrefix(2, prefix, 12)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Reserve(s, 2); err != nil {
		t.Fatal(err)
	}
	free := p.FreePages()
	// Ending inside a shared page would make the next token overwrite it.
	for _, n := range []int{11, 6, 1} {
		if err := p.Truncate(s, n); !errors.Is(err, ErrSharedPage) {
			t.Fatalf("Truncate(%d) into a shared page: %v", n, err)
		}
	}
	if s.Len() != 12 || s.Reserved() != 2 || p.FreePages() != free {
		t.Fatal("refused Truncate changed the sequence")
	}
	// At a page boundary it lets go of shared pages without freeing them.
	if err := p.Truncate(s, 8); err != nil {
		t.Fatal(err)
	}
	if s.Shared() != 2 || p.FreePages() != free+1 || !p.Cached(prefix[2]) || p.Refs(prefix[2]) != 1 {
		t.Fatalf("Truncate(8): shared %d free %d refs %d", s.Shared(), p.FreePages(), p.Refs(prefix[2]))
	}
	if err := p.Reserve(s, 1); err != nil {
		t.Fatal(err)
	}
	if pg := s.Pages()[2]; slices.Contains(prefix, pg) {
		t.Fatalf("regrown sequence writes to cached page %d", pg)
	}
	if err := p.Truncate(s, 0); err != nil {
		t.Fatal(err)
	}
	if s.Shared() != 0 || p.CachedPages() != 3 {
		t.Fatalf("Truncate(0): shared %d cached %d", s.Shared(), p.CachedPages())
	}
	mustCheck(t, p)
}

func TestWriteToSharedPagePanicsUnderInvariants(t *testing.T) {
	if !invariants {
		t.Skip("needs -tags invariants or -race")
	}
	c := smallConfig(4, 6)
	c.IndexK = &IndexKConfig{DType: kernels.IndexBF16, Dim: 2}
	b := ref.New()
	p := newPool(t, c)
	prefix := cacheOf(t, p, 1, 8)
	s, err := p.NewSeqWithPrefix(2, prefix, 8)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Reserve(s, 1); err != nil {
		t.Fatal(err)
	}
	p.WriteKV(0, s.Slots()[8], []float32{1, 2}, []float32{3, 4}) // its own page: fine
	p.WriteIndexK(b, 0, s.Slots()[8], []float32{1, 2})
	for name, write := range map[string]func(){
		"WriteKV to a page shared with a sequence": func() { p.WriteKV(0, s.Slots()[5], []float32{1, 2}, []float32{3, 4}) },
		"WriteIndexK to a shared page":             func() { p.WriteIndexK(b, 0, s.Slots()[0], []float32{1, 2}) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s did not panic", name)
				}
			}()
			write()
		}()
	}
	if err := p.Release(s); err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("WriteKV to a page only the cache holds did not panic")
			}
		}()
		p.WriteKV(0, prefix[0]*4, []float32{1, 2}, []float32{3, 4})
	}()
}

// TestCheckCatchesSharingCorruption breaks each sharing invariant by hand.
func TestCheckCatchesSharingCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(p *Pool, s *Seq, prefix []int32)
	}{
		{"reference count drift", func(p *Pool, s *Seq, prefix []int32) { p.refs[prefix[0]]++ }},
		{"shared page not cached", func(p *Pool, s *Seq, prefix []int32) {
			p.cached[prefix[0]] = false
			p.refs[prefix[0]]--
			p.numCached.Add(-1)
		}},
		{"own page cached", func(p *Pool, s *Seq, prefix []int32) {
			pg := s.pages[len(s.pages)-1]
			p.cached[pg] = true
			p.refs[pg]++
			p.numCached.Add(1)
		}},
		{"cached counter drift", func(p *Pool, s *Seq, prefix []int32) { p.numCached.Add(1) }},
		{"shared beyond committed", func(p *Pool, s *Seq, prefix []int32) { s.shared = 3 }},
		{"page twice in one seq", func(p *Pool, s *Seq, prefix []int32) { s.pages[1] = s.pages[0]; p.refs[prefix[0]]++ }},
		{"cached page freed", func(p *Pool, s *Seq, prefix []int32) {
			pg := prefix[len(prefix)-1]
			p.alloc.state[pg] = pageFree
			p.alloc.free = append(p.alloc.free, pg)
			p.alloc.freeCount.Add(1)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t, smallConfig(4, 8))
			prefix := cacheOf(t, p, 1, 12)
			s, err := p.NewSeqWithPrefix(2, prefix[:2], 8)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Reserve(s, 3); err != nil {
				t.Fatal(err)
			}
			mustCheck(t, p)
			tc.corrupt(p, s, prefix)
			err = p.Check()
			if err == nil {
				t.Fatal("Check found nothing")
			}
			t.Log(err)
		})
	}
}

// AllocCached hands free pages straight to the cache: each held by it
// alone (refs 1), usable as a cached prefix, freed with FreeCached; short of
// pages it fails with ErrOutOfPages and allocates nothing.
func TestAllocCached(t *testing.T) {
	p := newPool(t, smallConfig(4, 8))
	pages, err := p.AllocCached(3)
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) != 3 || len(slices.Compact(slices.Sorted(slices.Values(pages)))) != 3 {
		t.Fatalf("AllocCached(3) = %v", pages)
	}
	for _, pg := range pages {
		if !p.Cached(pg) || p.Refs(pg) != 1 {
			t.Fatalf("page %d: cached %v refs %d, want true 1", pg, p.Cached(pg), p.Refs(pg))
		}
	}
	if p.FreePages() != 5 || p.CachedPages() != 3 || p.Live() != 0 {
		t.Fatalf("free %d cached %d live %d, want 5 3 0", p.FreePages(), p.CachedPages(), p.Live())
	}
	mustCheck(t, p)

	// A sequence starts from them like from any cached pages.
	s, err := p.NewSeqWithPrefix(1, pages, 12)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.FreeCached(pages); !errors.Is(err, ErrSharedPage) {
		t.Fatalf("FreeCached of pages a sequence holds: %v", err)
	}
	if err := p.Release(s); err != nil {
		t.Fatal(err)
	}

	// Short: nothing is allocated.
	for _, n := range []int{6, -1} {
		if _, err := p.AllocCached(n); err == nil || (n > 0 && !errors.Is(err, ErrOutOfPages)) {
			t.Fatalf("AllocCached(%d): %v", n, err)
		}
	}
	if got, err := p.AllocCached(0); err != nil || len(got) != 0 {
		t.Fatalf("AllocCached(0) = %v, %v", got, err)
	}
	if p.FreePages() != 5 || p.CachedPages() != 3 {
		t.Fatalf("free %d cached %d after failed allocs, want 5 3", p.FreePages(), p.CachedPages())
	}
	mustCheck(t, p)

	if err := p.FreeCached(pages); err != nil {
		t.Fatal(err)
	}
	for _, pg := range pages {
		if p.Cached(pg) || p.Refs(pg) != 0 {
			t.Fatalf("page %d after FreeCached: cached %v refs %d", pg, p.Cached(pg), p.Refs(pg))
		}
	}
	all, err := p.AllocCached(8)
	if err != nil || len(all) != 8 || p.FreePages() != 0 {
		t.Fatalf("AllocCached(8) = %v, %v; free %d", all, err, p.FreePages())
	}
	if _, err := p.AllocCached(1); !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("AllocCached(1) with none free: %v", err)
	}
	if err := p.FreeCached(all); err != nil {
		t.Fatal(err)
	}
	if p.FreePages() != 8 || p.CachedPages() != 0 {
		t.Fatalf("free %d cached %d at the end", p.FreePages(), p.CachedPages())
	}
	mustCheck(t, p)
}
