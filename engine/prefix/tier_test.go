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
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// tierRig is a cache over a small pool with fp8 index-K, with a host tier.
type tierRig struct {
	t      *testing.T
	pool   *kvcache.Pool
	host   *hicache.HostPool
	ld     *hicache.Loader
	w      *hicache.Writer
	c      *Cache
	nextID uint64
}

const (
	tierPS     = 4
	tierLayers = 2
	tierKVDim  = 3
)

func tierConfig(devPages int) kvcache.Config {
	return kvcache.Config{Layers: tierLayers, KVDim: tierKVDim, PageSize: tierPS, Pages: devPages, MaxSeqs: 8,
		MaxContext: tierPS * devPages, IndexK: &kvcache.IndexKConfig{DType: kernels.IndexFP8, Dim: 4}}
}

func newTierRig(t *testing.T, devPages, hostPages int, policy Policy) *tierRig {
	t.Helper()
	return newTierRigSlots(t, devPages, hostPages, policy, 0)
}

func newTierRigSlots(t *testing.T, devPages, hostPages int, policy Policy, slots int) *tierRig {
	t.Helper()
	cfg := tierConfig(devPages)
	pool, err := kvcache.NewPool(cfg)
	if err != nil {
		t.Fatal(err)
	}
	host, err := hicache.NewHostPool(cfg, hostPages, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	r := &tierRig{t: t, pool: pool, host: host, c: New(pool)}
	r.attach(policy, slots)
	return r
}

// attach gives the rig's cache a fresh loader and writer over its host pool.
func (r *tierRig) attach(policy Policy, slots int) {
	r.t.Helper()
	ld, err := hicache.NewLoader(r.host, r.pool, slots) // 0: the default ring
	if err != nil {
		r.t.Fatal(err)
	}
	w, err := hicache.NewWriter(r.host, r.pool)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { ld.Close(); w.Close() })
	if err := r.c.AttachHost(r.host, ld, w, policy); err != nil {
		r.t.Fatal(err)
	}
	r.ld, r.w = ld, w
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

// takePages starts a sequence that holds n free pages, so that nothing
// else can have them until it is released.
func (r *tierRig) takePages(n int) *kvcache.Seq {
	r.t.Helper()
	r.nextID++
	s, err := r.pool.NewSeq(r.nextID)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.pool.Reserve(s, n*tierPS); err != nil {
		r.t.Fatal(err)
	}
	return s
}

// scribble fills every free page with KV and index keys no token has, so
// that a page allocated next shows whether a load wrote it.
func (r *tierRig) scribble() {
	r.t.Helper()
	n := r.pool.FreePages()
	if n == 0 {
		return
	}
	s := r.takePages(n)
	b := ref.New()
	k, v, key := make([]float32, tierKVDim), make([]float32, tierKVDim), make([]float32, 4)
	for _, slot := range s.Slots()[:n*tierPS] {
		for l := range tierLayers {
			for i := range k {
				k[i], v[i] = 1000+float32(slot), -2000-float32(i)
			}
			for i := range key {
				key[i] = -3 + float32(i)
			}
			r.pool.WriteKV(l, slot, k, v)
			r.pool.WriteIndexK(b, l, slot, key)
		}
	}
	if err := r.pool.Release(s); err != nil {
		r.t.Fatal(err)
	}
}

func sameBytes(a, b [][]byte) bool {
	return slices.EqualFunc(a, b, func(x, y []byte) bool { return string(x) == string(y) })
}

// partEqual reports whether layer's K and V (or, with index, its index-K
// rows and scales) are the same in a and b, both kvtest.PageBytes.
func partEqual(a, b [][]byte, layer int, index bool) bool {
	i := 4 * layer
	if index {
		i += 2
	}
	return string(a[i]) == string(b[i]) && string(a[i+1]) == string(b[i+1])
}

// pagesOf cuts all, kvtest.PageBytes of pages pages, to pages from..to-1.
func pagesOf(all [][]byte, from, to, pages int) [][]byte {
	out := make([][]byte, len(all))
	for i, part := range all {
		per := len(part) / pages
		out[i] = part[from*per : to*per]
	}
	return out
}

// serve runs tokens as one request from the device match (writing the rest
// of its KV) and finishes it into the cache; it returns its pages. The match
// must not reach a loading node.
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

// nodeAt is the tree node of tokens' first pages whole pages.
func (r *tierRig) nodeAt(tokens []int32, pages int) *node {
	r.t.Helper()
	nd := r.c.root
	for i := range pages {
		nd = nd.children[blockKey(tokens[i*tierPS:(i+1)*tierPS])]
		if nd == nil {
			r.t.Fatalf("no node for page %d of %v", i, tokens)
		}
	}
	return nd
}

// offload serves tokens and evicts every device page to host; it returns
// the bytes the pages held, for checking a load back.
func (r *tierRig) offload(tokens []int32) [][]byte {
	r.t.Helper()
	want := kvtest.PageBytes(r.pool, r.serve(tokens))
	r.c.Evict(r.pool.TotalPages())
	return want
}

// hostKeys are the host keys of the nodes that end at tokens' pages 1 to n.
func (r *tierRig) hostKeys(tokens []int32, n int) []hicache.Key {
	r.t.Helper()
	keys := make([]hicache.Key, n)
	for i := range keys {
		keys[i] = r.nodeAt(tokens, i+1).hkey
	}
	return keys
}

// holdNextLoad scribbles over the free pages, so that a page the next load
// did not write shows, and parks that load at p.
func (r *tierRig) holdNextLoad(p holdPoint) {
	r.scribble()
	p.set(r.ld)
}

// req is one request admitted through MatchHost and LoadBack.
type req struct {
	s      *kvcache.Seq
	tokens []int32
	pages  []int32 // the locked page path
	n      int     // its tokens
	loads  hicache.Loads
}

// admit matches tokens into host, expecting wantN device and wantHost host
// tokens, loads up to upTo back, starts a sequence from the path and takes
// its gate.
func (r *tierRig) admit(tokens []int32, wantN, wantHost, upTo int) *req {
	r.t.Helper()
	return r.admitFrom(tokens, r.matchHost(tokens, wantN, wantHost), upTo)
}

// matchHost is MatchHost expecting wantN device and wantHost host tokens.
func (r *tierRig) matchHost(tokens []int32, wantN, wantHost int) HostMatch {
	r.t.Helper()
	hm := r.c.MatchHost(tokens)
	if hm.N != wantN || hm.Host != wantHost || len(hm.Pages)*tierPS != hm.N {
		r.t.Fatalf("MatchHost = %d pages, %d device + %d host tokens, want %d + %d", len(hm.Pages), hm.N, hm.Host, wantN, wantHost)
	}
	return hm
}

// admitFrom is admit of a MatchHost done already.
func (r *tierRig) admitFrom(tokens []int32, hm HostMatch, upTo int) *req {
	r.t.Helper()
	pages, n, err := r.c.LoadBack(ctxT(r.t), tokens, hm, upTo)
	if err != nil {
		r.t.Fatal(err)
	}
	if n != upTo || len(pages)*tierPS != n || !slices.Equal(pages[:len(hm.Pages)], hm.Pages) {
		r.t.Fatalf("LoadBack to %d = %v, %d tokens (match %v)", upTo, pages, n, hm.Pages)
	}
	r.nextID++
	s, err := r.pool.NewSeqWithPrefix(r.nextID, pages, n)
	if err != nil {
		r.t.Fatal(err)
	}
	r.check()
	return &req{s: s, tokens: tokens, pages: pages, n: n, loads: r.c.Gate(pages)}
}

// finish settles q's gate, writes the rest of its tokens' KV and finishes it
// into the cache.
func (r *tierRig) finish(q *req) {
	r.t.Helper()
	if err := r.c.Settle(ctxT(r.t), q.loads); err != nil {
		r.t.Fatal(err)
	}
	if more := len(q.tokens) - q.n; more > 0 {
		if err := r.pool.Reserve(q.s, more); err != nil {
			r.t.Fatal(err)
		}
		writeKV(r.pool, q.s, q.tokens, q.n, len(q.tokens))
		if err := r.pool.Commit(q.s, more); err != nil {
			r.t.Fatal(err)
		}
	}
	if err := r.c.Finish(q.s, q.tokens, q.pages); err != nil {
		r.t.Fatal(err)
	}
	r.check()
}

// abort drops q without settling: its sequence goes, its match unlocks.
func (r *tierRig) abort(q *req) {
	r.t.Helper()
	if err := r.pool.Release(q.s); err != nil {
		r.t.Fatal(err)
	}
	if err := r.c.Unlock(q.pages); err != nil {
		r.t.Fatal(err)
	}
	r.check()
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// ended is a context that has ended.
func ended() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

func toks(n int, base int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = base + int32(i)
	}
	return out
}

// holdPoint is where a test parks the loader: before layer's K and V, or
// (index) after them and before its index-K.
type holdPoint struct {
	layer int
	index bool
}

func (p holdPoint) set(ld *hicache.Loader) {
	if p.index {
		ld.HoldBeforeIndexK(p.layer)
	} else {
		ld.HoldBeforeLayer(p.layer)
	}
}

func (p holdPoint) String() string {
	if p.index {
		return fmt.Sprintf("index%d", p.layer)
	}
	return fmt.Sprintf("kv%d", p.layer)
}

// ready reports whether the part (KV, or index) of layer is done with the
// loader parked at p.
func (p holdPoint) ready(layer int, index bool) bool {
	return layer < p.layer || (layer == p.layer && p.index && !index)
}

func waitHeld(t *testing.T, ld *hicache.Loader, p holdPoint) {
	t.Helper()
	waitfor.For(t, "the loader parks at "+p.String(), 10*time.Second, func() bool {
		l, ix := ld.HeldAt()
		return l == p.layer && ix == p.index
	})
}

var holdPoints = []holdPoint{{0, false}, {0, true}, {1, false}, {1, true}}

// ---------------------------------------------------------------------------

func TestNoHostTierMatchHostIsMatch(t *testing.T) {
	pool, c := newCache(t, 4, 8)
	serve(t, pool, c, 1, toks(8, 1))
	q := toks(9, 1)
	mp, mn := c.Match(q)
	hm := c.MatchHost(q)
	if mn != 8 || !slices.Equal(hm.Pages, mp) || hm.N != mn || hm.Host != 0 {
		t.Fatalf("MatchHost = %v, %d, %d; Match = %v, %d", hm.Pages, hm.N, hm.Host, mp, mn)
	}
	pages, n, err := c.LoadBack(context.Background(), q, hm, hm.N)
	if err != nil || n != 8 || !slices.Equal(pages, mp) {
		t.Fatalf("LoadBack(upTo=N) = %v, %d, %v", pages, n, err)
	}
	if g := c.Gate(pages); g != nil {
		t.Fatalf("Gate without a tier = %v", g)
	}
	if err := c.Settle(context.Background(), c.Gate(pages)); err != nil {
		t.Fatal(err)
	}
	// Two matches are locked, Match's and MatchHost's, and no more.
	for range 2 {
		if err := c.Unlock(pages); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Unlock(pages); err == nil {
		t.Fatal("a third unlock succeeded: LoadBack(upTo=N) took a lock")
	}
	mustCheck(t, pool, c)

	hm = c.MatchHost(q)
	if _, _, err := c.LoadBack(context.Background(), q, hm, hm.N+4); err == nil {
		t.Fatal("LoadBack past the match without a tier succeeded")
	}
	if err := c.Unlock(hm.Pages); err != nil { // a failed LoadBack keeps the match
		t.Fatal(err)
	}
	if c.HostPages() != 0 || c.HostOnly() != 0 || c.Attached() || c.TierStats() != (TierStats{}) || len(c.LoadsInFlight()) != 0 {
		t.Fatal("host-tier state without a host tier")
	}
	if c.Free() != pool.FreePages()+c.Evictable() || c.Free() != 8 {
		t.Fatalf("Free = %d, free %d + evictable %d", c.Free(), pool.FreePages(), c.Evictable())
	}
	if h, err := c.DetachHost(context.Background()); h != nil || err != nil {
		t.Fatalf("DetachHost without a tier = %v, %v", h, err)
	}
	mustCheck(t, pool, c)
}

func TestAttachHostRefuses(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteThrough)
	if err := r.c.AttachHost(r.host, r.ld, r.w, WriteThrough); err == nil {
		t.Fatal("a second AttachHost succeeded")
	}
	pool, err := kvcache.NewPool(tierConfig(8))
	if err != nil {
		t.Fatal(err)
	}
	c := New(pool)
	if err := c.AttachHost(nil, r.ld, r.w, WriteBack); err == nil {
		t.Fatal("AttachHost with no host pool succeeded")
	}
	if err := c.AttachHost(r.host, r.ld, nil, WriteBack); err == nil {
		t.Fatal("AttachHost with no writer succeeded")
	}
	if err := c.AttachHost(r.host, r.ld, r.w, Policy(7)); err == nil {
		t.Fatal("AttachHost with an unknown policy succeeded")
	}
	r.serve(toks(4, 1))
	r.hitOnce(toks(4, 1)) // the rig's host pool is in use now
	if err := c.AttachHost(r.host, r.ld, r.w, WriteBack); err == nil {
		t.Fatal("AttachHost of a host pool in use succeeded")
	}
	if c.Attached() {
		t.Fatal("a refused AttachHost attached")
	}
	for _, p := range Policies {
		if got, err := ParsePolicy(p.String()); err != nil || got != p {
			t.Fatalf("ParsePolicy(%v) = %v, %v", p, got, err)
		}
	}
	if _, err := ParsePolicy("write-around"); err == nil {
		t.Fatal("ParsePolicy of an unknown name succeeded")
	}
}

func TestWriteThroughSelectiveBacksUpOnReuse(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteThroughSelective)
	a := toks(8, 1)
	r.serve(a)
	r.where(a, OnDevice, OnDevice)
	if n, _, _, _ := r.w.Stats(); n != 0 {
		t.Fatalf("a first use backed up %d pages", n)
	}
	r.hitOnce(a[:5]) // reuses the first page only
	r.where(a, OnBoth, OnDevice)
	r.hitOnce(a)
	r.where(a, OnBoth, OnBoth)
	if r.c.HostPages() != 2 || r.host.UsedPages() != 2 {
		t.Fatalf("host pages %d, host pool uses %d, want 2", r.c.HostPages(), r.host.UsedPages())
	}
	if n, bytes, fails, _ := r.w.Stats(); n != 2 || bytes != uint64(2*r.host.Layout().PageBytes) || fails != 0 {
		t.Fatalf("writer stats %d backups, %d bytes, %d failures", n, bytes, fails)
	}

	// A finished backup is taken in at the next Match, not before.
	b := toks(4, 100)
	r.serve(b)
	pages, _ := r.c.Match(b)
	nd := r.c.byPage[pages[0]]
	bk := nd.backup
	if bk == nil {
		t.Fatal("a reuse queued no backup")
	}
	if err := r.c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the backup finishes", 10*time.Second, bk.Done)
	if !r.host.Has(nd.hkey) {
		t.Fatal("a finished backup is not on host")
	}
	r.where(b, OnDevice)
	pages, _ = r.c.Match(nil)
	if pages != nil {
		t.Fatal("Match(nil) matched")
	}
	r.where(b, OnBoth)
	r.check()

	// Evicting keeps the nodes on host as host-only; one never reused goes.
	cc := toks(4, 200)
	r.serve(cc)
	if got := r.c.Evict(4); got != 4 {
		t.Fatalf("evicted %d pages, want 4", got)
	}
	r.where(a, OnHost, OnHost)
	r.where(b, OnHost)
	r.where(cc)
	if r.c.Pages() != 0 || r.c.HostOnly() != 3 || r.pool.FreePages() != 8 || r.host.UsedPages() != 3 {
		t.Fatalf("device %d, host-only %d, free %d, host used %d", r.c.Pages(), r.c.HostOnly(), r.pool.FreePages(), r.host.UsedPages())
	}
	r.check()
}

// Under WriteThrough (the default) a prefix is backed up as soon as it is
// cached, root first, before anything reuses it; what is already on host
// is not backed up again.
func TestWriteThroughBacksUpOnInsert(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteThrough)
	a := toks(8, 1)
	r.serve(a)
	waitfor.For(t, "the inserted pages' backups", 10*time.Second, func() bool { n, _, _, _ := r.w.Stats(); return n == 2 })
	r.c.Match(nil) // takes finished backups in
	r.where(a, OnBoth, OnBoth)
	// Reusing them queues nothing more.
	r.hitOnce(a)
	if n, _, _, _ := r.w.Stats(); n != 2 || r.w.Queued() != 0 {
		t.Fatalf("a reuse of backed-up pages: %d backups, %d queued", n, r.w.Queued())
	}
	// Evicted, they stay on host and load back.
	if got := r.c.Evict(2); got != 2 {
		t.Fatalf("evicted %d pages, want 2", got)
	}
	r.where(a, OnHost, OnHost)
	r.check()
}

func TestWriteBackBacksUpOnEviction(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(12, 1)
	r.serve(a)
	r.hitOnce(a)
	r.hitOnce(a)
	r.where(a, OnDevice, OnDevice, OnDevice) // reuse does not back up
	if n, _, _, _ := r.w.Stats(); n != 0 {
		t.Fatalf("reuse backed up %d pages under write-back", n)
	}
	if got := r.c.Evict(1); got != 1 {
		t.Fatalf("evicted %d", got)
	}
	r.where(a, OnDevice, OnDevice, OnHost)
	if r.c.HostOnly() != 1 || r.c.Pages() != 2 {
		t.Fatalf("host-only %d, device %d", r.c.HostOnly(), r.c.Pages())
	}
	r.check()

	// Host-only below device nodes: Match stops at them, MatchHost counts
	// and pins them until LoadBack.
	leaf := r.nodeAt(a, 3)
	pages, n := r.c.Match(a)
	if n != 8 || len(pages) != 2 {
		t.Fatalf("Match = %v, %d", pages, n)
	}
	if err := r.c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	hm := r.c.MatchHost(a)
	if hm.N != 8 || hm.Host != 4 || !slices.Equal(hm.Pages, pages) {
		t.Fatalf("MatchHost = %v, %d + %d", hm.Pages, hm.N, hm.Host)
	}
	if !r.host.Pinned(leaf.hkey) {
		t.Fatal("MatchHost did not pin the host node")
	}
	got, gn, err := r.c.LoadBack(ctxT(t), a, hm, hm.N)
	if err != nil || gn != 8 || !slices.Equal(got, pages) {
		t.Fatalf("LoadBack(upTo=N) = %v, %d, %v", got, gn, err)
	}
	if r.host.Pinned(leaf.hkey) {
		t.Fatal("LoadBack left the host node pinned")
	}
	if err := r.c.Unlock(got); err != nil {
		t.Fatal(err)
	}
	r.check()

	if got := r.c.Evict(8); got != 2 {
		t.Fatalf("evicted %d, want the 2 left", got)
	}
	r.where(a, OnHost, OnHost, OnHost)
	if r.c.Evictable() != 0 || r.c.Evict(1) != 0 {
		t.Fatal("host-only nodes are evictable from the device")
	}
	if n, _, _, _ := r.w.Stats(); n != 3 || r.host.UsedPages() != 3 {
		t.Fatalf("%d backups, host uses %d pages, want 3", n, r.host.UsedPages())
	}
	pages, n = r.c.Match(a)
	if n != 0 || pages != nil {
		t.Fatalf("Match = %v, %d", pages, n)
	}
	r.check()
}

// Load back restores the evicted pages' bytes exactly, and until it is over
// a reader of the pages passes each layer's gate only once that part landed.
func TestLoadBackRestoresBytes(t *testing.T) {
	for _, hold := range holdPoints {
		t.Run(hold.String(), func(t *testing.T) {
			r := newTierRig(t, 8, 8, WriteBack)
			a := toks(12, 1)
			want := kvtest.PageBytes(r.pool, r.serve(a))
			prompt := append(slices.Clone(a), 99)

			// The tail only, after a device match.
			r.c.Evict(1)
			r.where(a, OnDevice, OnDevice, OnHost)
			r.holdNextLoad(hold)
			q := r.admit(prompt, 8, 4, 12)
			waitHeld(t, r.ld, hold)
			r.checkGates(q, hold, pagesOf(want, 2, 3, 3), 2)
			r.ld.ReleaseHold()
			r.settled(q, want)
			r.where(a, OnDevice, OnDevice, OnBoth)
			r.finish(q)
			r.where(a, OnDevice, OnDevice, OnBoth)

			// Everything to host, then all of it back.
			r.c.Evict(8)
			r.where(a, OnHost, OnHost, OnHost)
			r.holdNextLoad(hold)
			q = r.admit(prompt, 0, 12, 12)
			waitHeld(t, r.ld, hold)
			r.checkGates(q, hold, want, 0)
			r.ld.ReleaseHold()
			r.settled(q, want)
			r.finish(q) // the request goes on past the loaded prefix
			r.where(a, OnBoth, OnBoth, OnBoth)
			pages, n := r.c.Match(prompt)
			if n != 12 || !sameBytes(kvtest.PageBytes(r.pool, pages), want) {
				t.Fatalf("after load back Match gives %d tokens / other bytes", n)
			}
			if err := r.c.Unlock(pages); err != nil {
				t.Fatal(err)
			}
			if st := r.c.TierStats(); st.HostHits != 2 || st.HitTokens != 16 || st.Abandoned != 0 {
				t.Fatalf("tier stats %+v", st)
			}
			r.check()
		})
	}
}

// checkGates checks q's gate with the loader parked at hold: one load, each
// part of a layer passes exactly when it landed, and the loaded pages (from
// page `from` of q's path) hold want's bytes for the parts landed and the
// scribbled ones for the rest.
func (r *tierRig) checkGates(q *req, hold holdPoint, want [][]byte, from int) {
	r.t.Helper()
	if len(q.loads) != 1 || len(r.c.LoadsInFlight()) != 1 || !slices.Equal(r.c.LoadsInFlight()[0].Pages, q.pages[from:]) {
		r.t.Fatalf("gate %v, loads in flight %v, loaded pages %v", q.loads, r.c.LoadsInFlight(), q.pages[from:])
	}
	got := kvtest.PageBytes(r.pool, q.pages[from:])
	for layer := range tierLayers {
		for _, index := range []bool{false, true} {
			wait := q.loads.WaitKV
			if index {
				wait = q.loads.WaitIndexK
			}
			err := wait(ended(), layer)
			ready := hold.ready(layer, index)
			if ready && err != nil {
				r.t.Fatalf("held at %v: gate of layer %d (index %v) blocks: %v", hold, layer, index, err)
			}
			if !ready && !errors.Is(err, context.Canceled) {
				r.t.Fatalf("held at %v: gate of layer %d (index %v) passes: %v", hold, layer, index, err)
			}
			if partEqual(got, want, layer, index) != ready {
				r.t.Fatalf("held at %v: layer %d (index %v) landed %v, its gate passes %v", hold, layer, index, !ready, ready)
			}
		}
	}
	r.check()
}

// settled waits through q's gates, settles it and checks its whole path
// holds want.
func (r *tierRig) settled(q *req, want [][]byte) {
	r.t.Helper()
	ctx := ctxT(r.t)
	for layer := range tierLayers {
		if err := q.loads.WaitKV(ctx, layer); err != nil {
			r.t.Fatal(err)
		}
		if err := q.loads.WaitIndexK(ctx, layer); err != nil {
			r.t.Fatal(err)
		}
	}
	if err := r.c.Settle(ctx, q.loads); err != nil {
		r.t.Fatal(err)
	}
	if len(r.c.LoadsInFlight()) != 0 || r.c.Gate(q.pages) != nil {
		r.t.Fatal("a settled load is still in flight")
	}
	if got := kvtest.PageBytes(r.pool, q.pages); !sameBytes(got, want) {
		r.t.Fatal("loaded pages differ from what was evicted")
	}
	r.check()
}

// LoadBack loads only up to upTo, refuses a bad upTo keeping the match, and
// loads nothing when the device has no room.
func TestLoadBackUpTo(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(12, 1)
	want := r.offload(a)
	keys := r.hostKeys(a, 3)

	for _, bad := range []int{2, 16, -4} {
		hm := r.c.MatchHost(a)
		if _, _, err := r.c.LoadBack(ctxT(t), a, hm, bad); err == nil {
			t.Fatalf("LoadBack to %d succeeded", bad)
		}
		if err := r.c.Unlock(hm.Pages); err != nil {
			t.Fatal(err)
		}
	}
	// No room: a sequence holds 6 of the 8 pages.
	hog := r.takePages(6)
	hm := r.c.MatchHost(a)
	if r.c.Free() != 2 {
		t.Fatalf("Free = %d, want 2", r.c.Free())
	}
	pages, n, err := r.c.LoadBack(ctxT(t), a, hm, 12)
	if err != nil || n != 0 || pages != nil || r.c.TierStats().HostHits != 0 {
		t.Fatalf("LoadBack without room = %v, %d, %v", pages, n, err)
	}
	for _, k := range keys {
		if r.host.Pinned(k) {
			t.Fatal("LoadBack without room left a pin")
		}
	}
	r.where(a, OnHost, OnHost, OnHost)
	r.check()
	if err := r.pool.Release(hog); err != nil {
		t.Fatal(err)
	}

	// One page of three.
	q := r.admit(a, 0, 12, 4)
	if r.host.Pinned(keys[1]) || r.host.Pinned(keys[2]) {
		t.Fatal("nodes LoadBack did not load stay pinned")
	}
	r.settled(q, pagesOf(want, 0, 1, 3))
	r.where(a, OnBoth, OnHost, OnHost)
	r.abort(q) // settled: the node stays on the device
	r.where(a, OnBoth, OnHost, OnHost)
	r.check()
}

// unpinMatch gives up a MatchHost without loading: LoadBack to its device
// match, then Unlock.
func (r *tierRig) unpinMatch(tokens []int32, hm HostMatch) {
	r.t.Helper()
	pages, _, err := r.c.LoadBack(ctxT(r.t), tokens, hm, hm.N)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.c.Unlock(pages); err != nil {
		r.t.Fatal(err)
	}
}

// Requests that hit nodes being loaded share the load: one copy from host,
// one set of device pages, one *Load behind every gate.
func TestConcurrentHitsShareOneLoad(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(8, 1)
	want := r.offload(a)
	hold := holdPoint{0, false}
	r.holdNextLoad(hold)
	qa := r.admit(a, 0, 8, 8)
	waitHeld(t, r.ld, hold)
	qb := r.admit(a, 8, 0, 8)     // the whole loading path
	qc := r.admit(a[:5], 4, 0, 4) // its first page
	if !slices.Equal(qb.pages, qa.pages) || !slices.Equal(qc.pages, qa.pages[:1]) {
		t.Fatalf("paths %v, %v, %v", qa.pages, qb.pages, qc.pages)
	}
	if len(qa.loads) != 1 || !slices.Equal(qb.loads, qa.loads) || !slices.Equal(qc.loads, qa.loads) {
		t.Fatalf("gates %v, %v, %v: not one shared load", qa.loads, qb.loads, qc.loads)
	}
	if r.pool.Refs(qa.pages[0]) != 4 || r.pool.Refs(qa.pages[1]) != 3 || r.pool.CachedPages() != 2 {
		t.Fatalf("refs %d, %d; %d cached", r.pool.Refs(qa.pages[0]), r.pool.Refs(qa.pages[1]), r.pool.CachedPages())
	}
	if r.ld.InFlight() != 1 || r.c.TierStats().HostHits != 1 || r.c.TierStats().HitTokens != 8 {
		t.Fatalf("%d loads in flight, stats %+v", r.ld.InFlight(), r.c.TierStats())
	}
	if err := qb.loads.WaitKV(ended(), 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("a sharer's gate passes before the load: %v", err)
	}
	r.ld.ReleaseHold()
	// B's forward pass is first: its Settle settles the shared load, A's and
	// C's find it settled.
	r.settled(qb, want)
	r.settled(qa, want)
	r.settled(qc, pagesOf(want, 0, 1, 2))
	if loads, bytes, fails, _ := r.ld.Stats(); loads != 1 || bytes != uint64(2*r.host.Layout().PageBytes) || fails != 0 {
		t.Fatalf("loader stats %d loads, %d bytes, %d failures: host pages not loaded exactly once", loads, bytes, fails)
	}
	r.finish(qa)
	r.finish(qb)
	r.finish(qc)
	r.where(a, OnBoth, OnBoth)
	r.check()
}

// A load whose requests all go before it settled is abandoned: the loader
// stops, the device pages are freed, the nodes are host-only again and their
// host copies intact.
func TestAbandonedLoadFreesPagesKeepsHost(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(12, 1)
	want := r.offload(a)
	keys := r.hostKeys(a, 3)
	free := r.pool.FreePages()
	hold := holdPoint{1, false}
	r.holdNextLoad(hold)
	qa := r.admit(a, 0, 12, 12)
	qb := r.admit(a, 12, 0, 12) // shares the load
	waitHeld(t, r.ld, hold)
	if r.pool.FreePages() != free-3 || r.pool.CachedPages() != 3 {
		t.Fatalf("free %d, cached %d during the load, want %d, 3", r.pool.FreePages(), r.pool.CachedPages(), free-3)
	}
	l := qa.loads[0]
	r.abort(qa) // B still reads the load
	if r.c.TierStats().Abandoned != 0 || len(r.c.LoadsInFlight()) != 1 {
		t.Fatal("a load was abandoned while a request still reads it")
	}
	r.where(a, OnBoth, OnBoth, OnBoth)
	r.abort(qb)
	if r.c.TierStats().Abandoned != 1 || len(r.c.LoadsInFlight()) != 0 {
		t.Fatalf("stats %+v, %d loads in flight after the last request went", r.c.TierStats(), len(r.c.LoadsInFlight()))
	}
	if err := l.Wait(ctxT(t)); !errors.Is(err, hicache.ErrAborted) {
		t.Fatalf("the abandoned load ended with %v", err)
	}
	if r.pool.FreePages() != free || r.pool.CachedPages() != 0 || r.pool.Live() != 0 {
		t.Fatalf("free %d, cached %d, live %d after abandon, want %d, 0, 0", r.pool.FreePages(), r.pool.CachedPages(), r.pool.Live(), free)
	}
	r.where(a, OnHost, OnHost, OnHost)
	for _, k := range keys {
		if !r.host.Has(k) || r.host.Pinned(k) {
			t.Fatalf("host entry %d: on host %v, pinned %v after abandon", k, r.host.Has(k), r.host.Pinned(k))
		}
	}
	if _, _, fails, _ := r.ld.Stats(); fails != 1 || r.host.UsedPages() != 3 {
		t.Fatalf("loader failures %d, host used %d", fails, r.host.UsedPages())
	}
	r.check()
	r.ld.ReleaseHold()

	// The host copies are intact: loading them again restores the bytes.
	r.scribble()
	q := r.admit(a, 0, 12, 12)
	r.settled(q, want)
	r.finish(q)
	r.where(a, OnBoth, OnBoth, OnBoth)

	// A load that landed before its request went is given up all the same.
	r.c.Evict(8)
	q = r.admit(a, 0, 12, 12)
	if err := q.loads[0].Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r.abort(q)
	if r.c.TierStats().Abandoned != 2 || r.pool.FreePages() != free {
		t.Fatalf("stats %+v, free %d after abandoning a landed load", r.c.TierStats(), r.pool.FreePages())
	}
	r.where(a, OnHost, OnHost, OnHost)
	r.check()
}

// Two loads stacked on one path (B extends A's loading prefix by a load of
// its own) are abandoned together when their last reader goes.
func TestStackedLoadsAbandonTogether(t *testing.T) {
	for range 16 { // the cache's loads are a map: vary their order
		r := newTierRig(t, 8, 8, WriteBack)
		a := toks(8, 1)
		r.serve(a)
		r.c.Evict(8)
		hold := holdPoint{0, false}
		hold.set(r.ld)
		qa := r.admit(a, 0, 8, 4)
		qb := r.admit(a, 4, 4, 8)
		if len(qb.loads) != 2 || qb.loads[0] != qa.loads[0] || len(r.c.LoadsInFlight()) != 2 {
			t.Fatalf("gate %v over A's %v: want A's load and B's", qb.loads, qa.loads)
		}
		waitHeld(t, r.ld, hold)
		r.abort(qa)
		if r.c.TierStats().Abandoned != 0 {
			t.Fatal("A's load was abandoned while B reads it")
		}
		r.abort(qb)
		if r.c.TierStats().Abandoned != 2 || r.pool.FreePages() != 8 || len(r.c.LoadsInFlight()) != 0 {
			t.Fatalf("stats %+v, free %d after both went", r.c.TierStats(), r.pool.FreePages())
		}
		r.where(a, OnHost, OnHost)
		r.ld.ReleaseHold()
		r.check()
	}
}

// A load that a request reads only in part (its first node) goes on when
// the requests reading all of it go; its other nodes stay locked, not
// evictable, until it settles.
func TestPartlyReadLoadKeepsItsNodes(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(8, 1)
	want := r.offload(a)
	hold := holdPoint{0, false}
	r.holdNextLoad(hold)
	qa := r.admit(a, 0, 8, 8)
	qc := r.admit(a[:5], 4, 0, 4) // the first node only
	waitHeld(t, r.ld, hold)
	r.abort(qa)
	if r.c.TierStats().Abandoned != 0 || len(r.c.LoadsInFlight()) != 1 {
		t.Fatal("a load was abandoned while a request reads part of it")
	}
	if got := r.c.Evict(8); got != 0 || r.c.Evictable() != 0 {
		t.Fatalf("evicted %d pages of a load in flight", got)
	}
	r.where(a, OnBoth, OnBoth)
	r.check()
	r.ld.ReleaseHold()
	r.settled(qc, pagesOf(want, 0, 1, 2))
	if got := kvtest.PageBytes(r.pool, qa.pages); !sameBytes(got, want) {
		t.Fatal("the part no request reads was not loaded")
	}
	if r.c.Evictable() != 1 { // the second node, a plain device node now
		t.Fatalf("evictable %d after settle, want 1", r.c.Evictable())
	}
	r.abort(qc)
	if got := r.c.Evict(8); got != 2 {
		t.Fatalf("evicted %d", got)
	}
	r.where(a, OnHost, OnHost)
	r.check()
}

// A request that matched before a node was loaded back computed it itself;
// finishing while the load is unsettled, it hangs its deeper pages below the
// loading node. Abandoning the load takes them off the device too, as Evict
// would.
func TestAbandonTakesPagesInsertedBelow(t *testing.T) {
	for _, policy := range []Policy{WriteThroughSelective, WriteBack} {
		t.Run(policy.String(), func(t *testing.T) {
			r := newTierRig(t, 8, 8, policy)
			a, long := toks(4, 1), toks(12, 1)
			r.serve(a)
			r.hitOnce(a) // on host under either policy
			r.c.Evict(8)
			r.where(long, OnHost)
			qc := r.admitFrom(long, r.matchHost(long, 0, 4), 0) // computes a's page itself
			hold := holdPoint{1, false}
			hold.set(r.ld)
			qa := r.admit(a, 0, 4, 4)
			waitHeld(t, r.ld, hold)
			r.finish(qc)
			r.where(long, OnBoth, OnDevice, OnDevice)
			r.abort(qa)
			if r.c.TierStats().Abandoned != 1 || r.pool.FreePages() != 8 || r.c.Pages() != 0 {
				t.Fatalf("stats %+v, free %d, cached %d", r.c.TierStats(), r.pool.FreePages(), r.c.Pages())
			}
			if policy == WriteBack {
				r.where(long, OnHost, OnHost, OnHost) // backed up as they went
			} else {
				r.where(long, OnHost)
			}
			r.check()
			r.ld.ReleaseHold()
			q := r.admit(long, 0, len(r.c.Where(long))*tierPS, len(r.c.Where(long))*tierPS)
			if err := r.c.Settle(ctxT(t), q.loads); err != nil {
				t.Fatal(err)
			}
			for pos, slot := range q.s.Slots()[:q.n] {
				if got, want := r.pool.K(1)[int(slot)*tierKVDim+2], kvAt(long[pos], pos, 1, 2); got != want {
					t.Fatalf("position %d holds %v, want %v", pos, got, want)
				}
			}
			r.finish(q)
		})
	}
}

// The host pool evicts least recently used entries for room, and the cache
// forgets the host-only nodes it evicted, but never an entry being loaded
// (until its load settles) or one a MatchHost counted.
func TestHostEvictionSparesLoadingAndPinned(t *testing.T) {
	r := newTierRig(t, 8, 2, WriteBack)
	a := toks(8, 1)
	wantA := kvtest.PageBytes(r.pool, r.serve(a))
	r.c.Evict(8) // the leaf first, so its host entry is the older
	r.where(a, OnHost, OnHost)

	// Host full: backing up b evicts a's leaf, and its host-only node goes.
	b := toks(4, 100)
	r.serve(b)
	r.c.Evict(1)
	r.where(b, OnHost)
	r.where(a, OnHost)
	if st := r.c.TierStats(); st.DroppedTokens != 4 {
		t.Fatalf("dropped %d tokens, want 4", st.DroppedTokens)
	}
	r.check()

	// Entries MatchHost counted are pinned until LoadBack: with both pinned
	// there is no room for c, which goes.
	hmA := r.matchHost(a, 0, 4)
	hmB := r.matchHost(b, 0, 4)
	cc := toks(4, 200)
	r.serve(cc)
	r.c.Evict(1)
	r.where(cc)
	r.where(a, OnHost)
	r.where(b, OnHost)
	if _, _, fails, _ := r.w.Stats(); fails != 1 {
		t.Fatalf("writer failures %d, want 1 (host full)", fails)
	}
	// b's pin gone, a's entry is the least recently used but still pinned:
	// d takes b's room.
	r.unpinMatch(b, hmB)
	d := toks(4, 300)
	r.serve(d)
	r.c.Evict(1)
	r.where(d, OnHost)
	r.where(b)
	r.where(a, OnHost)
	r.check()

	// An entry being loaded is pinned too.
	hold := holdPoint{0, false}
	hold.set(r.ld)
	qa := r.admitFrom(a, hmA, 4)
	waitHeld(t, r.ld, hold)
	hmD := r.matchHost(d, 0, 4)
	e := toks(4, 400)
	r.serve(e)
	r.c.Evict(1)
	r.where(e)
	r.where(d, OnHost)
	r.where(a, OnBoth)
	r.unpinMatch(d, hmD)
	f := toks(4, 500)
	r.serve(f)
	r.c.Evict(1)
	r.where(d)
	r.where(f, OnHost)
	r.where(a, OnBoth)
	r.check()

	// So is one that landed but has not settled.
	r.ld.ReleaseHold()
	if err := qa.loads[0].Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	g := toks(4, 600)
	r.serve(g)
	r.c.Evict(1)
	r.where(a, OnBoth)
	r.where(f)
	r.where(g, OnHost)
	r.check()
	r.settled(qa, pagesOf(wantA, 0, 1, 2))
	r.abort(qa)
	if got := r.c.Evict(1); got != 1 {
		t.Fatalf("evicted %d", got)
	}
	r.where(a, OnHost)
	r.check()
}

// LoadBack fails when ctx ends waiting for a ring slot; then nothing has
// changed and the match is still locked.
func TestLoadBackWaitingForSlotFails(t *testing.T) {
	r := newTierRigSlots(t, 8, 8, WriteBack, 1)
	a, b := toks(8, 1), toks(4, 100)
	r.serve(b)
	r.serve(a)
	r.c.Evict(2) // b, then a's leaf
	r.where(a, OnDevice, OnHost)
	r.where(b, OnHost)
	hold := holdPoint{0, false}
	hold.set(r.ld)
	qb := r.admit(b, 0, 4, 4) // takes the only slot
	waitHeld(t, r.ld, hold)
	free, cached := r.pool.FreePages(), r.pool.CachedPages()
	hm := r.matchHost(a, 4, 4)
	if _, _, err := r.c.LoadBack(ended(), a, hm, 8); !errors.Is(err, context.Canceled) {
		t.Fatalf("LoadBack with the ring full and ctx ended: %v", err)
	}
	if r.pool.FreePages() != free || r.pool.CachedPages() != cached || r.host.Pinned(r.nodeAt(a, 2).hkey) ||
		len(r.c.LoadsInFlight()) != 1 || r.c.TierStats().HostHits != 1 {
		t.Fatal("a failed LoadBack left pages, a pin or a load behind")
	}
	r.where(a, OnDevice, OnHost)
	r.check()
	if err := r.c.Unlock(hm.Pages); err != nil {
		t.Fatalf("a failed LoadBack let go of the match: %v", err)
	}
	r.ld.ReleaseHold()
	r.finish(qb)
	r.where(b, OnBoth)
	q := r.admit(a, 4, 4, 8)
	r.finish(q)
	r.where(a, OnDevice, OnBoth)
	r.check()
}

// Backups are taken in in submission order, also when Evict waits for a
// later one first: a backup that evicted an earlier one's entry must not
// leave the earlier node marked on host.
func TestBackupsTakenInOrder(t *testing.T) {
	r := newTierRig(t, 8, 1, WriteThroughSelective)
	x, y := toks(4, 1), toks(4, 100)
	r.serve(x)
	r.serve(y)
	px, _ := r.c.Match(x) // queues x's backup
	if err := r.c.Unlock(px); err != nil {
		t.Fatal(err)
	}
	nx, ny := r.nodeAt(x, 1), r.nodeAt(y, 1)
	bx := nx.backup
	if bx == nil {
		t.Fatal("reuse queued no backup")
	}
	// y's backup, which evicts x's entry, queued as a reuse would but
	// without Match's reap, which could take x's in first.
	r.c.queueBackup(ny)
	by := ny.backup
	waitfor.For(t, "both backups finish", 10*time.Second, func() bool { return bx.Done() && by.Done() })
	// What Evict does for a node whose backup is in flight.
	if err := r.c.waitBackup(ctxT(t), ny); err != nil {
		t.Fatal(err)
	}
	r.check()
	r.where(x, OnDevice)
	r.where(y, OnBoth)
}

// DetachHost under an unsettled load and a backup in flight settles and
// waits for them, forgets the host-only nodes and leaves the device nodes
// as they were.
func TestDetachHost(t *testing.T) {
	r := newTierRig(t, 12, 12, WriteThroughSelective)
	a, b, e := toks(8, 1), toks(8, 100), toks(8, 200)
	wantA := kvtest.PageBytes(r.pool, r.serve(a))
	r.hitOnce(a)
	r.c.Evict(2)
	r.where(a, OnHost, OnHost)
	r.serve(e)
	r.hitOnce(e)
	r.serve(b)
	r.hitOnce(b[:4])
	r.c.Evict(1) // e's leaf, the least recently used
	r.where(e, OnBoth, OnHost)
	r.where(b, OnBoth, OnDevice)

	hold := holdPoint{1, false}
	hold.set(r.ld)
	qa := r.admit(a, 0, 8, 8)
	waitHeld(t, r.ld, hold)
	pages, _ := r.c.Match(b) // queues the backup of b's leaf
	if r.c.byPage[pages[1]].backup == nil {
		t.Fatal("no backup queued")
	}
	if err := r.c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	devPages := func() []int32 {
		var out []int32
		for pg := range r.c.byPage {
			out = append(out, pg)
		}
		slices.Sort(out)
		return out
	}
	before, cached := devPages(), r.pool.CachedPages()

	if _, err := r.c.DetachHost(ended()); !errors.Is(err, context.Canceled) || !r.c.Attached() {
		t.Fatalf("DetachHost with ctx ended under a parked load: %v, attached %v", err, r.c.Attached())
	}
	r.check()
	r.ld.ReleaseHold()
	host, err := r.c.DetachHost(ctxT(t))
	if err != nil || host != r.host {
		t.Fatalf("DetachHost = %p, %v", host, err)
	}
	if r.c.Attached() || r.c.Host() != nil || r.c.Loader() != nil || r.c.Writer() != nil {
		t.Fatal("still attached after DetachHost")
	}
	if r.c.HostOnly() != 0 || r.c.HostPages() != 0 || host.UsedPages() != 0 || len(r.c.LoadsInFlight()) != 0 {
		t.Fatalf("host-only %d, host pages %d, host used %d after detach", r.c.HostOnly(), r.c.HostPages(), host.UsedPages())
	}
	if !slices.Equal(devPages(), before) || r.pool.CachedPages() != cached {
		t.Fatalf("device pages %v -> %v", before, devPages())
	}
	r.where(a, OnDevice, OnDevice)
	r.where(b, OnDevice, OnDevice)
	r.where(e, OnDevice)
	if st := r.c.TierStats(); st.DroppedTokens != 4 || st.HostHits != 1 || st.Abandoned != 0 {
		t.Fatalf("tier stats %+v", st)
	}
	if _, err := r.w.Submit(1, []int32{0}); !errors.Is(err, hicache.ErrClosed) {
		t.Fatalf("the writer is not closed: %v", err)
	}
	r.check()

	// The request that loaded goes on as without a tier.
	if g := r.c.Gate(qa.pages); g != nil {
		t.Fatalf("gate %v without a tier", g)
	}
	r.settled(qa, wantA)
	r.finish(qa)

	// The host pool, empty again, attaches anew.
	r.attach(WriteBack, 0)
	n := r.c.Pages()
	if got := r.c.Evict(n); got != n || r.c.HostOnly() != n || r.host.UsedPages() != n {
		t.Fatalf("evicted %d of %d, host-only %d, host used %d", got, n, r.c.HostOnly(), r.host.UsedPages())
	}
	r.check()
}

func TestCheckCatchesWrongLocation(t *testing.T) {
	r := newTierRig(t, 8, 8, WriteBack)
	a := toks(8, 1)
	r.serve(a)
	r.c.Evict(1)
	leaf := r.nodeAt(a, 2)
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

// TestRandomHostTier runs seeded mixes of requests (matching into host,
// loading back some or all of it, settling, finishing, or going without
// settling so that their loads are abandoned, with the loader parked now
// and then so that loads are abandoned mid-way), reuses, evictions and
// detach-and-reattach under each write policy. After every step the tree,
// the device pool and the host pool agree (their Checks), the pages add up
// (device free + cached + held by sequences alone = total; host used =
// nodes on host), every settled device page holds the KV of the tokens its
// node spells, and every settled load restored exactly those bytes.
func TestRandomHostTier(t *testing.T) {
	const seeds = 4
	for _, policy := range []Policy{WriteThrough, WriteBack} {
		total, runs := map[string]int{}, 0
		for seed := range uint64(seeds) {
			t.Run(fmt.Sprintf("%v/seed%d", policy, seed), func(t *testing.T) {
				for k, v := range randomHostTier(t, policy, seed, 1000) {
					total[k] += v
				}
				runs++
			})
		}
		if runs == seeds && !t.Failed() {
			for _, want := range []string{"load", "shared", "stacked", "settled", "abandoned", "abandoned mid-way", "host-only", "detach", "finish"} {
				if total[want] == 0 {
					t.Errorf("%v: %q never happened in %d runs: %v", policy, want, seeds, total)
				}
			}
		}
	}
}

func randomHostTier(t *testing.T, policy Policy, seed uint64, steps int) map[string]int {
	const devPages, hostPages = 12, 10
	r := newTierRig(t, devPages, hostPages, policy)
	rng := rand.New(rand.NewPCG(seed, 0x7ee))
	ctx := ctxT(t)
	// Prompts share prefixes: 3 roots, each with branches.
	var prompts [][]int32
	for root := range 3 {
		base := toks(8, int32(1000*(root+1)))
		for br := range 3 {
			prompts = append(prompts, append(slices.Clone(base), toks(4+4*br, int32(1000*(root+1)+100*(br+1)))...))
		}
	}
	out := map[string]int{}
	var live []*req
	held := false
	release := func() {
		if held {
			r.ld.ReleaseHold()
			held = false
		}
	}
	running := func(loads []*hicache.Load) bool {
		for _, l := range loads {
			if _, _, over := l.Progress(); !over {
				return true
			}
		}
		return false
	}
	inFlight := func() []*hicache.Load {
		var ls []*hicache.Load
		for _, li := range r.c.LoadsInFlight() {
			ls = append(ls, li.Load)
		}
		return ls
	}
	// kvOK checks that slots hold the KV of tokens, from position 0.
	kvOK := func(step int, what string, slots []int32, tokens []int32) {
		t.Helper()
		for pos, slot := range slots {
			for l := range tierLayers {
				if got, want := r.pool.K(l)[int(slot)*tierKVDim], kvAt(tokens[pos], pos, l, 0); got != want {
					t.Fatalf("step %d: %s: position %d (slot %d) layer %d holds %v, want %v", step, what, pos, slot, l, got, want)
				}
			}
		}
	}
	settle := func(step int, q *req) {
		t.Helper()
		if running(q.loads) {
			release()
		}
		if err := r.c.Settle(ctx, q.loads); err != nil {
			t.Fatalf("step %d: settle: %v", step, err)
		}
		if len(q.loads) > 0 {
			out["settled"]++
		}
		q.loads = nil
		kvOK(step, "settled request", q.s.Slots()[:q.n], q.tokens)
	}
	take := func(i int) *req {
		q := live[i]
		live = slices.Delete(live, i, i+1)
		return q
	}
	verify := func(step int, desc string) {
		t.Helper()
		r.check()
		seqOnly := map[int32]bool{}
		for _, q := range live {
			for _, pg := range q.s.Pages() {
				if !r.pool.Cached(pg) {
					seqOnly[pg] = true
				}
			}
		}
		if free, cached := r.pool.FreePages(), r.pool.CachedPages(); free+cached+len(seqOnly) != devPages || r.c.Pages() != cached {
			t.Fatalf("step %d (%s): %d free + %d cached + %d held by sequences != %d (the tree has %d)", step, desc, free, cached, len(seqOnly), devPages, r.c.Pages())
		}
		if used := r.host.UsedPages(); used != r.c.HostPages() || used+r.host.FreePages() != hostPages {
			t.Fatalf("step %d (%s): host uses %d pages, %d free, %d nodes on host", step, desc, used, r.host.FreePages(), r.c.HostPages())
		}
		var walk func(nd *node, spelled []int32)
		walk = func(nd *node, spelled []int32) {
			for _, ch := range nd.children {
				sp := append(slices.Clone(spelled), ch.key...)
				if ch.onHost != r.host.Has(ch.hkey) {
					t.Fatalf("step %d (%s): node %d records on host %v", step, desc, ch.hkey, ch.onHost)
				}
				if ch.page >= 0 && ch.loading == nil {
					slots := make([]int32, tierPS)
					for i := range slots {
						slots[i] = ch.page*tierPS + int32(i)
					}
					base := len(sp) - tierPS
					for i, slot := range slots {
						pos := base + i
						for l := range tierLayers {
							if got, want := r.pool.K(l)[int(slot)*tierKVDim], kvAt(sp[pos], pos, l, 0); got != want {
								t.Fatalf("step %d (%s): page %d position %d layer %d holds %v, want %v", step, desc, ch.page, pos, l, got, want)
							}
						}
					}
				}
				walk(ch, sp)
			}
		}
		walk(r.c.root, nil)
		if n := r.c.HostOnly(); n > 0 {
			out["host-only"]++
		}
	}

	for step := range steps {
		var desc string
		switch op := rng.IntN(20); {
		case op < 6 && len(live) < 5:
			desc = "admit"
			p := prompts[rng.IntN(len(prompts))]
			if rng.IntN(3) == 0 {
				p = p[:1+rng.IntN(len(p))]
			}
			hm := r.c.MatchHost(p)
			upTo := hm.N + tierPS*rng.IntN(hm.Host/tierPS+1)
			if rng.IntN(2) == 0 {
				upTo = hm.N + hm.Host
			}
			room := r.c.Free() >= (upTo-hm.N)/tierPS
			if running(inFlight()) {
				release() // a parked load could keep the next ring slot busy
			}
			pages, n, err := r.c.LoadBack(ctx, p, hm, upTo)
			if err != nil {
				t.Fatalf("step %d: LoadBack: %v", step, err)
			}
			if want := map[bool]int{true: upTo, false: hm.N}[room]; n != want || len(pages)*tierPS != n {
				t.Fatalf("step %d: LoadBack to %d (room %v) = %d pages, %d tokens", step, upTo, room, len(pages), n)
			}
			r.nextID++
			s, err := r.pool.NewSeqWithPrefix(r.nextID, pages, n)
			if errors.Is(err, kvcache.ErrNoRow) {
				if err := r.c.Unlock(pages); err != nil {
					t.Fatal(err)
				}
				out["no row"]++
				break
			} else if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			q := &req{s: s, tokens: p, pages: pages, n: n, loads: r.c.Gate(pages)}
			if n > hm.N {
				out["load"]++
			}
			if len(q.loads) > 1 || (len(q.loads) == 1 && n == hm.N) {
				out["shared"]++
			}
			if len(q.loads) > 1 {
				out["stacked"]++
			}
			live = append(live, q)
		case op < 10 && len(live) > 0:
			desc = "finish"
			q := take(rng.IntN(len(live)))
			settle(step, q)
			more := len(q.tokens) - q.n
			if short := r.pool.Config().PagesFor(len(q.tokens)) - len(q.s.Pages()) - r.pool.FreePages(); short > 0 {
				r.c.Evict(short)
			}
			if err := r.pool.Reserve(q.s, more); err != nil {
				if !errors.Is(err, kvcache.ErrOutOfPages) {
					t.Fatalf("step %d: %v", step, err)
				}
				if err := r.c.Finish(q.s, q.tokens[:q.n], q.pages); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				out["finish short"]++
				break
			}
			writeKV(r.pool, q.s, q.tokens, q.n, len(q.tokens))
			if err := r.pool.Commit(q.s, more); err != nil {
				t.Fatal(err)
			}
			if err := r.c.Finish(q.s, q.tokens, q.pages); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			out["finish"]++
		case op < 12 && len(live) > 0:
			desc = "abort"
			q := take(rng.IntN(len(live)))
			before := r.c.TierStats().Abandoned
			midway := running(q.loads)
			if err := r.pool.Release(q.s); err != nil {
				t.Fatal(err)
			}
			if err := r.c.Unlock(q.pages); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if n := int(r.c.TierStats().Abandoned - before); n > 0 {
				out["abandoned"] += n
				if midway {
					out["abandoned mid-way"]++
				}
			}
		case op < 13 && len(live) > 0:
			desc = "settle"
			settle(step, live[rng.IntN(len(live))])
		case op < 16:
			desc = "evict"
			r.c.Evict(1 + rng.IntN(4))
			r.scribble()
		case op < 18:
			desc = "hit"
			p := prompts[rng.IntN(len(prompts))]
			pages, _ := r.c.Match(p[:rng.IntN(len(p)+1)])
			if err := r.c.Unlock(pages); err != nil {
				t.Fatal(err)
			}
		case op < 19:
			desc = "hold"
			if !held {
				holdPoints[rng.IntN(len(holdPoints))].set(r.ld)
				held = true
			}
		default:
			if rng.IntN(6) > 0 {
				desc = "release"
				release()
				break
			}
			desc = "detach"
			release()
			pages, hostOnly := r.c.Pages(), r.c.HostOnly()
			host, err := r.c.DetachHost(ctx)
			if err != nil || host != r.host || host.UsedPages() != 0 || r.c.HostOnly() != 0 || r.c.Pages() != pages {
				t.Fatalf("step %d: DetachHost = %v; host used %d, host-only %d, device %d -> %d", step, err, host.UsedPages(), r.c.HostOnly(), pages, r.c.Pages())
			}
			_ = hostOnly
			r.check()
			r.attach(policy, 0)
			out["detach"]++
		}
		verify(step, desc)
	}

	// Drain: every request finishes, everything is evicted, the tier goes.
	release()
	for len(live) > 0 {
		q := take(0)
		settle(steps, q)
		if err := r.c.Finish(q.s, q.tokens[:q.n], q.pages); err != nil {
			t.Fatal(err)
		}
	}
	r.c.Evict(devPages)
	verify(steps, "drain")
	if _, err := r.c.DetachHost(ctx); err != nil {
		t.Fatal(err)
	}
	r.check()
	if r.pool.FreePages() != devPages || r.host.UsedPages() != 0 || r.c.Pages() != 0 {
		t.Fatalf("after drain: %d free of %d, host used %d, %d cached", r.pool.FreePages(), devPages, r.host.UsedPages(), r.c.Pages())
	}
	t.Log(out, r.c.TierStats())
	return out
}
