package serve

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/kernels"
)

// The metamorphic harness. Greedy decoding is batch-invariant, so every way
// of serving one workload must give the greedy tokens of the plainest way:
// colocated, lock-step, TP 1, no prefix cache, no host tier, one sample.
// A seeded generator draws a variant (TP, loop, prefix cache, host tier, KV
// element type, index-K precision, PD or colocated, samples per request,
// prefill chunk); the harness runs the workload through it and through the
// reference of the same model, KV type and index-K precision, and compares every turn's tokens. On a failure
// it prints the seed and the variant, which replay it alone:
//
//	go test -run 'TestMetamorphic$' ./engine/serve/ -args -metamorphic.seed=SEED
//
// make test runs pairwiseSeeds, whose variants together cover every pair of
// axis values (TestMetamorphicSeedsCoverEveryPair holds them to it); the
// build tag metamorphic runs random seeds as well (metamorphic_random_test.go).

// variant is one way of serving.
type variant struct {
	TP      int
	Overlap bool
	Prefix  bool // the radix prefix cache
	HiCache bool // a host tier under it, the workload loading prefixes back from host
	KV      kernels.DType
	IndexK  kernels.IndexKDType
	PD      bool
	N       int // samples per request
	Chunk   int // prefill chunk, tokens
}

// metaAxis is one dimension of the variants: its name and values.
type metaAxis struct {
	name   string
	values []any
	get    func(variant) any
}

var metaAxes = []metaAxis{
	{"tp", []any{1, 2, 4}, func(v variant) any { return v.TP }},
	{"loop", []any{false, true}, func(v variant) any { return v.Overlap }},
	{"prefix", []any{false, true}, func(v variant) any { return v.Prefix }},
	{"hicache", []any{false, true}, func(v variant) any { return v.HiCache }},
	{"kv", []any{kernels.F32, kernels.BF16, kernels.F16}, func(v variant) any { return v.KV }},
	{"indexk", []any{kernels.IndexFP8, kernels.IndexBF16}, func(v variant) any { return v.IndexK }},
	{"pd", []any{false, true}, func(v variant) any { return v.PD }},
	{"n", []any{1, 2}, func(v variant) any { return v.N }},
	{"chunk", []any{7, 16, 64}, func(v variant) any { return v.Chunk }},
}

// drawVariant is seed's variant. The host tier lives under the prefix
// cache, so it is drawn only where the cache is on.
func drawVariant(seed uint64) variant {
	r := rand.New(rand.NewPCG(seed, 0x6d657461))
	pick := func(a int) any { vs := metaAxes[a].values; return vs[r.IntN(len(vs))] }
	v := variant{TP: pick(0).(int), Overlap: pick(1).(bool), Prefix: pick(2).(bool), HiCache: pick(3).(bool),
		KV: pick(4).(kernels.DType), IndexK: pick(5).(kernels.IndexKDType), PD: pick(6).(bool), N: pick(7).(int), Chunk: pick(8).(int)}
	v.HiCache = v.HiCache && v.Prefix
	return v
}

func (v variant) String() string {
	loop := ScheduleLockstep
	if v.Overlap {
		loop = ScheduleOverlap
	}
	role := "colocated"
	if v.PD {
		role = "pd"
	}
	return fmt.Sprintf("tp%d/%s/prefix=%v/hicache=%v/kv=%s/indexk=%v/%s/n%d/chunk%d", v.TP, loop, v.Prefix, v.HiCache, kernels.KVName(v.KV), v.IndexK, role, v.N, v.Chunk)
}

// possible reports whether a pair of axis values can occur together.
func possible(a, b metaAxis, x, y any) bool {
	if a.name == "prefix" && b.name == "hicache" {
		return x.(bool) || !y.(bool)
	}
	return true
}

// pairwiseSeeds are the seeds make test runs: their variants cover every
// possible pair of axis values (chosen greedily from the first 4,000 seeds,
// each adding the most pairs not yet covered).
var pairwiseSeeds = []uint64{1, 14, 37, 22, 1289, 380, 814, 2624, 27, 119, 23, 30}

// metaConfig is the engine configuration of variant v. The device pool is
// small enough that the workload's histories are evicted, and so loaded
// back from host when there is a host tier.
func metaConfig(v variant) Config {
	cfg := Config{TP: v.TP, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 48, PrefillChunk: v.Chunk,
		KVType: v.KV, IndexK: v.IndexK, DisablePrefixCache: !v.Prefix, Schedule: ScheduleLockstep}
	if v.Overlap {
		cfg.Schedule = ScheduleOverlap
	}
	if v.HiCache {
		cfg.HiCache = HiCacheConfig{Enabled: true, Ratio: 8}
	}
	return cfg
}

// referenceOf is the plainest way of serving with v's KV type and index-K
// precision, which change the numbers the model computes with.
func referenceOf(v variant) variant {
	return variant{TP: 1, KV: v.KV, IndexK: v.IndexK, N: 1, Chunk: 64}
}

// metaServer serves requests one way: a colocated engine or a PD pair.
type metaServer struct {
	v  variant
	e  *Engine // colocated
	pp *pdPair // PD
}

func newMetaServer(t *testing.T, m *model.Model, v variant) *metaServer {
	t.Helper()
	if v.PD {
		return &metaServer{v: v, pp: newPDPair(t, metaConfig(v))}
	}
	return &metaServer{v: v, e: newEngine(t, m, metaConfig(v))}
}

// engines are the server's engines, the prefill first.
func (s *metaServer) engines() []*Engine {
	if s.pp != nil {
		return []*Engine{s.pp.prefill, s.pp.decode}
	}
	return []*Engine{s.e}
}

// generate runs one greedy request of the variant's samples and returns
// the first sample's tokens, every other sample's having to equal them.
func (s *metaServer) generate(t *testing.T, prompt []int32, maxTok int) []int32 {
	t.Helper()
	q := Request{Prompt: prompt, MaxTokens: maxTok, IgnoreEOS: true, N: s.v.N}
	var streams []*Stream
	var prefill []*Stream
	if s.pp == nil {
		ss, err := s.e.SubmitN(context.Background(), q)
		if err != nil {
			t.Error(err)
			return nil
		}
		streams = ss
	} else {
		room := newAbortRoom()
		pq, dq := q, q
		pq.PD = &PDRequest{Room: room}
		dq.PD = &PDRequest{Room: room, BootstrapURL: s.pp.url}
		ps, err := s.pp.prefill.SubmitN(context.Background(), pq)
		if err != nil {
			t.Error(err)
			return nil
		}
		ds, err := s.pp.decode.SubmitN(context.Background(), dq)
		if err != nil {
			t.Error(err)
			return nil
		}
		streams, prefill = ds, ps
	}
	toks, fins := collectAll(t, streams)
	for _, p := range prefill {
		if _, f := collect(t, p, 60*time.Second); f.Reason != ReasonLength {
			t.Errorf("prefill half: %+v", f)
		}
	}
	for j := range toks {
		if fins[j].Reason != ReasonLength || !slices.Equal(toks[j], toks[0]) {
			t.Errorf("sample %d of %d: %v (%s), sample 0 %v", j, len(toks), toks[j], fins[j].Reason, toks[0])
		}
	}
	return toks[0]
}

// metaWorkload is the harness's workload: multi-turn chats over a shared
// system prefix, run concurrently, each turn after the last of its chat,
// then every chat's last turn again, one chat at a time, when most
// histories have left the device pool. It returns every turn's tokens.
func metaWorkload(t *testing.T, s *metaServer, ss []chat, maxTok int) [][][]int32 {
	t.Helper()
	out := make([][][]int32, len(ss))
	var wg sync.WaitGroup
	for i, c := range ss {
		wg.Go(func() {
			for _, p := range c {
				out[i] = append(out[i], s.generate(t, p, maxTok))
			}
		})
	}
	wg.Wait()
	for i, c := range ss {
		out[i] = append(out[i], s.generate(t, c[len(c)-1], maxTok))
	}
	return out
}

// metaReferences caches the reference runs within one test.
type metaReferences struct {
	mu   sync.Mutex
	runs map[variant][][][]int32
}

var metaSeed = flag.Uint64("metamorphic.seed", 0, "run TestMetamorphic on this seed alone (0: the pairwise seeds)")

// TestMetamorphic runs every pairwise seed's variant against its
// reference.
func TestMetamorphic(t *testing.T) {
	seeds := pairwiseSeeds
	if *metaSeed != 0 {
		seeds = []uint64{*metaSeed}
	}
	runMetamorphic(t, seeds)
}

// runMetamorphic runs the variants of seeds, each against the reference of
// its KV type and index-K precision, and checks what each variant must have exercised.
func runMetamorphic(t *testing.T, seeds []uint64) {
	m := tinyModel(t)
	ss := sessions(43, 12, 3, 24, m.Config.VocabSize)
	const maxTok = 4
	refs := &metaReferences{runs: map[variant][][][]int32{}}
	reference := func(t *testing.T, v variant) [][][]int32 {
		refs.mu.Lock()
		defer refs.mu.Unlock()
		rv := referenceOf(v)
		if r, ok := refs.runs[rv]; ok {
			return r
		}
		r := metaWorkload(t, newMetaServer(t, m, rv), ss, maxTok)
		refs.runs[rv] = r
		return r
	}
	for _, seed := range seeds {
		v := drawVariant(seed)
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Logf("variant %v", v)
			want := reference(t, v)
			s := newMetaServer(t, m, v)
			got := metaWorkload(t, s, ss, maxTok)
			bad := 0
			for i := range got {
				for j := range got[i] {
					if !slices.Equal(got[i][j], want[i][j]) {
						bad++
						if bad <= 3 {
							t.Errorf("chat %d turn %d: %v, reference %v", i, j, got[i][j], want[i][j])
						}
					}
				}
			}
			checkExercised(t, s)
			for _, e := range s.engines() {
				checkPools(t, e)
			}
			if t.Failed() {
				t.Logf("seed %d: variant %v (%d turns differ); replay: go test -run 'TestMetamorphic$' ./engine/serve/ -args -metamorphic.seed=%d", seed, v, bad, seed)
			}
		})
	}
}

// checkExercised fails a variant whose run did not do what it names: a
// prefix cache that hit nothing, a host tier that loaded nothing back, an
// overlap loop that never planned ahead, a PD pair that moved no KV or
// lost some.
func checkExercised(t *testing.T, s *metaServer) {
	t.Helper()
	var hits, hostHits, ahead uint64
	for _, e := range s.engines() {
		tot := e.View().Snapshot().Totals
		hits += tot.PrefixHits
		ahead += tot.PlannedAhead
		for _, ts := range e.View().HiCache() {
			hostHits += ts.Totals.HostHits
		}
	}
	var missing []string
	if s.v.Prefix && hits == 0 {
		missing = append(missing, "no prefix hit")
	}
	if s.v.HiCache && hostHits == 0 {
		missing = append(missing, "no prefix loaded back from host")
	}
	if s.v.Overlap && ahead == 0 {
		missing = append(missing, "no step planned while the one before flew")
	}
	if s.pp != nil {
		if sent, got := s.pp.prefill.PD().TransferBytes(), s.pp.decode.PD().TransferBytes(); got == 0 || sent != got {
			missing = append(missing, fmt.Sprintf("KV bytes: the prefill sent %d, the decode applied %d", sent, got))
		}
	}
	if len(missing) > 0 {
		t.Errorf("%v: the workload did not exercise the variant: %s", s.v, strings.Join(missing, ", "))
	}
}

// metaPairs are the possible pairs of axis values a set of variants
// covers, and all possible ones.
func metaPairs(vs []variant) (covered, all map[string]bool) {
	covered, all = map[string]bool{}, map[string]bool{}
	key := func(a, b int, x, y any) string {
		return fmt.Sprintf("%s=%v,%s=%v", metaAxes[a].name, x, metaAxes[b].name, y)
	}
	for a := range metaAxes {
		for b := a + 1; b < len(metaAxes); b++ {
			for _, x := range metaAxes[a].values {
				for _, y := range metaAxes[b].values {
					if possible(metaAxes[a], metaAxes[b], x, y) {
						all[key(a, b, x, y)] = true
					}
				}
			}
			for _, v := range vs {
				covered[key(a, b, metaAxes[a].get(v), metaAxes[b].get(v))] = true
			}
		}
	}
	return covered, all
}

// TestMetamorphicSeedsCoverEveryPair: the seeds make test runs cover every
// possible pair of axis values, so a change to the generator that loses a
// pair fails here, not silently.
func TestMetamorphicSeedsCoverEveryPair(t *testing.T) {
	var vs []variant
	for _, s := range pairwiseSeeds {
		vs = append(vs, drawVariant(s))
	}
	covered, all := metaPairs(vs)
	var missing []string
	for p := range all {
		if !covered[p] {
			missing = append(missing, p)
		}
	}
	slices.Sort(missing)
	if len(missing) > 0 {
		t.Errorf("%d of %d pairs not covered by seeds %v: %v; greedy seeds: %v", len(missing), len(all), pairwiseSeeds, missing, greedySeeds(4000))
	}
}

// greedySeeds picks, from seeds 1..n, seeds whose variants cover every
// possible pair: each time the one that adds the most pairs not yet
// covered (the lowest such seed on a tie).
func greedySeeds(n uint64) []uint64 {
	_, all := metaPairs(nil)
	covered := map[string]bool{}
	var out []uint64
	for len(covered) < len(all) {
		best, gain := uint64(0), 0
		for s := uint64(1); s <= n; s++ {
			c, _ := metaPairs([]variant{drawVariant(s)})
			g := 0
			for p := range c {
				if all[p] && !covered[p] {
					g++
				}
			}
			if g > gain {
				best, gain = s, g
			}
		}
		if gain == 0 {
			break
		}
		out = append(out, best)
		c, _ := metaPairs([]variant{drawVariant(best)})
		for p := range c {
			if all[p] {
				covered[p] = true
			}
		}
	}
	return out
}
