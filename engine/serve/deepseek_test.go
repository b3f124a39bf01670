package serve

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// On the DeepSeek-shaped model (latent attention, one latent row per
// token, the indexer's keys beside it), with the latent stored in bf16:
// colocated and PD, HiCache off and on, at TP 1 and 2 and both index-K
// precisions, every turn's greedy tokens are the same; the decode received
// the prompt KV the prefill computed, bit for bit, with HiCache as without;
// and the HiCache runs really loaded prefixes back from host.
func TestDeepSeekShapedEquality(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchDeepSeek2DSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	ss := sessions(61, 24, 4, 24, m.Config.VocabSize)
	const maxTok = 3
	for _, ik := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, n := range []int{1, 2} {
			t.Run(fmt.Sprintf("%v/tp%d", ik, n), func(t *testing.T) {
				cfg := Config{TP: n, PageSize: 4, KVTokens: 384, MaxRunning: 4, MaxBatchTokens: 48, PrefillChunk: 16, IndexK: ik, KVType: kernels.BF16}
				want := runChatsRevisit(t, newEngine(t, m, cfg), ss, maxTok)
				on := cfg
				on.HiCache = HiCacheConfig{Enabled: true, Ratio: 8}
				col := newEngine(t, m, on)
				checkTurns(t, runChatsRevisit(t, col, ss, maxTok), want, "colocated, hicache on", "colocated, off")
				hostHits(t, "colocated", col)

				d := &kvDigests{got: map[[2]uint64]uint64{}}
				arrivedHook = d.hook
				t.Cleanup(func() { arrivedHook = nil })
				checkTurns(t, runPDChats(t, newPDPairOf(t, m, cfg), ss, maxTok, 10000), want, "PD, hicache off", "colocated, off")
				pp := newPDPairOf(t, m, on)
				checkTurns(t, runPDChats(t, pp, ss, maxTok, 20000), want, "PD, hicache on", "colocated, off")
				hostHits(t, "PD prefill", pp.prefill)
				for i := range ss {
					for j := range len(ss[i]) + 1 {
						for r := range uint64(n) {
							a, b := d.got[[2]uint64{20000 + uint64(i*100+j), r}], d.got[[2]uint64{10000 + uint64(i*100+j), r}]
							if a == 0 || a != b {
								t.Errorf("chat %d turn %d rank %d: received KV digest %x with hicache, %x without", i, j, r, a, b)
							}
						}
					}
				}
				checkPools(t, pp.prefill)
				checkPools(t, pp.decode)
			})
		}
	}
}

// hostHits fails the test unless every rank of e loaded prefixes back
// from host without a failure.
func hostHits(t *testing.T, what string, e *Engine) {
	t.Helper()
	for _, ts := range e.View().HiCache() {
		if ts.Totals.HostHits == 0 || ts.Totals.LoadFailures != 0 {
			t.Errorf("%s rank %d: %+v", what, ts.Rank, ts.Totals)
		}
	}
}

// runChatsRevisit is runChats plus, once every chat has ended, its last
// turn once more (a revisit), as runPDChats runs them.
func runChatsRevisit(t *testing.T, e *Engine, ss []chat, maxTok int) [][][]int32 {
	t.Helper()
	out := runChats(t, e, ss, maxTok)
	last := make([]chat, len(ss))
	for i, s := range ss {
		last[i] = chat{s[len(s)-1]}
	}
	for i, r := range runChats(t, e, last, maxTok) {
		out[i] = append(out[i], r[0])
	}
	return out
}

// A KV memory budget sizes every rank's pool in whole pages at the bytes
// a token takes there: a 16-bit pool holds twice the tokens of an f32
// one, a latent model's replicated row is counted on every rank, and a
// budget that holds no page is refused naming --kv-memory.
func TestKVMemorySizesThePool(t *testing.T) {
	for _, tc := range []struct {
		arch   string
		tp     int
		kv     kernels.DType
		perTok int64 // bytes one token takes in one rank's pool
		tokens int
	}{
		// llama-dsa tiny: 2 layers × (K and V of 16 per rank at TP 2, or 32) + fp8 index-K of 16 and its scale.
		{model.ArchLlamaDSA, 1, kernels.F32, 2 * (2*32*4 + 16 + 4), 1 << 20 / (2 * (2*32*4 + 16 + 4)) / 4 * 4},
		{model.ArchLlamaDSA, 2, kernels.F32, 2 * (2*16*4 + 16 + 4), 1 << 20 / 2 / (2 * (2*16*4 + 16 + 4)) / 4 * 4},
		{model.ArchLlamaDSA, 1, kernels.BF16, 2 * (2*32*2 + 16 + 4), 1 << 20 / (2 * (2*32*2 + 16 + 4)) / 4 * 4},
		// deepseek2-dsa tiny: 2 layers × (a latent row of 72, whole on every rank) + index-K.
		{model.ArchDeepSeek2DSA, 2, kernels.BF16, 2 * (72*2 + 16 + 4), 1 << 20 / 2 / (2 * (72*2 + 16 + 4)) / 4 * 4},
	} {
		m := testmodel.Open(t, builtin.Spec{Arch: tc.arch, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
		cfg := Config{TP: tc.tp, PageSize: 4, KVMemory: 1 << 20, KVType: tc.kv, Backend: cpuBackend}
		cfg.setDefaults(m)
		if got := cfg.tokenBytes(m); got != tc.perTok {
			t.Errorf("%s TP %d %s: %d bytes a token, want %d", tc.arch, tc.tp, kernels.KVName(tc.kv), got, tc.perTok)
		}
		if cfg.KVTokens != tc.tokens || cfg.KVTokens%4 != 0 {
			t.Errorf("%s TP %d %s: %d KV tokens per rank from 1 MiB, want %d", tc.arch, tc.tp, kernels.KVName(tc.kv), cfg.KVTokens, tc.tokens)
		}
		e := newEngine(t, m, cfg)
		if used, _, total := e.View().KVPages(0); total*4 != tc.tokens || used != 0 {
			t.Errorf("%s: the engine's pool has %d pages, want %d", tc.arch, total, tc.tokens/4)
		}
	}
	m := tinyModel(t)
	cfg := Config{PageSize: 16, KVMemory: 1000, Backend: cpuBackend}
	cfg.setDefaults(m)
	if err := cfg.Validate(m); err == nil || !strings.Contains(err.Error(), "a KV memory of 1000 bytes (--kv-memory) holds no page of 16 tokens") {
		t.Errorf("a budget of 1000 bytes: %v", err)
	}
}
