package prefix

import (
	"errors"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
)

func newCache(t *testing.T, ps, pages int) (*kvcache.Pool, *Cache) {
	t.Helper()
	pool, err := kvcache.NewPool(kvcache.Config{Layers: 1, KVDim: 1, PageSize: ps, Pages: pages, MaxSeqs: 4, MaxContext: ps * pages})
	if err != nil {
		t.Fatal(err)
	}
	return pool, New(pool)
}

func mustCheck(t *testing.T, pool *kvcache.Pool, c *Cache) {
	t.Helper()
	if err := pool.Check(); err != nil {
		t.Fatal(err)
	}
	if err := c.Check(); err != nil {
		t.Fatal(err)
	}
}

// serve runs tokens as one request from the cache's longest match and
// finishes it into the cache; it returns the sequence's pages.
func serve(t *testing.T, pool *kvcache.Pool, c *Cache, id uint64, tokens []int32) []int32 {
	t.Helper()
	s, matched := run(t, pool, c, id, tokens)
	all := s.Pages()
	if err := c.Finish(s, tokens, matched); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, pool, c)
	return all
}

// run starts tokens as one request from the cache's longest match and
// commits them all; it returns the sequence and the match to finish with.
func run(t *testing.T, pool *kvcache.Pool, c *Cache, id uint64, tokens []int32) (*kvcache.Seq, []int32) {
	t.Helper()
	pages, n := c.Match(tokens)
	s, err := pool.NewSeqWithPrefix(id, pages, n)
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.Reserve(s, len(tokens)-n); err != nil {
		t.Fatal(err)
	}
	if err := pool.Commit(s, len(tokens)-n); err != nil {
		t.Fatal(err)
	}
	return s, pages
}

func TestMatchIsWholePages(t *testing.T) {
	pool, c := newCache(t, 4, 16)
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	pa := serve(t, pool, c, 1, a)
	if c.Pages() != 2 || pool.FreePages() != 14 {
		t.Fatalf("cached %d free %d, want 2 and 14 (the partial page freed)", c.Pages(), pool.FreePages())
	}
	for _, tc := range []struct {
		q    []int32
		want []int32
	}{
		{a, pa[:2]},
		{a[:8], pa[:2]},
		{a[:7], pa[:1]},
		{[]int32{1, 2, 3, 4, 5, 6, 7, 0}, pa[:1]},
		{[]int32{1, 2, 3}, nil},
		{[]int32{9, 9, 9, 9}, nil},
		{nil, nil},
	} {
		pages, n := c.Match(tc.q)
		if !slices.Equal(pages, tc.want) || n != 4*len(tc.want) {
			t.Errorf("Match(%v) = %v, %d; want %v", tc.q, pages, n, tc.want)
		}
		if err := c.Unlock(pages); err != nil {
			t.Fatal(err)
		}
	}
	mustCheck(t, pool, c)
}

func TestInsertDeduplicates(t *testing.T) {
	pool, c := newCache(t, 2, 16)
	p := []int32{1, 2, 3, 4, 5, 6}
	// Two requests compute the same prompt at once: both miss the cache.
	var seqs []*kvcache.Seq
	for id := range uint64(2) {
		s, err := pool.NewSeq(id)
		if err != nil {
			t.Fatal(err)
		}
		if err := pool.Reserve(s, 6); err != nil {
			t.Fatal(err)
		}
		if err := pool.Commit(s, 6); err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, s)
	}
	first := seqs[0].Pages()
	for _, s := range seqs {
		if err := c.Finish(s, p, nil); err != nil {
			t.Fatal(err)
		}
		mustCheck(t, pool, c)
	}
	if c.Pages() != 3 || pool.FreePages() != 13 {
		t.Fatalf("cached %d free %d: the duplicate pages were not freed", c.Pages(), pool.FreePages())
	}
	if pages, _ := c.Match(p); !slices.Equal(pages, first) {
		t.Fatalf("cache kept %v, want the first request's %v", pages, first)
	} else if err := c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	// A request that started from the cache hands back its shared pages and
	// adds only its own.
	q := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	serve(t, pool, c, 5, q)
	if c.Pages() != 4 || pool.FreePages() != 12 {
		t.Fatalf("cached %d free %d after extending the prefix", c.Pages(), pool.FreePages())
	}
}

func TestInsertRejects(t *testing.T) {
	pool, c := newCache(t, 2, 16)
	pa := serve(t, pool, c, 1, []int32{1, 2, 3, 4})
	s, _ := pool.NewSeq(2)
	if err := pool.Reserve(s, 2); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		tokens, pages []int32
	}{
		"too few tokens":           {[]int32{1, 2, 3}, pa},
		"page not cached":          {[]int32{7, 7}, s.Pages()},
		"page cached elsewhere":    {[]int32{7, 7}, pa[:1]},
		"page at another place":    {[]int32{1, 2, 3, 4}, []int32{pa[1], pa[0]}},
		"page listed twice":        {[]int32{1, 2, 1, 2}, []int32{pa[0], pa[0]}},
		"page out of pool's range": {[]int32{7, 7}, []int32{99}},
	} {
		if _, err := c.Insert(tc.tokens, tc.pages); err == nil {
			t.Errorf("%s: Insert succeeded", name)
		}
		if c.Pages() != 2 || pool.CachedPages() != 2 {
			t.Errorf("%s: failed Insert changed the cache", name)
		}
	}
	if _, err := c.Insert([]int32{7, 7}, s.Pages()); !errors.Is(err, kvcache.ErrNotCached) {
		t.Errorf("uncached page: %v, want ErrNotCached", err)
	}
	if err := c.Unlock(pa); err == nil {
		t.Error("Unlock without a Match succeeded")
	}
	if err := c.Unlock(pa[1:]); err == nil {
		t.Error("Unlock of a path not from the root succeeded")
	}
	mustCheck(t, pool, c)
}

func TestEvictLeastRecentlyUsedUnlockedLeaves(t *testing.T) {
	pool, c := newCache(t, 1, 32)
	a := serve(t, pool, c, 1, []int32{1, 2, 3}) // 1-2-3
	b := serve(t, pool, c, 2, []int32{1, 2, 4}) // 1-2-4, shares 1-2
	d := serve(t, pool, c, 3, []int32{5, 6})    // 5-6
	if c.Pages() != 6 {
		t.Fatalf("cached %d pages, want 6", c.Pages())
	}
	// Use 1-2-3 again: now 4 (b's leaf) is the oldest leaf, then 5-6.
	pages, _ := c.Match([]int32{1, 2, 3})
	if err := c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	if got := c.Evict(1); got != 1 || pool.Refs(b[2]) != 0 || pool.Refs(a[2]) != 1 {
		t.Fatalf("Evict(1) freed %d; b's leaf refs %d, a's %d", got, pool.Refs(b[2]), pool.Refs(a[2]))
	}
	// A locked match keeps its whole path, and a sequence using it too.
	locked, n := c.Match([]int32{1, 2, 3})
	s, err := pool.NewSeqWithPrefix(9, locked, n)
	if err != nil {
		t.Fatal(err)
	}
	mustCheck(t, pool, c)
	if got := c.Evict(10); got != 2 || pool.Refs(d[0]) != 0 || pool.Refs(d[1]) != 0 {
		t.Fatalf("Evict(10) with 1-2-3 locked freed %d, want 5-6 (2)", got)
	}
	for _, pg := range a {
		if !pool.Cached(pg) {
			t.Fatalf("locked page %d evicted", pg)
		}
	}
	if c.Evict(10) != 0 || c.Evict(0) != 0 || c.Evict(-1) != 0 {
		t.Fatal("evicted a locked page")
	}
	if err := c.Finish(s, []int32{1, 2, 3}, locked); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, pool, c)
	if got := c.Evict(10); got != 3 || c.Pages() != 0 || pool.FreePages() != 32 {
		t.Fatalf("after unlock Evict freed %d, %d cached, %d free", got, c.Pages(), pool.FreePages())
	}
	mustCheck(t, pool, c)
}

// TestCheckCatchesCorruption breaks each invariant of the tree by hand.
func TestCheckCatchesCorruption(t *testing.T) {
	for name, corrupt := range map[string]func(pool *kvcache.Pool, c *Cache, s *kvcache.Seq){
		"lock count drift": func(pool *kvcache.Pool, c *Cache, s *kvcache.Seq) { c.byPage[s.Pages()[0]].lock++ },
		"used but unlocked": func(pool *kvcache.Pool, c *Cache, s *kvcache.Seq) {
			nd := c.byPage[s.Pages()[1]]
			c.locks = map[*node]int{}
			for x := nd; x != c.root; x = x.parent {
				x.lock--
			}
		},
		"cached page outside the tree": func(pool *kvcache.Pool, c *Cache, s *kvcache.Seq) {
			for _, nd := range c.byPage {
				if len(nd.children) == 0 && nd.lock == 0 {
					delete(nd.parent.children, blockKey(nd.key))
					delete(c.byPage, nd.page)
					return
				}
			}
		},
		"node under the wrong key": func(pool *kvcache.Pool, c *Cache, s *kvcache.Seq) {
			nd := c.byPage[s.Pages()[0]]
			nd.key[0]++
		},
		"parent older than child": func(pool *kvcache.Pool, c *Cache, s *kvcache.Seq) {
			c.byPage[s.Pages()[0]].last = 0
		},
	} {
		t.Run(name, func(t *testing.T) {
			pool, c := newCache(t, 2, 16)
			serve(t, pool, c, 1, []int32{1, 2, 3, 4, 5, 6})
			serve(t, pool, c, 2, []int32{7, 8})
			pages, n := c.Match([]int32{1, 2, 3, 4})
			s, err := pool.NewSeqWithPrefix(3, pages, n)
			if err != nil {
				t.Fatal(err)
			}
			mustCheck(t, pool, c)
			corrupt(pool, c, s)
			err = c.Check()
			if err == nil {
				t.Fatal("Check found nothing")
			}
			t.Log(err)
		})
	}
}

// A probe's pages go to the cache cold: newer than a client's, they are
// still evicted first; its Finish does not refresh the client pages it
// shares (its Match does, as any use).
func TestFinishColdIsEvictedFirst(t *testing.T) {
	pool, c := newCache(t, 4, 16)
	client := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	other := []int32{20, 21, 22, 23, 24, 25, 26, 27}
	serve(t, pool, c, 1, client)
	serve(t, pool, c, 2, other) // more recent than client

	// The probe shares client's first page, then has a page of its own.
	probe := []int32{1, 2, 3, 4, 9, 9, 9, 9}
	s, pages := run(t, pool, c, 3, probe)
	if err := c.FinishCold(s, probe, pages); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, pool, c)
	if c.Pages() != 5 {
		t.Fatalf("cached %d pages, want 5 (the probe's own page indexed)", c.Pages())
	}
	if got := c.Evict(1); got != 1 {
		t.Fatalf("evicted %d", got)
	}
	// Matching ends with an unlock; a Match is a use, and the probe's
	// first one (above, through client's first page) refreshed that page:
	// the Finish did not refresh client's second, older than other's.
	if n := matched(t, c, probe); n != 4 {
		t.Errorf("after one eviction the probe matches %d tokens; want 4 (its own page went first)", n)
	}
	if got := c.Evict(1); got != 1 {
		t.Fatalf("evicted %d", got)
	}
	if n := matched(t, c, other); n != 8 {
		t.Errorf("other lost a page before client's older one: matches %d of 8 tokens", n)
	}
	if n := matched(t, c, client); n != 4 {
		t.Errorf("client matches %d tokens; want 4 (its second page evicted)", n)
	}
	mustCheck(t, pool, c)
}

// matched is how many tokens of tokens the cache matches; the match is
// unlocked again.
func matched(t *testing.T, c *Cache, tokens []int32) int {
	t.Helper()
	pages, n := c.Match(tokens)
	if err := c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	return n
}
