package runner_test

import (
	"context"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

func tiny(arch string) builtin.Spec {
	return builtin.Spec{Arch: arch, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32}
}

func prompts(seed uint64, n, vocab int) [][]int32 {
	return testmodel.Prompts(seed, n, 3, 42, vocab)
}

func greedy(ps [][]int32, maxTokens int) []runner.Request {
	reqs := make([]runner.Request, len(ps))
	for i, p := range ps {
		reqs[i] = runner.Request{Prompt: p, MaxTokens: maxTokens, IgnoreEOS: true}
	}
	return reqs
}

func generate(t *testing.T, m *model.Model, b kernels.Backend, opts runner.Options, reqs []runner.Request) []runner.Result {
	t.Helper()
	opts.MaxSeqs = len(reqs)
	for _, q := range reqs {
		opts.KVTokens += len(q.Prompt) + q.MaxTokens + 16 // + a page of rounding
	}
	r, err := runner.New(m, b, opts)
	if err != nil {
		t.Fatal(err)
	}
	res, _, err := r.Generate(context.Background(), reqs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if free, total := r.Pool().FreePages(), r.Pool().TotalPages(); free != total {
		t.Fatalf("after Generate %d of %d pages are free", free, total)
	}
	if err := r.Pool().Check(); err != nil {
		t.Fatal(err)
	}
	return res
}

// TestGreedyIsBatchInvariant proves that a prompt's greedy tokens do not
// depend on its neighbours: alone, and at every place in a batch of 32 other
// prompts (with another prefill chunking), it generates the same tokens. Corruption by a neighbour is detectable only
// because of this. It holds for every KV element type; the 16-bit types run
// on the sparse model at the batch's ends and middle only, to keep the test
// short (the rounding is per row, in kvcache.WriteKV, whatever the batch).
func TestGreedyIsBatchInvariant(t *testing.T) {
	for _, tc := range []struct {
		arch string
		kv   kernels.DType
		all  bool // every batch position, or the ends and the middle
	}{
		{model.ArchLlama, kernels.F32, true}, {model.ArchLlamaDSA, kernels.F32, true},
		{model.ArchLlamaDSA, kernels.BF16, false}, {model.ArchLlamaDSA, kernels.F16, false},
	} {
		t.Run(tc.arch+"/"+kernels.KVName(tc.kv), func(t *testing.T) {
			m := testmodel.Open(t, tiny(tc.arch))
			b := cpu.New(2)
			defer b.Close()
			const maxTokens = 20
			others := prompts(5, 32, m.Config.VocabSize)
			probe := prompts(99, 1, m.Config.VocabSize)[0]
			alone := generate(t, m, b, runner.Options{PageSize: 4, PrefillChunk: 512, KVType: tc.kv}, greedy([][]int32{probe}, maxTokens))[0].Tokens
			if distinct(alone) < 3 {
				t.Fatalf("probe generates %v: too repetitive for this test to detect corruption", alone)
			}
			for at := range len(others) + 1 {
				if !tc.all && at != 0 && at != len(others)/2 && at != len(others) {
					continue
				}
				ps := slices.Insert(slices.Clone(others), at, probe)
				got := generate(t, m, b, runner.Options{PageSize: 4, PrefillChunk: 37, KVType: tc.kv}, greedy(ps, maxTokens))
				if !slices.Equal(got[at].Tokens, alone) {
					t.Errorf("at batch position %d of %d the prompt generates\n%v\nalone it generates\n%v", at, len(ps), got[at].Tokens, alone)
				}
			}
		})
	}
}

func distinct(s []int32) int {
	seen := map[int32]bool{}
	for _, v := range s {
		seen[v] = true
	}
	return len(seen)
}

// TestThreadsAndBackendsAgree checks that the fast kernels at any thread
// count produce the same greedy tokens as each other (bit-exact kernels), and
// that the reference kernels agree on the greedy tokens.
func TestThreadsAndBackendsAgree(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlamaDSA))
	reqs := greedy(prompts(3, 4, m.Config.VocabSize), 12)
	var want []runner.Result
	for _, th := range []int{1, 2, 3} {
		b := cpu.New(th)
		got := generate(t, m, b, runner.Options{}, reqs)
		b.Close()
		if want == nil {
			want = got
			continue
		}
		for i := range got {
			if !slices.Equal(got[i].Tokens, want[i].Tokens) {
				t.Errorf("%d threads, request %d: %v, 1 thread: %v", th, i, got[i].Tokens, want[i].Tokens)
			}
		}
	}
}

// TestIndexKPrecisions runs the sparse model with fp8 and bf16 index keys:
// both must generate valid tokens (they may differ, since the precision
// changes which tokens the indexer selects).
func TestIndexKPrecisions(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlamaDSA))
	b := cpu.New(2)
	defer b.Close()
	long := prompts(8, 4, m.Config.VocabSize)
	for i := range long {
		long[i] = append(long[i], long[i]...) // past top-k 8: the sparse path runs
	}
	out := map[kernels.IndexKDType][]runner.Result{}
	for _, ik := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		res := generate(t, m, b, runner.Options{IndexK: ik}, greedy(long, 16))
		for i, r := range res {
			if len(r.Tokens) != 16 || r.Finish != runner.FinishLength {
				t.Fatalf("%v request %d: %d tokens, finish %q", ik, i, len(r.Tokens), r.Finish)
			}
			for _, tok := range r.Tokens {
				if tok < 0 || int(tok) >= m.Config.VocabSize {
					t.Fatalf("%v request %d: token %d out of vocabulary", ik, i, tok)
				}
			}
		}
		out[ik] = res
	}
	same := 0
	for i := range long {
		if slices.Equal(out[kernels.IndexFP8][i].Tokens, out[kernels.IndexBF16][i].Tokens) {
			same++
		}
	}
	t.Logf("fp8 and bf16 index keys gave the same tokens for %d of %d prompts", same, len(long))
}

// TestSamplingIsSeeded: the same seed gives the same tokens, another seed
// (almost surely) others.
func TestSamplingIsSeeded(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlama))
	b := cpu.New(1)
	defer b.Close()
	p := prompts(4, 1, m.Config.VocabSize)[0]
	run := func(seed uint64) []int32 {
		req := runner.Request{Prompt: p, MaxTokens: 24, IgnoreEOS: true, Sampling: sample.Params{Temperature: 1.5, Seed: seed}}
		return generate(t, m, b, runner.Options{}, []runner.Request{req})[0].Tokens
	}
	a, a2, c := run(1), run(1), run(2)
	if !slices.Equal(a, a2) {
		t.Fatalf("seed 1 gave %v then %v", a, a2)
	}
	if slices.Equal(a, c) {
		t.Fatalf("seeds 1 and 2 both gave %v", a)
	}
}

// TestCancelReleasesPages: a cancelled generation returns the context's
// error and leaves every page free.
func TestCancelReleasesPages(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlamaDSA))
	b := cpu.New(1)
	defer b.Close()
	r, err := runner.New(m, b, runner.Options{MaxSeqs: 2, KVTokens: 256})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	_, _, err = r.Generate(ctx, greedy(prompts(1, 2, m.Config.VocabSize), 50), func(int, int32) {
		if n++; n == 5 {
			cancel()
		}
	})
	if err != context.Canceled {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if free, total := r.Pool().FreePages(), r.Pool().TotalPages(); free != total {
		t.Fatalf("after cancel %d of %d pages are free", free, total)
	}
}

// TestBadRequests are refused with an error before any work.
func TestBadRequests(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlama))
	b := cpu.New(1)
	defer b.Close()
	r, err := runner.New(m, b, runner.Options{MaxSeqs: 1})
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]runner.Request{
		"empty prompt":  {MaxTokens: 1},
		"zero tokens":   {Prompt: []int32{5}, MaxTokens: 0},
		"over context":  {Prompt: []int32{5}, MaxTokens: m.Config.ContextLen},
		"bad token":     {Prompt: []int32{int32(m.Config.VocabSize)}, MaxTokens: 1},
		"negative temp": {Prompt: []int32{5}, MaxTokens: 1, Sampling: sample.Params{Temperature: -1}},
	}
	for name, q := range cases {
		if _, _, err := r.Generate(context.Background(), []runner.Request{q}, nil); err == nil {
			t.Errorf("%s: accepted", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
		if free, total := r.Pool().FreePages(), r.Pool().TotalPages(); free != total {
			t.Fatalf("%s: %d of %d pages free afterwards", name, free, total)
		}
	}
	if _, _, err := r.Generate(context.Background(), greedy(prompts(1, 2, 100), 1), nil); err == nil {
		t.Error("two requests accepted by a one-sequence runner")
	}
}
