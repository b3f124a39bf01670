package model_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// llamaCppGolden is testdata/llamacpp-deepseek2.json: greedy tokens that
// llama.cpp generated from built-in deepseek2 files (every layer dense, no
// indexer), each prompt evaluated as one batch and then one token at a
// time, argmax with ties to the lowest id, EOS ignored. How they were made
// is in the file's "source".
type llamaCppGolden struct {
	Source string `json:"source"`
	Cases  []struct {
		Arch   string  `json:"arch"`
		Size   string  `json:"size"`
		Type   string  `json:"type"`
		Seed   uint64  `json:"seed"`
		KV     string  `json:"kv"` // llama.cpp's cache type: f32 or f16
		Prompt []int32 `json:"prompt"`
		Tokens []int32 `json:"tokens"`
	} `json:"cases"`
}

// TestDeepSeek2MatchesLlamaCpp: pdkit's latent attention, run on the same
// built-in deepseek2 file llama.cpp ran, generates llama.cpp's greedy
// tokens, with the KV stored in the type llama.cpp's cache had.
func TestDeepSeek2MatchesLlamaCpp(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "llamacpp-deepseek2.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g llamaCppGolden
	if err := json.Unmarshal(raw, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Cases) == 0 {
		t.Fatal("no golden cases")
	}
	models := map[string]*model.Model{}
	for _, c := range g.Cases {
		typ, err := builtin.ParseType(c.Type)
		if err != nil {
			t.Fatal(err)
		}
		spec := builtin.Spec{Arch: c.Arch, Size: c.Size, Seed: c.Seed, Type: typ}
		m := models[spec.FileName()]
		if m == nil {
			path := filepath.Join(t.TempDir(), spec.FileName())
			if err := builtin.WriteFile(path, spec); err != nil {
				t.Fatal(err)
			}
			if m, err = model.Open(path); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			models[spec.FileName()] = m
		}
		kv, err := kernels.ParseKVType(c.KV)
		if err != nil {
			t.Fatal(err)
		}
		got := greedyTokens(t, m, kv, c.Prompt, len(c.Tokens))
		if !slices.Equal(got, c.Tokens) {
			t.Errorf("%s, KV %s, prompt %v:\npdkit     %v\nllama.cpp %v", spec.FileName(), c.KV, c.Prompt, got, c.Tokens)
		}
	}
}

// greedyTokens prefills prompt in one step on m and generates n tokens
// greedily, one step each.
func greedyTokens(t *testing.T, m *model.Model, kv kernels.DType, prompt []int32, n int) []int32 {
	t.Helper()
	const page = 16
	pc := m.PoolConfig(page, (len(prompt)+n)/page+1, 1, kernels.IndexFP8)
	pc.KVType = kv
	e, pool := execOn(t, m, pc)
	seq, err := pool.NewSeq(0)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Release(seq)
	v := m.Config.VocabSize
	logits := make([]float32, v)
	in := prompt
	var out []int32
	for len(out) < n {
		if err := e.Forward([]model.SeqInput{{Seq: seq, Tokens: in, NumLogits: 1}}, logits); err != nil {
			t.Fatal(err)
		}
		best := 0
		for i, x := range logits {
			if x > logits[best] {
				best = i
			}
		}
		out = append(out, int32(best))
		in = []int32{int32(best)}
	}
	return out
}

// execOn is an Exec of m on one-thread cpu kernels over a new pool of pc.
func execOn(t *testing.T, m *model.Model, pc kvcache.Config) (*model.Exec, *kvcache.Pool) {
	t.Helper()
	pool, err := kvcache.NewPool(pc)
	if err != nil {
		t.Fatal(err)
	}
	e, err := m.NewExec(cpu.New(1), pool)
	if err != nil {
		t.Fatal(err)
	}
	return e, pool
}
