package model_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// TestGreedyChunksMatchLogits checks the output projection run in
// vocabulary chunks (greedy.go) against the whole projection: the same
// logits bit for bit, and for every row the greedy choice sample.Greedy
// makes from them, with chunks of several widths (a chunk boundary inside
// the vocabulary, the last chunk shorter) and every weight type.
func TestGreedyChunksMatchLogits(t *testing.T) {
	for _, typ := range refTypes {
		t.Run(typ.String(), func(t *testing.T) {
			m, _ := refModel(t, model.ArchLlama, typ)
			v := m.Config.VocabSize
			tokens := refTokenSeq(refTokens, v, refTokSeed)
			run := func(chunkBytes int) ([]float32, []int32) {
				pool, err := kvcache.NewPool(m.PoolConfig(16, 4, 1, kernels.IndexFP8))
				if err != nil {
					t.Fatal(err)
				}
				e, err := m.NewExec(cpu.New(2), pool)
				if err != nil {
					t.Fatal(err)
				}
				e.SetGreedyChunkBytes(chunkBytes)
				seq, err := pool.NewSeq(0)
				if err != nil {
					t.Fatal(err)
				}
				out := make([]float32, len(tokens)*v)
				if err := e.Forward([]model.SeqInput{{Seq: seq, Tokens: tokens, NumLogits: len(tokens)}}, out); err != nil {
					t.Fatal(err)
				}
				return out, slices.Clone(e.Greedy())
			}
			whole, wholeGreedy := run(1 << 30)
			for i := range len(tokens) {
				if got, want := wholeGreedy[i], sample.Greedy(whole[i*v:(i+1)*v]); got != want {
					t.Fatalf("unchunked: row %d: greedy %d, sample.Greedy %d", i, got, want)
				}
			}
			for _, bound := range []int{4 * len(tokens) * 64, 4 * len(tokens) * 128, 4 * len(tokens) * 300} {
				t.Run(fmt.Sprint(bound), func(t *testing.T) {
					got, greedy := run(bound)
					if !slices.Equal(got, whole) {
						t.Fatal("chunked logits differ from the whole projection's")
					}
					if !slices.Equal(greedy, wholeGreedy) {
						t.Fatalf("chunked greedy %v, want %v", greedy, wholeGreedy)
					}
				})
			}
		})
	}
}
