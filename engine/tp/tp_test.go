package tp_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/tp"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

func tiny(arch string) builtin.Spec {
	return builtin.Spec{Arch: arch, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32}
}

const (
	pageSize = 4
	maxSeqs  = 4
	kvTokens = 512
	steps    = 16
)

func prompts(seed uint64, n, vocab int) [][]int32 {
	return testmodel.Prompts(seed, n, 5, 34, vocab)
}

func newEngine(t *testing.T, m *model.Model, n int) *tp.Engine {
	return newEngineKV(t, m, n, kernels.F32)
}

// newEngineKV is newEngine with pools that store K and V as kv.
func newEngineKV(t *testing.T, m *model.Model, n int, kv kernels.DType) *tp.Engine {
	t.Helper()
	e, err := tp.New(m, tp.Options{Ranks: n, Backend: func(int) kernels.Backend { return cpu.New(1) }, PageSize: pageSize, KVTokens: kvTokens, MaxSeqs: maxSeqs, IndexK: kernels.IndexFP8, KVType: kv})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
	})
	return e
}

// stepFunc runs one forward step; logits holds Σ NumLogits × vocab floats.
type stepFunc func(batch []tp.Input, logits []float32) error

// trace is what a greedy run produced: the logits of every step and the
// generated tokens of every prompt.
type trace struct {
	logits [][]float32
	tokens [][]int32
}

// run prefills the prompts (in chunks of 7 tokens, all sequences batched
// together) and then decodes steps greedy tokens for each, recording every
// step's logits.
func run(t *testing.T, vocab int, ps [][]int32, step stepFunc) trace {
	t.Helper()
	var tr trace
	tr.tokens = make([][]int32, len(ps))
	done := make([]int, len(ps))
	const chunk = 7
	for {
		var batch []tp.Input
		var who []int
		for i, p := range ps {
			if done[i] == len(p) {
				continue
			}
			end := min(done[i]+chunk, len(p))
			nl := 0
			if end == len(p) {
				nl = 1
			}
			batch = append(batch, tp.Input{SeqID: uint64(100 + i), Tokens: p[done[i]:end], NumLogits: nl})
			who = append(who, i)
			done[i] = end
		}
		if len(batch) == 0 {
			break
		}
		lg := make([]float32, len(batch)*vocab)
		if err := step(batch, lg); err != nil {
			t.Fatal(err)
		}
		tr.logits = append(tr.logits, lg)
		j := 0
		for k, in := range batch {
			if in.NumLogits == 1 {
				tr.tokens[who[k]] = append(tr.tokens[who[k]], sample.Greedy(lg[j*vocab:(j+1)*vocab]))
				j++
			}
		}
	}
	for range steps {
		batch := make([]tp.Input, len(ps))
		for i := range ps {
			last := tr.tokens[i][len(tr.tokens[i])-1]
			batch[i] = tp.Input{SeqID: uint64(100 + i), Tokens: []int32{last}, NumLogits: 1}
		}
		lg := make([]float32, len(batch)*vocab)
		if err := step(batch, lg); err != nil {
			t.Fatal(err)
		}
		tr.logits = append(tr.logits, lg)
		for i := range ps {
			tr.tokens[i] = append(tr.tokens[i], sample.Greedy(lg[i*vocab:(i+1)*vocab]))
		}
	}
	return tr
}

// execStep drives model.Exec, the one-rank forward pass, with the same
// inputs.
func execStep(t *testing.T, m *model.Model) stepFunc { return execStepKV(t, m, kernels.F32) }

// execStepKV is execStep with a pool that stores K and V as kv.
func execStepKV(t *testing.T, m *model.Model, kv kernels.DType) stepFunc {
	b := cpu.New(1)
	t.Cleanup(b.Close)
	pc := m.PoolConfig(pageSize, kvTokens/pageSize, maxSeqs, kernels.IndexFP8)
	pc.KVType = kv
	pool, err := kvcache.NewPool(pc)
	if err != nil {
		t.Fatal(err)
	}
	ex, err := m.NewExec(b, pool)
	if err != nil {
		t.Fatal(err)
	}
	return func(batch []tp.Input, logits []float32) error {
		in := make([]model.SeqInput, len(batch))
		for i, x := range batch {
			s, ok := pool.Seq(x.SeqID)
			if !ok {
				if s, err = pool.NewSeq(x.SeqID); err != nil {
					return err
				}
			}
			in[i] = model.SeqInput{Seq: s, Tokens: x.Tokens, NumLogits: x.NumLogits}
		}
		return ex.Forward(in, logits)
	}
}

func engineStep(e *tp.Engine) stepFunc {
	return func(batch []tp.Input, logits []float32) error {
		return e.Forward(context.Background(), batch, logits)
	}
}

func sameBits(t *testing.T, name string, got, want trace) {
	t.Helper()
	if len(got.logits) != len(want.logits) {
		t.Fatalf("%s: %d steps, want %d", name, len(got.logits), len(want.logits))
	}
	for s := range want.logits {
		g, w := got.logits[s], want.logits[s]
		for i := range w {
			if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
				t.Fatalf("%s: step %d logit %d is %v (%#x), want %v (%#x)", name, s, i, g[i], math.Float32bits(g[i]), w[i], math.Float32bits(w[i]))
			}
		}
	}
	for i := range want.tokens {
		if !slices.Equal(got.tokens[i], want.tokens[i]) {
			t.Fatalf("%s: prompt %d generates\n%v\nwant\n%v", name, i, got.tokens[i], want.tokens[i])
		}
	}
}

// TestBitExact runs the same prompts through model.Exec and through this
// package at TP=1 and TP=2 and requires bitwise equal logits at every step
// (prefill in chunks, then greedy decoding) and equal tokens.
func TestBitExact(t *testing.T) {
	for _, spec := range []builtin.Spec{
		tiny(model.ArchLlama), tiny(model.ArchLlamaDSA), tiny(model.ArchDeepSeek2), tiny(model.ArchDeepSeek2DSA),
		{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.Q8_0},
		{Arch: model.ArchDeepSeek2DSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.Q8_0},
	} {
		t.Run(spec.FileName(), func(t *testing.T) {
			m := testmodel.Open(t, spec)
			v := m.Config.VocabSize
			ps := prompts(7, 3, v)
			want := run(t, v, ps, execStep(t, m))
			distinct := map[int32]bool{}
			for _, tok := range want.tokens[0] {
				distinct[tok] = true
			}
			if len(distinct) < 3 {
				t.Fatalf("prompt 0 generates %v: too repetitive to show anything", want.tokens[0])
			}
			for _, n := range []int{1, 2, 4} {
				e := newEngine(t, m, n)
				got := run(t, v, ps, engineStep(e))
				sameBits(t, fmt.Sprintf("TP=%d vs model.Exec", n), got, want)
				for i := range ps {
					if err := e.Release(context.Background(), uint64(100+i)); err != nil {
						t.Fatal(err)
					}
				}
				for r := range n {
					p := e.Pool(r)
					if p.FreePages() != p.TotalPages() || p.Live() != 0 {
						t.Errorf("TP=%d rank %d: %d of %d pages free, %d live after Release", n, r, p.FreePages(), p.TotalPages(), p.Live())
					}
					if err := p.Check(); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
}

// TestBitExactKV16 is TestBitExact for the 16-bit KV types, on the sparse
// model: every rank rounds its own KV heads in kvcache.WriteKV, as the one
// rank does, so TP=1, 2 and 4 equal model.Exec bit for bit; and the rounding
// is real (the logits differ from the F32 pool's).
func TestBitExactKV16(t *testing.T) {
	for _, arch := range []string{model.ArchLlamaDSA, model.ArchDeepSeek2DSA} {
		t.Run(arch, func(t *testing.T) { bitExactKV16(t, arch) })
	}
}

func bitExactKV16(t *testing.T, arch string) {
	m := testmodel.Open(t, tiny(arch))
	v := m.Config.VocabSize
	ps := prompts(7, 3, v)
	f32 := run(t, v, ps, execStep(t, m))
	for _, kv := range []kernels.DType{kernels.BF16, kernels.F16} {
		t.Run(kernels.KVName(kv), func(t *testing.T) {
			want := run(t, v, ps, execStepKV(t, m, kv))
			if slices.EqualFunc(slices.Concat(want.logits...), slices.Concat(f32.logits...), func(a, b float32) bool { return a == b }) {
				t.Fatalf("%s logits equal the f32 pool's: the pool does not round", kernels.KVName(kv))
			}
			for _, n := range []int{1, 2, 4} {
				e := newEngineKV(t, m, n, kv)
				got := run(t, v, ps, engineStep(e))
				sameBits(t, fmt.Sprintf("%s TP=%d vs model.Exec", kernels.KVName(kv), n), got, want)
				if k := e.Pool(0).KVType(); k != kv {
					t.Fatalf("TP=%d pool stores %v", n, k)
				}
			}
		})
	}
}

func TestRefusesIndivisibleShapes(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlama))
	for _, c := range []struct {
		n    int
		want string
	}{
		{8, "tp: tensor parallelism 8 must divide the 4 KV heads"},
		{3, "tp: tensor parallelism 3 must divide the 8 attention heads"},
		{0, "tp: tensor parallelism 0 must be at least 1"},
	} {
		made := 0
		_, err := tp.New(m, tp.Options{Ranks: c.n, Backend: func(int) kernels.Backend { made++; return cpu.New(1) }, PageSize: pageSize, KVTokens: kvTokens, MaxSeqs: maxSeqs, IndexK: kernels.IndexFP8})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("TP=%d: error %v, want %q", c.n, err, c.want)
		}
		if made != 0 {
			t.Errorf("TP=%d: made %d backends before refusing", c.n, made)
		}
	}
}

func TestForwardErrors(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlama))
	e := newEngine(t, m, 2)
	v := m.Config.VocabSize
	lg := make([]float32, v)
	bg := context.Background()
	if err := e.Forward(bg, []tp.Input{{SeqID: 1, Tokens: []int32{int32(v)}, NumLogits: 1}}, lg); err == nil {
		t.Error("token out of vocabulary accepted")
	}
	if err := e.Forward(bg, []tp.Input{{SeqID: 1, Tokens: []int32{5}, NumLogits: 1}}, lg[:v-1]); err == nil {
		t.Error("short logits buffer accepted")
	}
	if err := e.Release(bg, 1); err == nil {
		t.Error("release of an unknown sequence succeeded")
	}
	// Too long for the pool: every rank refuses together and nothing leaks.
	long := make([]int32, kvTokens+1)
	if err := e.Forward(bg, []tp.Input{{SeqID: 2, Tokens: long, NumLogits: 1}}, lg); err == nil {
		t.Error("sequence longer than the pool accepted")
	}
	for r := range 2 {
		if p := e.Pool(r); p.Live() != 0 || p.FreePages() != p.TotalPages() {
			t.Errorf("rank %d: %d live, %d of %d pages free after a refused step", r, p.Live(), p.FreePages(), p.TotalPages())
		}
	}
	// The engine still works.
	if err := e.Forward(bg, []tp.Input{{SeqID: 3, Tokens: []int32{5, 6}, NumLogits: 1}}, lg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(bg)
	cancel()
	if err := e.Forward(ctx, []tp.Input{{SeqID: 3, Tokens: []int32{7}, NumLogits: 1}}, lg); !errors.Is(err, context.Canceled) && !errors.Is(err, tp.ErrAbandoned) {
		t.Errorf("cancelled step: %v", err)
	}
}

// TestCloseLeavesNoGoroutines checks that Close stops the rank goroutines
// and the backends' workers, and that calls after Close fail.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlamaDSA))
	before := runtime.NumGoroutine()
	e, err := tp.New(m, tp.Options{Ranks: 2, Backend: func(int) kernels.Backend { return cpu.New(2) }, PageSize: pageSize, KVTokens: kvTokens, MaxSeqs: maxSeqs, IndexK: kernels.IndexBF16})
	if err != nil {
		t.Fatal(err)
	}
	lg := make([]float32, m.Config.VocabSize)
	if err := e.Forward(context.Background(), []tp.Input{{SeqID: 1, Tokens: prompts(1, 1, m.Config.VocabSize)[0], NumLogits: 1}}, lg); err != nil {
		t.Fatal(err)
	}
	if got := runtime.NumGoroutine(); got < before+2 {
		t.Fatalf("%d goroutines with the engine running, %d before: where are the ranks?", got, before)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if !waitfor.Poll(5*time.Second, func() bool { return runtime.NumGoroutine() <= before }) {
		buf := make([]byte, 1<<16)
		t.Fatalf("%d goroutines 5s after Close, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
	}
	if err := e.Forward(context.Background(), []tp.Input{{SeqID: 1, Tokens: []int32{5}, NumLogits: 1}}, lg); !errors.Is(err, tp.ErrClosed) {
		t.Errorf("Forward after Close: %v, want ErrClosed", err)
	}
}
