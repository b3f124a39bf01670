package model_test

import (
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// BenchmarkForward runs the tiny llama-dsa model's forward pass over a batch
// of 4 sequences of 64 tokens of context (the indexer narrows each to its
// top-k), without gates: one decode token each, or a 16-token prefill chunk
// each. The pool is truncated back after every step.
func BenchmarkForward(b *testing.B) {
	for _, bc := range []struct {
		name string
		toks int
	}{{"decode", 1}, {"prefill16", 16}} {
		b.Run(bc.name, func(b *testing.B) {
			m := testmodel.Open(b, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 3, Type: kernels.F32})
			pool, err := kvcache.NewPool(m.PoolConfig(16, 64, 4, kernels.IndexBF16))
			if err != nil {
				b.Fatal(err)
			}
			e, err := m.NewExec(cpu.New(1), pool)
			if err != nil {
				b.Fatal(err)
			}
			prompts := testmodel.Prompts(5, 4, 64+bc.toks, 64+bc.toks, m.Config.VocabSize)
			batch := make([]model.SeqInput, len(prompts))
			for i, p := range prompts {
				s, err := pool.NewSeq(uint64(i + 1))
				if err != nil {
					b.Fatal(err)
				}
				if err := e.Forward([]model.SeqInput{{Seq: s, Tokens: p[:64]}}, nil); err != nil {
					b.Fatal(err)
				}
				batch[i] = model.SeqInput{Seq: s, Tokens: p[64:], NumLogits: 1}
			}
			logits := make([]float32, len(batch)*m.Config.VocabSize)
			b.ResetTimer()
			for range b.N {
				if err := e.Forward(batch, logits); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				for _, in := range batch {
					if err := pool.Truncate(in.Seq, 64); err != nil {
						b.Fatal(err)
					}
				}
				b.StartTimer()
			}
		})
	}
}
