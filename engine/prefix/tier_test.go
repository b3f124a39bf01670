package prefix

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache/kvtest"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// tierRig is a cache over a small pool with index-K, with a host tier.
type tierRig struct {
	t      *testing.T
	pool   *kvcache.Pool
	host   *hicache.HostPool
	ld     *hicache.Loader
	c      *Cache
	nextID uint64
}

const tierPS = 4

func newTierRig(t *testing.T, devPages, hostPages int, policy Policy) *tierRig {
	t.Helper()
	return newTierRigSlots(t, devPages, hostPages, policy, 0)
}

func newTierRigSlots(t *testing.T, devPages, hostPages int, policy Policy, slots int) *tierRig {
	t.Helper()
	cfg := kvcache.Config{Layers: 2, KVDim: 3, PageSize: tierPS, Pages: devPages, MaxSeqs: 8, MaxContext: tierPS * devPages,
		IndexK: &kvcache.IndexKConfig{DType: kernels.IndexFP8, Dim: 4}}
	pool, err := kvcache.NewPool(cfg)
	if err != nil {
		t.Fatal(err)
	}
	host, err := hicache.NewHostPool(cfg, hostPages, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	ld, err := hicache.NewLoader(host, pool, slots) // 0: the default ring
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ld.Close)
	c := New(pool)
	if err := c.AttachHost(host, ld, policy); err != nil {
		t.Fatal(err)
	}
	return &tierRig{t: t, pool: pool, host: host, ld: ld, c: c}
}

func (r *tierRig) check() {
	r.t.Helper()
	if err := r.pool.Check(); err != nil {
		r.t.Fatal(err)
	}
	if err := r.c.Check(); err != nil {
		r.t.Fatal(err)
	}
	if err := r.host.Check(); err != nil {
		r.t.Fatal(err)
	}
}

// kvAt is the K (and, negated, V) value i of the token tok at pos in layer.
func kvAt(tok int32, pos, layer, i int) float32 {
	return float32(int(tok)*7+pos*3+layer*11+i) / 64
}

// writeKV writes the KV and index keys of tokens[from:to] into s's slots.
func writeKV(pool *kvcache.Pool, s *kvcache.Seq, tokens []int32, from, to int) {
	cfg := pool.Config()
	b := ref.New()
	slots := s.Slots()
	k, v := make([]float32, cfg.KVDim), make([]float32, cfg.KVDim)
	key := make([]float32, cfg.IndexK.Dim)
	for pos := from; pos < to; pos++ {
		for l := range cfg.Layers {
			for i := range k {
				k[i], v[i] = kvAt(tokens[pos], pos, l, i), -kvAt(tokens[pos], pos, l, i)
			}
			for i := range key {
				key[i] = kvAt(tokens[pos], pos, l, i+5)
			}
			pool.WriteKV(l, slots[pos], k, v)
			pool.WriteIndexK(b, l, slots[pos], key)
		}
	}
}

func sameBytes(a, b [][]byte) bool {
	return slices.EqualFunc(a, b, func(x, y []byte) bool { return string(x) == string(y) })
}

// serve runs tokens as one request from the device match (writing the rest
// of its KV) and finishes it into the cache; it returns its pages.
func (r *tierRig) serve(tokens []int32) []int32 {
	r.t.Helper()
	pages, n := r.c.Match(tokens)
	r.nextID++
	s, err := r.pool.NewSeqWithPrefix(r.nextID, pages, n)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.pool.Reserve(s, len(tokens)-n); err != nil {
		r.t.Fatal(err)
	}
	writeKV(r.pool, s, tokens, n, len(tokens))
	if err := r.pool.Commit(s, len(tokens)-n); err != nil {
		r.t.Fatal(err)
	}
	all := s.Pages()
	if err := r.c.Finish(s, tokens, pages); err != nil {
		r.t.Fatal(err)
	}
	r.check()
	return all
}

// hitOnce matches tokens and unlocks: one reuse.
func (r *tierRig) hitOnce(tokens []int32) {
	r.t.Helper()
	pages, _ := r.c.Match(tokens)
	if err := r.c.Unlock(pages); err != nil {
		r.t.Fatal(err)
	}
	r.check()
}

func (r *tierRig) where(tokens []int32, want ...Location) {
	r.t.Helper()
	if got := r.c.Where(tokens); !slices.Equal(got, want) {
		r.t.Fatalf("Where = %v, want %v", got, want)
	}
}

// startLoad matches tokens, starts a sequence from the device match and
// loads the host continuation.
func (r *tierRig) startLoad(tokens []int32, wantN, wantHost int) (*kvcache.Seq, []int32, *hicache.Load) {
	r.t.Helper()
	pages, n, host := r.c.MatchHost(tokens)
	if n != wantN || host != wantHost {
		r.t.Fatalf("MatchHost = %d device + %d host tokens, want %d + %d", n, host, wantN, wantHost)
	}
	r.nextID++
	s, err := r.pool.NewSeqWithPrefix(r.nextID, pages, n)
	if err != nil {
		r.t.Fatal(err)
	}
	g, k, err := r.c.StartLoad(s, tokens, pages)
	if err != nil {
		r.t.Fatal(err)
	}
	if k != host {
		r.t.Fatalf("StartLoad loads %d tokens, want %d", k, host)
	}
	if s.Len() != n+host {
		r.t.Fatalf("seq holds %d tokens after StartLoad, want %d", s.Len(), n+host)
	}
	r.check()
	return s, pages, g
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func toks(n int, base int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = base + int32(i)
	}
	return out
}

func TestNoHostTierMatchHostIsMatch(t *testing.T) {
	pool, c := newCache(t, 4, 8)
	serve(t, pool, c, 1, toks(8, 1))
	pages, n, host := c.MatchHost(toks(9, 1))
	if n != 8 || host != 0 || len(pages) != 2 {
		t.Fatalf("MatchHost = %v, %d, %d", pages, n, host)
	}
	if err := c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	if c.HostPages() != 0 || c.HostOnly() != 0 {
		t.Fatal("host nodes without a host tier")
	}
	s, _ := pool.NewSeq(9)
	if _, _, err := c.StartLoad(s, toks(8, 1), nil); !errors.Is(err, ErrNoHost) {
		t.Fatalf("StartLoad without a tier: %v", err)
	}
	mustCheck(t, pool, c)
}

func TestWriteThroughBacksUpOnReuse(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteThrough)
	a := toks(8, 1)
	r.serve(a)
	r.where(a, OnDevice, OnDevice)
	r.hitOnce(a[:5]) // reuses the first page only
	r.where(a, OnBoth, OnDevice)
	r.hitOnce(a)
	r.where(a, OnBoth, OnBoth)
	if r.c.HostPages() != 2 || r.host.UsedPages() != 2 {
		t.Fatalf("host pages %d, host pool uses %d, want 2", r.c.HostPages(), r.host.UsedPages())
	}
	// Evicting keeps both nodes as host-only; a never reused node goes.
	b := toks(4, 100)
	r.serve(b)
	if got := r.c.Evict(3); got != 3 {
		t.Fatalf("evicted %d pages, want 3", got)
	}
	r.where(a, OnHost, OnHost)
	r.where(b)
	if r.c.Pages() != 0 || r.c.HostOnly() != 2 || r.pool.FreePages() != 8 {
		t.Fatalf("device %d, host-only %d, free %d", r.c.Pages(), r.c.HostOnly(), r.pool.FreePages())
	}
	r.check()
}

func TestWriteBackBacksUpOnEviction(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(12, 1)
	r.serve(a)
	r.hitOnce(a)
	r.where(a, OnDevice, OnDevice, OnDevice) // reuse does not back up
	if got := r.c.Evict(1); got != 1 {
		t.Fatalf("evicted %d", got)
	}
	r.where(a, OnDevice, OnDevice, OnHost)
	r.check()
	if got := r.c.Evict(8); got != 2 {
		t.Fatalf("evicted %d, want the 2 left", got)
	}
	r.where(a, OnHost, OnHost, OnHost)
	if r.c.Evictable() != 0 || r.c.Evict(1) != 0 {
		t.Fatal("host-only nodes are evictable from the device")
	}
	// A device match stops at the host-only nodes.
	pages, n := r.c.Match(a)
	if n != 0 || pages != nil {
		t.Fatalf("Match = %v, %d", pages, n)
	}
	r.check()
}

func TestLoadBackRestoresBytes(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(12, 1)
	want := kvtest.PageBytes(r.pool, r.serve(a))
	r.c.Evict(1)
	r.where(a, OnDevice, OnDevice, OnHost)

	// A match that extends into the host-only node.
	prompt := append(slices.Clone(a), 99)
	r.ld.HoldBeforeLayer(1)
	s, matched, g := r.startLoad(prompt, 8, 4)
	waitHeld(t, r.ld, 1)
	if err := r.c.Finish(s, a, matched); err == nil {
		t.Fatal("Finish with the load in flight succeeded")
	}
	r.check()
	r.ld.ReleaseHold()
	if err := g.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if got := kvtest.PageBytes(r.pool, s.Pages()); !sameBytes(got, want) {
		t.Fatal("loaded pages differ from what was evicted")
	}
	r.where(a, OnDevice, OnDevice, OnHost) // until Finish
	if err := r.c.Finish(s, a, matched); err != nil {
		t.Fatal(err)
	}
	r.where(a, OnDevice, OnDevice, OnBoth)
	r.check()

	// Everything to host, then all of it back.
	r.c.Evict(8)
	r.where(a, OnHost, OnHost, OnHost)
	s, matched, g = r.startLoad(prompt, 0, 12)
	if err := g.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if !sameBytes(kvtest.PageBytes(r.pool, s.Pages()), want) {
		t.Fatal("loaded pages differ from what was evicted")
	}
	// The request goes on past the loaded prefix.
	if err := r.pool.Reserve(s, 1); err != nil {
		t.Fatal(err)
	}
	writeKV(r.pool, s, prompt, 12, 13)
	if err := r.pool.Commit(s, 1); err != nil {
		t.Fatal(err)
	}
	if err := r.c.Finish(s, prompt, matched); err != nil {
		t.Fatal(err)
	}
	r.where(a, OnBoth, OnBoth, OnBoth)
	pages, n := r.c.Match(prompt)
	if n != 12 || !sameBytes(kvtest.PageBytes(r.pool, pages), want) {
		t.Fatalf("after load back Match gives %d tokens / other bytes", n)
	}
	if err := r.c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	r.check()
}

func waitHeld(t *testing.T, ld *hicache.Loader, layer int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if l, _ := ld.HeldAt(); l == layer {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("loader never parked before layer %d", layer)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestAbortMidLoadFreesDevicePagesKeepsHost(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(12, 1)
	want := kvtest.PageBytes(r.pool, r.serve(a))
	r.c.Evict(8)
	free := r.pool.FreePages()

	r.ld.HoldBeforeLayer(1)
	s, matched, g := r.startLoad(a, 0, 12)
	waitHeld(t, r.ld, 1)
	if r.pool.FreePages() != free-3 {
		t.Fatalf("free pages %d during the load, want %d", r.pool.FreePages(), free-3)
	}
	if err := r.c.Finish(s, a, matched); err == nil {
		t.Fatal("Finish with the load in flight succeeded")
	}
	r.check()
	if err := r.c.Abort(ctxT(t), s, matched); err != nil {
		t.Fatal(err)
	}
	r.ld.ReleaseHold()
	if _, _, over := g.Progress(); !over {
		t.Fatal("load not over after Abort")
	}
	if r.pool.FreePages() != free || r.pool.Live() != 0 {
		t.Fatalf("free pages %d, live %d after abort, want %d, 0", r.pool.FreePages(), r.pool.Live(), free)
	}
	r.where(a, OnHost, OnHost, OnHost)
	if r.host.UsedPages() != 3 {
		t.Fatalf("host uses %d pages after abort, want 3", r.host.UsedPages())
	}
	r.check()

	// The host copies are intact: a second load restores the bytes.
	s, matched, g = r.startLoad(a, 0, 12)
	if err := g.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if !sameBytes(kvtest.PageBytes(r.pool, s.Pages()), want) {
		t.Fatal("host pages changed by the aborted load")
	}
	if err := r.c.Finish(s, a, matched); err != nil {
		t.Fatal(err)
	}
	r.where(a, OnBoth, OnBoth, OnBoth)
	r.check()
}

func TestHostEvictionDropsHostOnlyNodesNeverLoading(t *testing.T) {
	r := newTierRig(t, 8, 2, WriteBack)
	a := toks(8, 1)
	r.serve(a)
	r.c.Evict(8) // the leaf first, so its host entry is the older
	r.where(a, OnHost, OnHost)

	// Host full: backing up b evicts the least recently used entry, a's
	// leaf, and its host-only node goes.
	b := toks(4, 100)
	r.serve(b)
	r.c.Evict(1)
	r.where(b, OnHost)
	r.where(a, OnHost)
	r.check()

	// While a's node is being loaded its entry is pinned: backing up c
	// must take b's entry, and with b's pinned too c is dropped.
	r.ld.HoldBeforeLayer(0)
	s, matched, g := r.startLoad(a, 0, 4)
	waitHeld(t, r.ld, 0)
	c := toks(4, 200)
	r.serve(c)
	r.c.Evict(1)
	r.where(c, OnHost)
	r.where(b) // evicted from host
	r.where(a, OnHost)
	r.check()

	sb, mb, gb := r.startLoad(c, 0, 4)
	d := toks(4, 300)
	r.serve(d)
	r.c.Evict(1)
	r.where(d) // no host page free or evictable: dropped
	r.where(a, OnHost)
	r.where(c, OnHost)
	r.check()

	r.ld.ReleaseHold()
	for _, x := range []struct {
		s    *kvcache.Seq
		m    []int32
		g    *hicache.Load
		toks []int32
	}{{s, matched, g, a}, {sb, mb, gb, c}} {
		if err := x.g.Wait(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if err := r.c.Finish(x.s, x.toks, x.m); err != nil {
			t.Fatal(err)
		}
		r.where(x.toks, OnBoth)
	}
	r.check()
}

// TestRandomHostTier runs a seeded mix of requests (matching into host,
// loading back, finishing or aborting), reuses and evictions under each write
// policy, checking after every step that the tree, the device pool and the
// host pool agree (device + host accounting) and that every page on the
// device holds the KV of the tokens its node spells, and that every load back
// restores exactly those bytes.
func TestRandomHostTier(t *testing.T) {
	for _, policy := range []Policy{WriteThrough, WriteBack} {
		for seed := range uint64(4) {
			t.Run(fmt.Sprintf("%v/seed%d", policy, seed), func(t *testing.T) {
				randomHostTier(t, policy, seed)
			})
		}
	}
}

func randomHostTier(t *testing.T, policy Policy, seed uint64) {
	r := newTierRig(t, 12, 10, policy)
	rng := rand.New(rand.NewPCG(seed, 0x7ee))
	// Prompts share prefixes: 3 roots, each with branches.
	var prompts [][]int32
	for root := range 3 {
		base := toks(8, int32(1000*(root+1)))
		for br := range 3 {
			p := append(slices.Clone(base), toks(4+4*br, int32(1000*(root+1)+100*(br+1)))...)
			prompts = append(prompts, p)
		}
	}
	verify := func(step int) {
		t.Helper()
		r.check()
		// Every device page holds its tokens' KV; locations agree.
		var walk func(nd *node, depth int, spelled []int32)
		walk = func(nd *node, depth int, spelled []int32) {
			for _, ch := range nd.children {
				sp := append(slices.Clone(spelled), ch.key...)
				if ch.page >= 0 {
					for i := range tierPS {
						pos := depth*tierPS + i
						slot := ch.page*tierPS + int32(i)
						for l := range 2 {
							if got := r.pool.K(l)[int(slot)*3]; got != kvAt(sp[pos], pos, l, 0) {
								t.Fatalf("step %d: page %d pos %d layer %d holds %v, want %v", step, ch.page, pos, l, got, kvAt(sp[pos], pos, l, 0))
							}
						}
					}
				}
				if ch.onHost != r.host.Has(ch.hkey) || (ch.page < 0 && !ch.onHost) {
					t.Fatalf("step %d: node %d records on host %v, page %d", step, ch.hkey, ch.onHost, ch.page)
				}
				walk(ch, depth+1, sp)
			}
		}
		walk(r.c.root, 0, nil)
		if dev, host, both := r.c.Pages(), r.c.HostPages(), r.c.Pages()+r.c.HostOnly(); dev+r.pool.FreePages() != 12 ||
			host != r.host.UsedPages() || host+r.host.FreePages() != 10 || both-host > dev {
			t.Fatalf("step %d: device %d + free %d, host %d used %d free %d", step, dev, r.pool.FreePages(), host, r.host.UsedPages(), r.host.FreePages())
		}
	}
	loads, aborts, hostOnly := 0, 0, 0
	for step := range 300 {
		switch op := rng.IntN(10); {
		case op < 6: // a request
			p := prompts[rng.IntN(len(prompts))]
			pages, n, host := r.c.MatchHost(p)
			r.nextID++
			s, err := r.pool.NewSeqWithPrefix(r.nextID, pages, n)
			if err != nil {
				t.Fatal(err)
			}
			if host > 0 && rng.IntN(4) > 0 {
				if r.c.Evictable() < 12 { // room for the load and the rest
					r.c.Evict(host / tierPS)
				}
				g, k, err := r.c.StartLoad(s, p, pages)
				if err != nil {
					// Out of device pages: give up the request.
					if !errors.Is(err, kvcache.ErrOutOfPages) {
						t.Fatalf("step %d: %v", step, err)
					}
					if err := errors.Join(r.pool.Release(s), r.c.Unlock(pages)); err != nil {
						t.Fatal(err)
					}
					break
				}
				if rng.IntN(4) == 0 {
					if err := r.c.Abort(ctxT(t), s, pages); err != nil {
						t.Fatal(err)
					}
					aborts++
					break
				}
				if err := g.Wait(ctxT(t)); err != nil {
					t.Fatal(err)
				}
				loads++
				// The loaded pages hold exactly the tokens' KV.
				slots := s.Slots()
				for pos := n; pos < n+k; pos++ {
					for l := range 2 {
						if got := r.pool.K(l)[int(slots[pos])*3+1]; got != kvAt(p[pos], pos, l, 1) {
							t.Fatalf("step %d: loaded pos %d layer %d holds %v, want %v", step, pos, l, got, kvAt(p[pos], pos, l, 1))
						}
					}
				}
				n += k
			}
			need := len(p) - n
			if r.pool.FreePages() < need/tierPS+1 {
				r.c.Evict(need/tierPS + 1)
			}
			if err := r.pool.Reserve(s, need); err != nil {
				if err := r.c.Finish(s, p[:s.Len()], pages); err != nil {
					t.Fatal(err)
				}
				break
			}
			writeKV(r.pool, s, p, n, len(p))
			if err := r.pool.Commit(s, need); err != nil {
				t.Fatal(err)
			}
			if err := r.c.Finish(s, p, pages); err != nil {
				t.Fatal(err)
			}
		case op < 8:
			r.c.Evict(1 + rng.IntN(4))
		default:
			p := prompts[rng.IntN(len(prompts))]
			pages, _ := r.c.Match(p[:rng.IntN(len(p))])
			if err := r.c.Unlock(pages); err != nil {
				t.Fatal(err)
			}
		}
		verify(step)
		hostOnly = max(hostOnly, r.c.HostOnly())
	}
	t.Logf("%d loads back, %d aborted, up to %d host-only nodes", loads, aborts, hostOnly)
	if loads == 0 || hostOnly == 0 {
		t.Fatal("no load back in the whole run")
	}
}

func TestCheckCatchesWrongLocation(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(8, 1)
	r.serve(a)
	r.c.Evict(1)
	leaf := r.c.root.children[blockKey(a[:4])].children[blockKey(a[4:])]
	leaf.onHost = false
	if err := r.c.Check(); err == nil {
		t.Fatal("Check missed a host-only node recorded as on neither tier")
	}
	leaf.onHost = true
	first := leaf.parent
	first.onHost = true
	if err := r.c.Check(); err == nil {
		t.Fatal("Check missed a node recorded on host that the host pool lacks")
	}
	first.onHost = false
	r.check()
}

// StartLoad refused by the loader (its ring full) changes nothing: the
// sequence is back to its match and the nodes stay host-only, unpinned.
func TestStartLoadRefusedChangesNothing(t *testing.T) {
	r := newTierRigSlots(t, 8, 8, WriteBack, 1)
	a, b := toks(8, 1), toks(4, 100)
	r.serve(a)
	r.serve(b)
	r.c.Evict(8)
	r.where(a, OnHost, OnHost)
	r.ld.HoldBeforeLayer(0)
	s, matched, g := r.startLoad(b, 0, 4) // takes the only slot
	waitHeld(t, r.ld, 0)
	free := r.pool.FreePages()
	pages, n, host := r.c.MatchHost(a)
	if n != 0 || host != 8 {
		t.Fatalf("MatchHost = %d + %d", n, host)
	}
	r.nextID++
	s2, err := r.pool.NewSeqWithPrefix(r.nextID, pages, n)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.c.StartLoad(s2, a, pages); !errors.Is(err, hicache.ErrSlotBusy) {
		t.Fatalf("StartLoad with the ring full: %v", err)
	}
	if s2.Len() != 0 || s2.Reserved() != 0 || r.pool.FreePages() != free || r.host.Pinned(r.c.root.children[blockKey(a[:4])].hkey) {
		t.Fatal("a refused StartLoad left pages reserved or the entry pinned")
	}
	if _, ok := r.c.Loading(s2); ok {
		t.Fatal("a refused StartLoad is recorded")
	}
	r.check()
	if err := r.pool.Release(s2); err != nil {
		t.Fatal(err)
	}
	r.ld.ReleaseHold()
	if err := g.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := r.c.Finish(s, b, matched); err != nil {
		t.Fatal(err)
	}
	r.where(b, OnBoth)
	r.where(a, OnHost, OnHost)
	r.check()
}
