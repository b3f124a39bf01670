package model_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/kvcache/kvtest"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

// A hicache load is a forward pass's gate as it is.
var _ model.LayerGate = (*hicache.Load)(nil)

// recGate records, in order, the waits a forward pass makes on gate
// ("ix<layer>" for index-K, "kv<layer>" for KV), and which one it is in.
type recGate struct {
	gate    model.LayerGate
	mu      sync.Mutex
	calls   []string
	waiting string
}

func (r *recGate) WaitKV(ctx context.Context, layer int) error {
	defer r.enter(fmt.Sprintf("kv%d", layer))()
	return r.gate.WaitKV(ctx, layer)
}

func (r *recGate) WaitIndexK(ctx context.Context, layer int) error {
	defer r.enter(fmt.Sprintf("ix%d", layer))()
	return r.gate.WaitIndexK(ctx, layer)
}

func (r *recGate) enter(what string) func() {
	r.mu.Lock()
	r.calls = append(r.calls, what)
	r.waiting = what
	r.mu.Unlock()
	return func() {
		r.mu.Lock()
		r.waiting = ""
		r.mu.Unlock()
	}
}

func (r *recGate) state() ([]string, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls), r.waiting
}

// openGate never holds a read back.
type openGate struct{}

func (openGate) WaitKV(context.Context, int) error     { return nil }
func (openGate) WaitIndexK(context.Context, int) error { return nil }

// gateRig is a tiny llama-dsa model over a device pool with a host tier and
// its loader.
type gateRig struct {
	t     *testing.T
	e     *model.Exec
	pool  *kvcache.Pool
	host  *hicache.HostPool
	ld    *hicache.Loader
	vocab int
	topK  int
	id    uint64
}

const gatePage = 4

func newGateRig(t *testing.T, dt kernels.IndexKDType) *gateRig {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	pc := m.PoolConfig(gatePage, 48, 8, dt)
	e, pool := execOn(t, m, pc)
	host, err := hicache.NewHostPool(pc, 16, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	ld, err := hicache.NewLoader(host, pool, 4)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ld.Close)
	return &gateRig{t: t, e: e, pool: pool, host: host, ld: ld, vocab: m.Config.VocabSize, topK: m.Config.Indexer.TopK}
}

func (r *gateRig) newSeq() *kvcache.Seq {
	r.t.Helper()
	r.id++
	s, err := r.pool.NewSeq(r.id)
	if err != nil {
		r.t.Fatal(err)
	}
	return s
}

// forward runs batch and returns its logits.
func (r *gateRig) forward(batch ...model.SeqInput) []float32 {
	r.t.Helper()
	nl := 0
	for _, in := range batch {
		nl += in.NumLogits
	}
	out := make([]float32, nl*r.vocab)
	if err := r.e.Forward(batch, out); err != nil {
		r.t.Fatal(err)
	}
	return out
}

// prefixCase is a prefix of whole pages backed up to host under key, the
// logits of suffix run after it on the pages it was prefilled into (never
// evicted), and a sequence whose own pages still hold other tokens' KV and
// index keys (a released sequence's), into which the prefix is to be loaded.
type prefixCase struct {
	key    hicache.Key
	suffix []int32
	want   []float32
	seq    *kvcache.Seq
}

func (r *gateRig) prefixCase(key hicache.Key, prefixLen, suffixLen int, seed uint64) prefixCase {
	r.t.Helper()
	toks := testmodel.Prompts(seed, 2, prefixLen+suffixLen, prefixLen+suffixLen, r.vocab)
	prefix, suffix, other := toks[0][:prefixLen], toks[0][prefixLen:], toks[1][:prefixLen]

	// Another prompt's KV in pages that are then freed: the pages the load
	// writes start out stale, not zero.
	junk := r.newSeq()
	r.forward(model.SeqInput{Seq: junk, Tokens: other})

	a := r.newSeq()
	r.forward(model.SeqInput{Seq: a, Tokens: prefix})
	if _, err := r.host.Backup(key, r.pool, a.Pages()); err != nil {
		r.t.Fatal(err)
	}
	want := r.forward(model.SeqInput{Seq: a, Tokens: suffix, NumLogits: len(suffix)})
	if err := r.pool.Release(a); err != nil {
		r.t.Fatal(err)
	}
	if err := r.pool.Release(junk); err != nil {
		r.t.Fatal(err)
	}

	b := r.newSeq()
	if err := r.pool.Reserve(b, prefixLen); err != nil {
		r.t.Fatal(err)
	}
	if err := r.pool.Commit(b, prefixLen); err != nil {
		r.t.Fatal(err)
	}
	return prefixCase{key: key, suffix: suffix, want: want, seq: b}
}

// submit queues the load of c's prefix into its sequence's pages.
func (r *gateRig) submit(c prefixCase) *hicache.Load {
	r.t.Helper()
	l, err := r.ld.Submit(c.key, c.seq.Pages())
	if err != nil {
		r.t.Fatal(err)
	}
	return l
}

type result struct {
	logits []float32
	err    error
}

// goForward runs batch on another goroutine; the Exec is the test's again
// once the result has been received.
func (r *gateRig) goForward(ctx context.Context, batch ...model.SeqInput) <-chan result {
	nl := 0
	for _, in := range batch {
		nl += in.NumLogits
	}
	ch := make(chan result, 1)
	go func() {
		out := make([]float32, nl*r.vocab)
		err := r.e.ForwardContext(ctx, batch, out)
		ch <- result{out, err}
	}()
	return ch
}

func receive(t *testing.T, ch <-chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("forward pass did not finish")
		return result{}
	}
}

func notDone(t *testing.T, ch <-chan result) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("forward pass finished while its gate was shut (err %v)", r.err)
	default:
	}
}

// blockedAt waits until the loader is parked at (layer, indexK) and the
// forward pass waits in gate's wait named want.
func blockedAt(t *testing.T, ld *hicache.Loader, layer int, indexK bool, g *recGate, want string) {
	t.Helper()
	waitfor.For(t, fmt.Sprintf("loader held at layer %d (index-K %v), forward waiting in %s", layer, indexK, want), 10*time.Second, func() bool {
		l, ix := ld.HeldAt()
		_, w := g.state()
		return l == layer && ix == indexK && w == want
	})
}

func sameLogits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d logits, want %d", what, len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("%s: logit %d is %v, want %v (the never-evicted pages' forward)", what, i, got[i], want[i])
		}
	}
}

var gateDTypes = []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16}

// A sequence whose context is longer than top-k reads index-K in every
// layer: held before layer i's index-K, the forward pass stops in the
// index-K gate of layer i, after the KV gates of the layers before and
// before the KV gate of layer i; released, it gives the logits of the pages
// that were never evicted.
func TestGateIndexKHeld(t *testing.T) {
	for _, dt := range gateDTypes {
		for layer := range 2 {
			t.Run(fmt.Sprintf("%v/layer%d", dt, layer), func(t *testing.T) {
				r := newGateRig(t, dt)
				c := r.prefixCase(1, 4*gatePage, 3, 21)
				r.ld.HoldBeforeIndexK(layer)
				load := r.submit(c)
				g := &recGate{gate: load}
				ch := r.goForward(context.Background(), model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: len(c.suffix), Gate: g})
				want := fmt.Sprintf("ix%d", layer)
				blockedAt(t, r.ld, layer, true, g, want)
				notDone(t, ch)
				calls, _ := g.state()
				var prior []string
				for l := range layer {
					prior = append(prior, fmt.Sprintf("ix%d", l), fmt.Sprintf("kv%d", l))
				}
				if !slices.Equal(calls, append(prior, want)) {
					t.Fatalf("gate calls %v, want %v", calls, append(prior, want))
				}
				if kv, ix, over := load.Progress(); kv != layer+1 || ix != layer || over {
					t.Fatalf("load progress %d KV, %d index-K layers (over %v)", kv, ix, over)
				}
				r.ld.ReleaseHold()
				res := receive(t, ch)
				if res.err != nil {
					t.Fatal(res.err)
				}
				calls, _ = g.state()
				if full := []string{"ix0", "kv0", "ix1", "kv1"}; !slices.Equal(calls, full) {
					t.Fatalf("gate calls %v, want %v", calls, full)
				}
				sameLogits(t, "loaded prefix", res.logits, c.want)
			})
		}
	}
}

// A sequence whose context fits in top-k never reads index-K (it attends to
// all of it): held before layer i, the forward pass stops in the KV gate of
// layer i, at attention's read.
func TestGateKVHeld(t *testing.T) {
	for _, dt := range gateDTypes {
		for layer := range 2 {
			t.Run(fmt.Sprintf("%v/layer%d", dt, layer), func(t *testing.T) {
				r := newGateRig(t, dt)
				c := r.prefixCase(1, gatePage, 3, 22)
				if gatePage+3 > r.topK {
					t.Fatalf("context %d exceeds top-k %d", gatePage+3, r.topK)
				}
				r.ld.HoldBeforeLayer(layer)
				load := r.submit(c)
				g := &recGate{gate: load}
				ch := r.goForward(context.Background(), model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: len(c.suffix), Gate: g})
				want := fmt.Sprintf("kv%d", layer)
				blockedAt(t, r.ld, layer, false, g, want)
				notDone(t, ch)
				var prior []string
				for l := range layer {
					prior = append(prior, fmt.Sprintf("kv%d", l))
				}
				if calls, _ := g.state(); !slices.Equal(calls, append(prior, want)) {
					t.Fatalf("gate calls %v, want %v", calls, append(prior, want))
				}
				r.ld.ReleaseHold()
				res := receive(t, ch)
				if res.err != nil {
					t.Fatal(res.err)
				}
				sameLogits(t, "loaded prefix", res.logits, c.want)
			})
		}
	}
}

// The gates are per sequence: in one batch, a sequence without a gate is
// never waited for and comes out as it does alone, a second gated sequence
// is asked for its own gates, and the loading one waits in its own.
func TestGatePerSequence(t *testing.T) {
	r := newGateRig(t, kernels.IndexBF16)
	c := r.prefixCase(1, 4*gatePage, 3, 23)

	// Two sequences that do not load: their logits alone, then their
	// prefixes again for the batched run.
	others := testmodel.Prompts(24, 2, 4*gatePage+3, 4*gatePage+3, r.vocab)
	var alone [][]float32
	var seqs []*kvcache.Seq
	for _, p := range others {
		s := r.newSeq()
		r.forward(model.SeqInput{Seq: s, Tokens: p[:4*gatePage]})
		alone = append(alone, r.forward(model.SeqInput{Seq: s, Tokens: p[4*gatePage:], NumLogits: 3}))
		if err := r.pool.Release(s); err != nil {
			t.Fatal(err)
		}
		s = r.newSeq()
		r.forward(model.SeqInput{Seq: s, Tokens: p[:4*gatePage]})
		seqs = append(seqs, s)
	}

	r.ld.HoldBeforeIndexK(1)
	load := r.submit(c)
	loading, open := &recGate{gate: load}, &recGate{gate: openGate{}}
	ch := r.goForward(context.Background(),
		model.SeqInput{Seq: seqs[0], Tokens: others[0][4*gatePage:], NumLogits: 3},
		model.SeqInput{Seq: seqs[1], Tokens: others[1][4*gatePage:], NumLogits: 3, Gate: open},
		model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: 3, Gate: loading},
	)
	blockedAt(t, r.ld, 1, true, loading, "ix1")
	notDone(t, ch)
	if calls, _ := open.state(); !slices.Equal(calls, []string{"ix0", "kv0", "ix1"}) {
		t.Fatalf("open gate calls %v", calls)
	}
	r.ld.ReleaseHold()
	res := receive(t, ch)
	if res.err != nil {
		t.Fatal(res.err)
	}
	full := []string{"ix0", "kv0", "ix1", "kv1"}
	for _, g := range []*recGate{loading, open} {
		if calls, _ := g.state(); !slices.Equal(calls, full) {
			t.Fatalf("gate calls %v, want %v", calls, full)
		}
	}
	v3 := 3 * r.vocab
	sameLogits(t, "ungated sequence", res.logits[:v3], alone[0])
	sameLogits(t, "open-gated sequence", res.logits[v3:2*v3], alone[1])
	sameLogits(t, "loaded prefix", res.logits[2*v3:], c.want)
}

// Without a gate, the same forward pass over pages whose last layer's
// index-K is not loaded yet reads the stale keys and gives other logits:
// the gate is what the right answer rests on.
func TestGateUngatedReadsStale(t *testing.T) {
	r := newGateRig(t, kernels.IndexBF16)
	c := r.prefixCase(1, 4*gatePage, 3, 21)
	r.ld.HoldBeforeIndexK(1)
	load := r.submit(c)
	waitfor.For(t, "loader held before layer 1's index-K", 10*time.Second, func() bool {
		l, ix := r.ld.HeldAt()
		return l == 1 && ix
	})
	got := r.forward(model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: len(c.suffix)})
	r.ld.ReleaseHold()
	if err := load.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if slices.Equal(got, c.want) {
		t.Fatal("stale index-K gave the loaded prefix's logits: the test cannot tell a gated read from an ungated one")
	}
}

// A wait's error fails the forward pass with it: an aborted load, or the
// step's context ending.
func TestGateError(t *testing.T) {
	t.Run("aborted", func(t *testing.T) {
		r := newGateRig(t, kernels.IndexFP8)
		c := r.prefixCase(1, 4*gatePage, 3, 25)
		r.ld.HoldBeforeIndexK(0)
		load := r.submit(c)
		g := &recGate{gate: load}
		ch := r.goForward(context.Background(), model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: 3, Gate: g})
		blockedAt(t, r.ld, 0, true, g, "ix0")
		if err := load.Abort(context.Background()); err != nil {
			t.Fatal(err)
		}
		res := receive(t, ch)
		if !errors.Is(res.err, hicache.ErrAborted) {
			t.Fatalf("forward ended with %v, want %v", res.err, hicache.ErrAborted)
		}
		if err := r.pool.Release(c.seq); err != nil {
			t.Fatal(err)
		}
		if err := r.pool.Check(); err != nil {
			t.Fatal(err)
		}
		if !r.host.Has(c.key) {
			t.Fatal("aborted load dropped the host entry")
		}
	})
	t.Run("context", func(t *testing.T) {
		r := newGateRig(t, kernels.IndexBF16)
		c := r.prefixCase(1, gatePage, 3, 26)
		r.ld.HoldBeforeLayer(1)
		load := r.submit(c)
		g := &recGate{gate: load}
		ctx, cancel := context.WithCancel(context.Background())
		ch := r.goForward(ctx, model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: 3, Gate: g})
		blockedAt(t, r.ld, 1, false, g, "kv1")
		cancel()
		res := receive(t, ch)
		if !errors.Is(res.err, context.Canceled) {
			t.Fatalf("forward ended with %v, want %v", res.err, context.Canceled)
		}
		r.ld.ReleaseHold()
		if err := load.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// peekGate reads the loading pages' bytes when the forward pass's index-K
// read of layer passes its gate: what the indexer is about to score.
type peekGate struct {
	gate  model.LayerEntryGate
	layer int
	read  func() [][]byte
	seen  [][]byte
	// entered records the layers whose entry gate passed before their
	// index-K read.
	entered []int
}

func (p *peekGate) WaitKV(ctx context.Context, layer int) error { return p.gate.WaitKV(ctx, layer) }

func (p *peekGate) WaitLayer(ctx context.Context, layer int) error {
	p.entered = append(p.entered, layer)
	return p.gate.WaitLayer(ctx, layer)
}

func (p *peekGate) WaitIndexK(ctx context.Context, layer int) error {
	err := p.gate.WaitIndexK(ctx, layer)
	if layer == p.layer {
		p.seen = p.read()
	}
	return err
}

// The server's gate (hicache.Gate) holds the index-K read like a load does;
// with its IndexKUngated switch on (the hicache-indexk-ungated fault), the
// layer waits for its KV as it begins, as the incident's code did, and the
// index-K read of a layer whose index-K has not landed passes at once: the
// indexer scores what the pages held before the load (another prompt's
// keys), while attention reads the loaded KV: the logits come out wrong.
// The bytes read are shown, so the fault is proven the cause.
func TestGateIndexKUngatedReadsStaleKeys(t *testing.T) {
	for _, dt := range gateDTypes {
		t.Run(dt.String(), func(t *testing.T) {
			r := newGateRig(t, dt)
			c := r.prefixCase(1, 4*gatePage, 3, 21)
			pages := c.seq.Pages()
			stale := kvtest.PageBytes(r.pool, pages)

			// Switch off: the server's gate waits in layer 1's index-K read.
			r.ld.HoldBeforeIndexK(1)
			load := r.submit(c)
			shut := &recGate{gate: hicache.Gate{Loads: hicache.Loads{load}, IndexKUngated: func() bool { return false }}}
			ch := r.goForward(context.Background(), model.SeqInput{Seq: c.seq, Tokens: c.suffix, NumLogits: len(c.suffix), Gate: shut})
			blockedAt(t, r.ld, 1, true, shut, "ix1")
			notDone(t, ch)
			r.ld.ReleaseHold()
			if res := receive(t, ch); res.err != nil {
				t.Fatal(res.err)
			} else {
				sameLogits(t, "gated", res.logits, c.want)
			}
			if err := load.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			loaded := kvtest.PageBytes(r.pool, pages)
			const k1, rows1, scales1 = 4, 6, 7 // layer 1's K, index-K rows and scales
			if bytes.Equal(loaded[rows1], stale[rows1]) {
				t.Fatal("the pages' stale index-K equals the loaded one: the test cannot tell them apart")
			}

			// Switch on, a fresh load into the same stale pages.
			c2 := r.prefixCase(2, 4*gatePage, 3, 21)
			pages2 := c2.seq.Pages()
			stale2 := kvtest.PageBytes(r.pool, pages2)
			r.ld.HoldBeforeIndexK(1)
			load2 := r.submit(c2)
			waitfor.For(t, "loader held before layer 1's index-K", 10*time.Second, func() bool {
				l, ix := r.ld.HeldAt()
				return l == 1 && ix
			})
			peek := &peekGate{
				gate:  hicache.Gate{Loads: hicache.Loads{load2}, IndexKUngated: func() bool { return true }},
				layer: 1, read: func() [][]byte { return kvtest.PageBytes(r.pool, pages2) },
			}
			got := r.forward(model.SeqInput{Seq: c2.seq, Tokens: c2.suffix, NumLogits: len(c2.suffix), Gate: peek})
			r.ld.ReleaseHold()
			if err := load2.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			loaded2 := kvtest.PageBytes(r.pool, pages2)
			switch {
			case peek.seen == nil:
				t.Fatal("the index-K read of layer 1 never happened")
			case !bytes.Equal(peek.seen[rows1], stale2[rows1]) || !bytes.Equal(peek.seen[scales1], stale2[scales1]):
				t.Fatal("with the switch on, layer 1's index-K read did not see the pages' stale keys")
			case bytes.Equal(peek.seen[rows1], loaded2[rows1]):
				t.Fatal("layer 1's index-K read saw the loaded keys")
			case !bytes.Equal(peek.seen[k1], loaded2[k1]):
				t.Fatal("layer 1's K was not loaded when the ungated index-K read happened")
			case !slices.Equal(peek.entered, []int{0, 1}):
				t.Fatalf("entry gates passed for layers %v, want 0 and 1", peek.entered)
			case slices.Equal(got, c2.want):
				t.Fatal("stale index keys gave the loaded prefix's logits")
			}
		})
	}
}
