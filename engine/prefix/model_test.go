package prefix_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

// run prefills each prompt from its sequence's Len on, all in one batch,
// then decodes steps greedy tokens, and returns per sequence the logits of
// every prompt token it computed and of every decode step, and its tokens
// (prompt and decoded) whose KV is written.
func run(t *testing.T, e *model.Exec, vocab int, seqs []*kvcache.Seq, prompts [][]int32, steps int) ([][]float32, [][]int32) {
	t.Helper()
	toks := make([][]int32, len(seqs))
	for i := range seqs {
		toks[i] = slices.Clone(prompts[i])
	}
	batch := make([]model.SeqInput, len(seqs))
	total := 0
	for i, s := range seqs {
		toks := prompts[i][s.Len():]
		batch[i] = model.SeqInput{Seq: s, Tokens: toks, NumLogits: len(toks)}
		total += len(toks)
	}
	logits := make([]float32, total*vocab)
	if err := e.Forward(batch, logits); err != nil {
		t.Fatal(err)
	}
	out := make([][]float32, len(seqs))
	off := 0
	for i, in := range batch {
		out[i] = slices.Clone(logits[off : off+in.NumLogits*vocab])
		off += in.NumLogits * vocab
	}
	for range steps {
		for i, s := range seqs {
			last := out[i][len(out[i])-vocab:]
			next := int32(slices.Index(last, slices.Max(last)))
			batch[i] = model.SeqInput{Seq: s, Tokens: []int32{next}, NumLogits: 1}
			toks[i] = append(toks[i], next)
		}
		step := make([]float32, len(seqs)*vocab)
		if err := e.Forward(batch, step); err != nil {
			t.Fatal(err)
		}
		for i := range seqs {
			out[i] = append(out[i], step[i*vocab:(i+1)*vocab]...)
		}
	}
	return out, toks
}

func bitwiseEqual(a, b []float32) int {
	if len(a) != len(b) {
		return 0
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i
		}
	}
	return -1
}

// TestCachedPrefixLogitsAreBitwiseEqual runs a prompt normally and releases
// it into the cache, then runs two prompts that share a long prefix with it
// (longer than the indexer's top-k, so the sparse path reads cached index
// keys) from the cached pages, batched together, and decodes a few tokens.
// Their logits must be bitwise equal to running each prompt alone on a pool
// with no cache. Under -race the pool panics if any write touched a shared
// page.
func TestCachedPrefixLogitsAreBitwiseEqual(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	vocab := m.Config.VocabSize
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, ps := range []int{1, 4, 16} {
			t.Run(fmt.Sprintf("%v/page%d", dt, ps), func(t *testing.T) {
				b := cpu.New(1)
				defer b.Close()
				rng := rand.New(rand.NewPCG(uint64(ps), 7))
				tok := func(n int) []int32 {
					out := make([]int32, n)
					for i := range out {
						out[i] = int32(rng.IntN(vocab))
					}
					return out
				}
				common := tok(45) // not a whole number of pages for ps 4 and 16
				a := append(slices.Clone(common), tok(9)...)
				var prompts [][]int32
				for range 2 {
					p := append(slices.Clone(common), tok(7)...)
					for p[len(common)] == a[len(common)] {
						p[len(common)] = int32(rng.IntN(vocab))
					}
					prompts = append(prompts, p)
				}

				pool, err := kvcache.NewPool(m.PoolConfig(ps, 1024/ps, 4, dt))
				if err != nil {
					t.Fatal(err)
				}
				e, err := m.NewExec(b, pool)
				if err != nil {
					t.Fatal(err)
				}
				c := prefix.New(pool)
				sa, err := pool.NewSeq(1)
				if err != nil {
					t.Fatal(err)
				}
				_, at := run(t, e, vocab, []*kvcache.Seq{sa}, [][]int32{a}, 3)
				if err := c.Finish(sa, at[0], nil); err != nil {
					t.Fatal(err)
				}
				if want := (len(a) + 3) / ps; c.Pages() != want {
					t.Fatalf("cache holds %d pages after the first request, want %d", c.Pages(), want)
				}

				var seqs []*kvcache.Seq
				var matched [][]int32
				for i, p := range prompts {
					pages, n := c.Match(p[:len(p)-1])
					if want := len(common) / ps * ps; n != want {
						t.Fatalf("prompt %d matched %d tokens, want %d", i, n, want)
					}
					s, err := pool.NewSeqWithPrefix(uint64(2+i), pages, n)
					if err != nil {
						t.Fatal(err)
					}
					seqs = append(seqs, s)
					matched = append(matched, pages)
				}
				shared := pool.TotalPages() - pool.FreePages()
				got, toks := run(t, e, vocab, seqs, prompts, 4)
				if err := c.Check(); err != nil {
					t.Fatal(err)
				}

				for i, p := range prompts {
					refPool, err := kvcache.NewPool(m.PoolConfig(ps, 1024/ps, 1, dt))
					if err != nil {
						t.Fatal(err)
					}
					re, err := m.NewExec(b, refPool)
					if err != nil {
						t.Fatal(err)
					}
					rs, err := refPool.NewSeq(1)
					if err != nil {
						t.Fatal(err)
					}
					wl, _ := run(t, re, vocab, []*kvcache.Seq{rs}, [][]int32{p}, 4)
					skip := (len(common) / ps * ps) * vocab // logits of the cached positions were not computed
					if d := bitwiseEqual(got[i], wl[0][skip:]); d != -1 {
						t.Fatalf("prompt %d: logits differ from the uncached run at float %d of %d", i, d, len(got[i]))
					}
				}
				if shared == 0 {
					t.Fatal("nothing allocated")
				}
				for i, s := range seqs {
					if err := c.Finish(s, toks[i], matched[i]); err != nil {
						t.Fatal(err)
					}
				}
				if err := c.Check(); err != nil {
					t.Fatal(err)
				}
				if err := pool.Check(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}
