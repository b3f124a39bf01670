package model_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/kernels"
)

// rewrite copies a built-in tiny model into a new file, letting edit change
// metadata and drop or replace tensors on the way.
func rewrite(t *testing.T, arch string, edit func(w *gguf.Writer, skip map[string]bool)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := os.WriteFile(path, rebuild(t, arch, 2, edit), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// rebuild is rewrite's copy as bytes, of the tiny model of seed.
func rebuild(t *testing.T, arch string, seed uint64, edit func(w *gguf.Writer, skip map[string]bool)) []byte {
	t.Helper()
	src, err := builtin.Build(builtin.Spec{Arch: arch, Size: builtin.SizeTiny, Seed: seed, Type: kernels.F32})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := src.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	f, err := gguf.Parse(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	w := gguf.NewWriter()
	for _, kv := range f.KVs {
		w.Add(kv.Key, kv.Value)
	}
	skip := map[string]bool{}
	edit(w, skip)
	for _, ti := range f.Tensors {
		if skip[ti.Name] {
			continue
		}
		data, err := f.TensorData(ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.AddTensor(ti.Name, ti.Type, ti.Shape, data); err != nil {
			t.Fatal(err)
		}
	}
	var out bytes.Buffer
	if _, err := w.WriteTo(&out); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

func TestLoadRefusesBadModels(t *testing.T) {
	cases := []struct {
		name, arch string
		edit       func(w *gguf.Writer, skip map[string]bool)
		want       string
	}{
		{"unknown arch", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("general.architecture", "mamba") }, `unsupported architecture "mamba"`},
		{"missing key", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("llama.block_count", "two") }, "missing metadata [llama.block_count]"},
		{"heads do not divide", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("llama.attention.head_count_kv", uint32(3)) }, "not a multiple of KV head count 3"},
		{"missing tensor", model.ArchLlama, func(_ *gguf.Writer, skip map[string]bool) { skip["blk.1.ffn_up.weight"] = true }, `tensor "blk.1.ffn_up.weight" is missing`},
		{"missing indexer tensor", model.ArchLlamaDSA, func(_ *gguf.Writer, skip map[string]bool) { skip["blk.0.indexer.proj.weight"] = true }, `tensor "blk.0.indexer.proj.weight" is missing`},
		{"missing indexer key", model.ArchLlamaDSA, func(w *gguf.Writer, _ map[string]bool) { w.Add("llama-dsa.indexer.top_k", "many") }, "llama-dsa.indexer.top_k"},
		{"wrong shape", model.ArchLlama, func(w *gguf.Writer, skip map[string]bool) {
			skip["blk.0.attn_q.weight"] = true
			_ = w.AddTensor("blk.0.attn_q.weight", gguf.TypeF32, []uint64{32, 64}, make([]byte, 32*64*4))
		}, `tensor "blk.0.attn_q.weight" has shape [32 64], want [64 64]`},
		{"unsupported type", model.ArchLlama, func(w *gguf.Writer, skip map[string]bool) {
			skip["blk.0.attn_k.weight"] = true
			_ = w.AddTensor("blk.0.attn_k.weight", gguf.TypeQ4_0, []uint64{64, 32}, make([]byte, 2*32*18))
		}, "Q4_0 is not supported"},
		{"moe", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("llama.expert_count", uint32(8)) }, "mixture-of-experts (8 experts) is not supported"},
		{"rope scaling", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("llama.rope.scaling.type", "yarn") }, `RoPE scaling "yarn" is not supported`},
		{"rope freqs", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) {
			_ = w.AddTensor("rope_freqs.weight", gguf.TypeF32, []uint64{8}, make([]byte, 32))
		}, "rope_freqs.weight"},
		{"tokenizer size", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("llama.vocab_size", uint32(600)) }, "model vocab is 600"},
		{"no tokenizer", model.ArchLlama, func(w *gguf.Writer, _ map[string]bool) { w.Add("tokenizer.ggml.model", "bert") }, "bert"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := rewrite(t, c.arch, c.edit)
			m, err := model.Open(path)
			if err == nil {
				m.Close()
				t.Fatal("loaded")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q does not say %q", err, c.want)
			}
		})
	}
}

func TestLoadBuiltinTypes(t *testing.T) {
	for _, arch := range []string{model.ArchLlama, model.ArchLlamaDSA} {
		for _, typ := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16, kernels.Q8_0} {
			path := filepath.Join(t.TempDir(), "m.gguf")
			if err := builtin.WriteFile(path, builtin.Spec{Arch: arch, Size: builtin.SizeTiny, Seed: 1, Type: typ}); err != nil {
				t.Fatal(err)
			}
			m, err := model.Open(path)
			if err != nil {
				t.Fatalf("%s %v: %v", arch, typ, err)
			}
			want, _ := builtin.Shape(arch, builtin.SizeTiny)
			got := m.Config
			if got.Arch != arch || got.Dim != want.Dim || got.Layers != want.Layers || got.VocabSize != want.VocabSize ||
				(got.Indexer == nil) != (want.Indexer == nil) || m.Layers[0].Q.DType != typ || got.TiedOutput != want.TiedOutput {
				t.Errorf("%s %v: loaded config %+v, weights %v", arch, typ, got, m.Layers[0].Q.DType)
			}
			m.Close()
		}
	}
}
