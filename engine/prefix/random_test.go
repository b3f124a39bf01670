package prefix

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
)

// request is one live request of the workload.
type request struct {
	s       *kvcache.Seq
	tokens  []int32 // tokens whose KV is written, from position 0
	matched []int32 // pages from Match, locked
}

// entry is the model's cached page for one whole-page token prefix.
type entry struct {
	page int32
	last uint64
}

// workload drives a pool and a cache with requests sharing prefixes, beside
// an independent model of which pages the cache and the requests hold.
type workload struct {
	t       *testing.T
	rng     *rand.Rand
	pool    *kvcache.Pool
	c       *Cache
	ps      int
	systems [][]int32 // common prompt prefixes
	live    []*request
	nextID  uint64

	// The model.
	cached  map[string]*entry // key: the whole-page token prefix
	kids    map[string]int    // key -> number of cached one-page extensions
	parents map[string]string // key -> key one page shorter ("" at the root)
	clock   uint64
	hits    map[string]int
}

func key(tokens []int32) string { return fmt.Sprint(tokens) }

// kvOf is the value a token's K and V hold: a hash of its whole prefix, so a
// page read under another prefix shows.
func kvOf(tokens []int32) float32 {
	h := fnv.New32a()
	for _, t := range tokens {
		h.Write([]byte{byte(t), byte(t >> 8), byte(t >> 16), byte(t >> 24)})
	}
	return float32(h.Sum32() % (1 << 24))
}

func (w *workload) fatalf(format string, args ...any) {
	w.t.Helper()
	w.t.Fatalf(format, args...)
}

// modelMatch is the longest whole-page prefix of q the model has cached.
func (w *workload) modelMatch(q []int32) (pages []int32) {
	for n := w.ps; n <= len(q); n += w.ps {
		e := w.cached[key(q[:n])]
		if e == nil {
			break
		}
		pages = append(pages, e.page)
	}
	return pages
}

// modelRefs is each page's holders by the model: requests plus the cache.
func (w *workload) modelRefs() map[int32]int {
	refs := map[int32]int{}
	for _, e := range w.cached {
		refs[e.page]++
	}
	for _, r := range w.live {
		for _, pg := range r.s.Pages() {
			refs[pg]++
		}
	}
	return refs
}

// modelEvict predicts which pages Evict(n) frees, removing them from the
// model: least recently used leaves first (ties by page), never a page a
// live request holds or whose prefix a live request's match covers.
func (w *workload) modelEvict(n int) []int32 {
	keep := map[string]bool{}
	used := map[int32]bool{}
	for _, r := range w.live {
		for _, pg := range r.s.Pages() {
			used[pg] = true
		}
		for i := range r.matched {
			keep[key(r.tokens[:(i+1)*w.ps])] = true
		}
	}
	var out []int32
	for len(out) < n {
		var best string
		var be *entry
		for k, e := range w.cached {
			if w.kids[k] > 0 || keep[k] || used[e.page] {
				continue
			}
			if be == nil || e.last < be.last || (e.last == be.last && e.page < be.page) {
				best, be = k, e
			}
		}
		if be == nil {
			break
		}
		delete(w.cached, best)
		w.kids[w.parentKey(best)]--
		out = append(out, be.page)
	}
	return out
}

// parentKey of a cached key: the key of the prefix one page shorter.
func (w *workload) parentKey(k string) string { return w.parents[k] }

func (w *workload) evict(n int) {
	w.t.Helper()
	want := w.modelEvict(n)
	before := w.pool.FreePages()
	got := w.c.Evict(n)
	if got != len(want) || w.pool.FreePages() != before+got {
		w.fatalf("Evict(%d) freed %d (free %d -> %d), model %v", n, got, before, w.pool.FreePages(), want)
	}
	for _, pg := range want {
		if w.pool.Refs(pg) != 0 {
			w.fatalf("Evict(%d): model evicts page %d, pool has %d holders", n, pg, w.pool.Refs(pg))
		}
	}
	if got > 0 {
		w.hits["evict"]++
	}
}

// reserve makes room for n more tokens of r, evicting under pressure.
func (w *workload) reserve(r *request, n int) bool {
	err := w.pool.Reserve(r.s, n)
	if errors.Is(err, kvcache.ErrOutOfPages) {
		need := w.pool.Config().PagesFor(r.s.Len()+n) - len(r.s.Pages())
		w.evict(need - w.pool.FreePages())
		w.check("evict for reserve")
		err = w.pool.Reserve(r.s, n)
	}
	if errors.Is(err, kvcache.ErrOutOfPages) || errors.Is(err, kvcache.ErrContextFull) {
		w.hits["reserve failed"]++
		return false
	}
	if err != nil {
		w.fatalf("reserve: %v", err)
	}
	return true
}

// write fills r's KV from Len on with more tokens and commits them.
func (w *workload) write(r *request, more []int32) {
	base := r.s.Len()
	r.tokens = append(r.tokens[:base], more...)
	slots := r.s.Slots()
	for i := range more {
		pos := base + i
		v := kvOf(r.tokens[:pos+1])
		w.pool.WriteKV(0, slots[pos], []float32{v}, []float32{-v})
	}
	if err := w.pool.Commit(r.s, len(more)); err != nil {
		w.fatalf("commit: %v", err)
	}
}

// verifyKV checks every written position of r holds its prefix's value.
func (w *workload) verifyKV(r *request, what string) {
	w.t.Helper()
	for pos, slot := range r.s.Slots()[:r.s.Len()] {
		if got, want := w.pool.K(0)[slot], kvOf(r.tokens[:pos+1]); got != want {
			w.fatalf("%s: seq %d position %d (slot %d) holds %v, want %v", what, r.s.ID(), pos, slot, got, want)
		}
	}
}

func (w *workload) start() {
	sys := w.systems[w.rng.IntN(len(w.systems))]
	prompt := slices.Clone(sys)
	for range 1 + w.rng.IntN(3*w.ps) {
		prompt = append(prompt, int32(w.rng.IntN(3)))
	}
	q := prompt[:len(prompt)-1]
	w.clock++
	want := w.modelMatch(q)
	pages, n := w.c.Match(q)
	if !slices.Equal(pages, want) || n != len(want)*w.ps {
		w.fatalf("Match: pages %v n %d, model %v", pages, n, want)
	}
	for i := range want {
		w.cached[key(q[:(i+1)*w.ps])].last = w.clock
	}
	s, err := w.pool.NewSeqWithPrefix(w.nextID, pages, n)
	if errors.Is(err, kvcache.ErrNoRow) {
		if err := w.c.Unlock(pages); err != nil {
			w.fatalf("unlock: %v", err)
		}
		w.hits["no row"]++
		return
	}
	if err != nil {
		w.fatalf("NewSeqWithPrefix: %v", err)
	}
	w.nextID++
	r := &request{s: s, tokens: slices.Clone(prompt[:n]), matched: pages}
	w.live = append(w.live, r)
	if n > 0 {
		w.hits["match"]++
	}
	w.verifyKV(r, "matched prefix")
	if !w.reserve(r, len(prompt)-n) {
		w.abort(len(w.live) - 1)
		return
	}
	w.write(r, prompt[n:])
}

func (w *workload) decode(i int) {
	r := w.live[i]
	if !w.reserve(r, 1) {
		w.abort(i)
		return
	}
	w.write(r, []int32{int32(w.rng.IntN(3))})
}

// abort drops request i without caching anything.
func (w *workload) abort(i int) {
	r := w.live[i]
	w.live = slices.Delete(w.live, i, i+1)
	if err := w.pool.Release(r.s); err != nil {
		w.fatalf("release: %v", err)
	}
	if err := w.c.Unlock(r.matched); err != nil {
		w.fatalf("unlock: %v", err)
	}
	w.hits["abort"]++
}

func (w *workload) finish(i int) {
	r := w.live[i]
	w.verifyKV(r, "finish")
	w.live = slices.Delete(w.live, i, i+1)
	full := r.s.Pages()[:r.s.Len()/w.ps]
	if err := w.c.Finish(r.s, r.tokens, r.matched); err != nil {
		w.fatalf("Finish: %v", err)
	}
	// The model: index the full pages, dropping duplicates.
	w.clock++
	parent := ""
	for j, pg := range full {
		k := key(r.tokens[:(j+1)*w.ps])
		e := w.cached[k]
		switch {
		case e == nil:
			e = &entry{page: pg}
			w.cached[k] = e
			w.parents[k] = parent
			w.kids[parent]++
			w.hits["insert"]++
		case e.page != pg:
			w.hits["duplicate freed"]++
		}
		e.last = w.clock
		parent = k
	}
}

func (w *workload) check(desc string) {
	w.t.Helper()
	if err := w.pool.Check(); err != nil {
		w.fatalf("%s: pool: %v", desc, err)
	}
	if err := w.c.Check(); err != nil {
		w.fatalf("%s: cache: %v", desc, err)
	}
	refs := w.modelRefs()
	held := 0
	for pg := range int32(w.pool.TotalPages()) {
		if w.pool.Refs(pg) != refs[pg] {
			w.fatalf("%s: page %d has %d holders, model %d", desc, pg, w.pool.Refs(pg), refs[pg])
		}
		if refs[pg] > 0 {
			held++
		}
	}
	if w.pool.FreePages() != w.pool.TotalPages()-held || w.c.Pages() != len(w.cached) || w.pool.CachedPages() != len(w.cached) {
		w.fatalf("%s: free %d cached %d (pool %d), model: %d held, %d cached",
			desc, w.pool.FreePages(), w.c.Pages(), w.pool.CachedPages(), held, len(w.cached))
	}
	for k, e := range w.cached {
		if !w.pool.Cached(e.page) {
			w.fatalf("%s: model caches page %d for %s, pool does not", desc, e.page, k)
		}
	}
}

// TestRandomSharedPrefixWorkload runs seeded requests with common prompt
// prefixes through a pool and a cache: start from the longest cached prefix,
// prefill and decode with eviction under pressure, finish into the cache,
// abort, evict. After each step the pool and cache Checks pass, the page
// holders agree with the model, and every token's KV is that of its own
// prefix (a cached page read under the wrong prefix would show).
func TestRandomSharedPrefixWorkload(t *testing.T) {
	for _, ps := range []int{1, 2, 4} {
		for seed := range uint64(4) {
			t.Run(fmt.Sprintf("page%d/seed%d", ps, seed), func(t *testing.T) {
				t.Parallel()
				pool, err := kvcache.NewPool(kvcache.Config{Layers: 1, KVDim: 1, PageSize: ps, Pages: 96 / ps, MaxSeqs: 5, MaxContext: 64})
				if err != nil {
					t.Fatal(err)
				}
				rng := rand.New(rand.NewPCG(seed, uint64(ps)))
				w := &workload{t: t, rng: rng, pool: pool, c: New(pool), ps: ps,
					cached: map[string]*entry{}, kids: map[string]int{}, parents: map[string]string{}, hits: map[string]int{}}
				for range 4 {
					sys := make([]int32, rng.IntN(24))
					for i := range sys {
						sys[i] = int32(rng.IntN(50))
					}
					w.systems = append(w.systems, sys)
				}
				for step := range 2000 {
					var desc string
					switch op := rng.IntN(10); {
					case op < 3 || len(w.live) == 0:
						desc = "start"
						w.start()
					case op < 7:
						desc = "decode"
						w.decode(rng.IntN(len(w.live)))
					case op < 9:
						desc = "finish"
						w.finish(rng.IntN(len(w.live)))
					default:
						if rng.IntN(3) == 0 {
							desc = "abort"
							w.abort(rng.IntN(len(w.live)))
						} else {
							desc = "evict"
							w.evict(1 + rng.IntN(4))
						}
					}
					w.check(fmt.Sprintf("step %d (seed %d): %s", step, seed, desc))
				}
				for _, want := range []string{"match", "insert", "duplicate freed", "evict", "abort"} {
					if w.hits[want] == 0 {
						t.Errorf("outcome %q never happened: %v", want, w.hits)
					}
				}
				t.Log(w.hits)
				for len(w.live) > 0 {
					w.finish(0)
					w.check("drain")
				}
				w.evict(pool.TotalPages())
				w.check("evict all")
				if pool.FreePages() != pool.TotalPages() || w.c.Pages() != 0 {
					t.Fatalf("after draining and evicting all: %d free of %d, %d cached", pool.FreePages(), pool.TotalPages(), w.c.Pages())
				}
			})
		}
	}
}
