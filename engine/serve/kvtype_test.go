package serve

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// A decode whose pools store bf16 refuses a prefill that stores f32 at the
// handshake: the request fails naming kv_dtype and both types, nothing
// streams, and neither side holds a page after.
func TestPDHandshakeRefusesKVType(t *testing.T) {
	p, d, toks, fin := pdHandshake(t,
		Config{PageSize: 4, KVTokens: 256, MaxRunning: 2, KVType: kernels.F32},
		Config{PageSize: 4, KVTokens: 256, MaxRunning: 2, KVType: kernels.BF16})
	if len(toks) != 0 || !strings.Contains(fin.Reason, "kv_dtype") || !strings.Contains(fin.Reason, `"f32"`) || !strings.Contains(fin.Reason, `"bf16"`) {
		t.Errorf("got %v, finish %q; want no token and the kv_dtype mismatch named with both types", toks, fin.Reason)
	}
	if d.PD().Failures() != 1 {
		t.Errorf("decode counts %d PD failures, want 1", d.PD().Failures())
	}
	checkPools(t, d)
	checkPools(t, p)
	if p.PD().TransferBytes() != 0 || d.PD().TransferBytes() != 0 {
		t.Errorf("KV moved across a refused handshake: prefill %d, decode %d bytes", p.PD().TransferBytes(), d.PD().TransferBytes())
	}
}

// A PD transfer of one prompt moves half the bytes with bf16 and f16 pools
// that it moves with f32 ones: exactly half on a model without an indexer
// (whose KV is all there is), Layers × 2 × KVDim × 2 bytes per token.
func TestPDKVBytesPerToken(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	prompt := testmodel.Prompts(23, 1, 37, 37, m.Config.VocabSize)[0]
	bytes := map[kernels.DType]uint64{}
	for _, kv := range []kernels.DType{kernels.F32, kernels.BF16, kernels.F16} {
		cfg := Config{PageSize: 4, KVTokens: 256, MaxRunning: 2, KVType: kv, Role: pdproto.RolePrefill}
		pc, dc := cfg, cfg
		dc.Role = pdproto.RoleDecode
		p := newEngine(t, m, pc)
		d := newEngine(t, m, dc)
		url := serveRegistry(t, p, 1)
		allowRegistry(t, d, url)
		pp := &pdPair{prefill: p, decode: d, url: url}
		toks, dfin, _ := pp.run(t, context.Background(), Request{Prompt: prompt, MaxTokens: 2}, 11)
		if len(toks) != 2 {
			t.Fatalf("%s: %d tokens, finish %q", kernels.KVName(kv), len(toks), dfin.Reason)
		}
		bytes[kv] = d.PD().TransferBytes()
		c := &m.Config
		if want := uint64(len(prompt) * c.Layers * 2 * c.KVDim() * kernels.KVElemBytes(kv)); bytes[kv] != want {
			t.Errorf("%s: %d bytes moved for %d tokens, want %d", kernels.KVName(kv), bytes[kv], len(prompt), want)
		}
		if p.PD().TransferBytes() != bytes[kv] {
			t.Errorf("%s: prefill counts %d bytes, decode %d", kernels.KVName(kv), p.PD().TransferBytes(), bytes[kv])
		}
		checkPools(t, p)
		checkPools(t, d)
		p.Close()
		d.Close()
	}
	t.Logf("bytes per token: f32 %d, bf16 %d, f16 %d", bytes[kernels.F32]/uint64(len(prompt)),
		bytes[kernels.BF16]/uint64(len(prompt)), bytes[kernels.F16]/uint64(len(prompt)))
	if bytes[kernels.BF16]*2 != bytes[kernels.F32] || bytes[kernels.F16] != bytes[kernels.BF16] {
		t.Errorf("bytes moved: f32 %d, bf16 %d, f16 %d; want 16-bit half of f32", bytes[kernels.F32], bytes[kernels.BF16], bytes[kernels.F16])
	}
}

// The KV type is published in the settings, sizes the decode's message
// limit by its element, and a type a pool cannot store is refused.
func TestKVTypeConfig(t *testing.T) {
	m := tinyModel(t)
	for _, kv := range []kernels.DType{kernels.F32, kernels.BF16, kernels.F16} {
		if s := settingsOf(Config{KVType: kv}, false, nil); s.KVDType != kernels.KVName(kv) {
			t.Errorf("settings publish kv_dtype %q for %v", s.KVDType, kv)
		}
	}
	limit := func(kv kernels.DType) int64 {
		e := &Engine{m: m, cfg: Config{TP: 1, PageSize: 16, Role: pdproto.RoleDecode, KVType: kv}}
		return e.maxMessageBytes()
	}
	c := &m.Config
	row := int64(c.KVDim())
	if c.Indexer != nil {
		row = max(row*2, int64(c.Indexer.Dim)*2)
	} else {
		row *= 2
	}
	if got, want := limit(kernels.F32)-limit(kernels.BF16), int64(c.ContextLen)*(int64(c.KVDim())*4-row); got != want {
		t.Errorf("decode message limit: f32 %d, bf16 %d; differ by %d, want %d", limit(kernels.F32), limit(kernels.BF16), got, want)
	}
	for _, kv := range []kernels.DType{kernels.Q8_0, kernels.DType(99)} {
		cfg := Config{KVType: kv, Backend: cpuBackend}
		if _, err := New(m, cfg); err == nil || !strings.Contains(err.Error(), "KV type") {
			t.Errorf("KV type %v: %v", kv, err)
		}
	}
}

// Greedy outputs through the engine equal the simple runner's with bf16 and
// f16 pools, at TP 1, 2 and 4 (TestGreedyMatchesRunner runs f32 with more
// prompts): every rank rounds its own heads as the one-rank runner does.
func TestGreedyMatchesRunnerKV16(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(7, 4, 3, 40, m.Config.VocabSize)
	const maxTok = 12
	for _, kv := range []kernels.DType{kernels.BF16, kernels.F16} {
		want := runnerGreedy(t, m, runner.Options{PageSize: 4, KVTokens: 512, KVType: kv}, ps, maxTok)
		for _, n := range []int{1, 2, 4} {
			t.Run(fmt.Sprintf("%s/tp%d", kernels.KVName(kv), n), func(t *testing.T) {
				e := newEngine(t, m, Config{TP: n, PageSize: 4, KVTokens: 96, MaxRunning: 4, MaxBatchTokens: 24, PrefillChunk: 7, KVType: kv})
				matchRunner(t, e, ps, maxTok, want)
				checkPools(t, e)
			})
		}
	}
}
