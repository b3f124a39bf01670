package model_test

import (
	"bytes"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/kernels"
)

// hostileFile is one file of the corpus: a built-in tiny model with its
// metadata, tensors or bytes changed the way a hostile file would.
type hostileFile struct {
	name string
	arch string
	kv   map[string]any // metadata to set
	skip []string       // tensors to leave out
	cut  func(int) int  // truncate the file to cut(its length) bytes
	want string         // the error must say this
}

// build writes h's file to bytes.
func (h hostileFile) build(t *testing.T) []byte {
	t.Helper()
	b := rebuild(t, h.arch, 3, func(w *gguf.Writer, skip map[string]bool) {
		for k, v := range h.kv {
			w.Add(k, v)
		}
		for _, name := range h.skip {
			skip[name] = true
		}
	})
	if h.cut != nil {
		b = b[:h.cut(len(b))]
	}
	return b
}

// hostileCorpus is the corpus: counts and dimensions out of every range,
// non-finite hyper-parameters, tokenizer vocabularies that lie, missing
// tensors and truncations at every section.
func hostileCorpus() []hostileFile {
	var out []hostileFile
	big := []struct {
		v    any
		what string
	}{{uint32(0), "0"}, {uint32(math.MaxUint32), "2^32-1"}, {uint64(1) << 31, "2^31"}, {uint64(1) << 62, "2^62"}}
	for _, key := range []string{"block_count", "embedding_length", "feed_forward_length", "attention.head_count",
		"attention.head_count_kv", "context_length", "attention.key_length", "rope.dimension_count"} {
		for _, b := range big {
			out = append(out, hostileFile{name: key + "=" + b.what, arch: model.ArchLlama, kv: map[string]any{"llama." + key: b.v}})
		}
	}
	for _, key := range []string{"indexer.head_count", "indexer.key_length", "indexer.top_k"} {
		for _, b := range big[:3] {
			out = append(out, hostileFile{name: key + "=" + b.what, arch: model.ArchLlamaDSA, kv: map[string]any{"llama-dsa." + key: b.v}})
		}
	}
	for _, f := range []struct {
		key  string
		v    float32
		what string
	}{{"rope.freq_base", float32(math.NaN()), "NaN"}, {"rope.freq_base", float32(math.Inf(1)), "+Inf"}, {"rope.freq_base", -1, "-1"},
		{"attention.layer_norm_rms_epsilon", float32(math.NaN()), "NaN"}, {"attention.layer_norm_rms_epsilon", float32(math.Inf(1)), "+Inf"},
		{"attention.layer_norm_rms_epsilon", 0, "0"}} {
		out = append(out, hostileFile{name: f.key + "=" + f.what, arch: model.ArchLlama, kv: map[string]any{"llama." + f.key: f.v}})
	}
	tok := []hostileFile{
		{name: "no tokens", kv: map[string]any{"tokenizer.ggml.tokens": []string{}}},
		{name: "one token short", kv: map[string]any{"tokenizer.ggml.tokens": make([]string, 511)}},
		{name: "scores of another length", kv: map[string]any{"tokenizer.ggml.scores": []float32{1, 2, 3}}},
		{name: "token types of another length", kv: map[string]any{"tokenizer.ggml.token_type": []int32{1}}},
		{name: "NaN scores", kv: map[string]any{"tokenizer.ggml.scores": nanScores(512)}},
		{name: "tokenizer model unknown", kv: map[string]any{"tokenizer.ggml.model": "wordpiece"}},
		{name: "tokens not strings", kv: map[string]any{"tokenizer.ggml.tokens": []int32{1, 2, 3}}},
		{name: "merges of unknown tokens", kv: map[string]any{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": []string{"zz qq", "a"}}},
	}
	for _, h := range tok {
		h.arch = model.ArchLlama
		out = append(out, h)
	}
	for _, v := range big[1:] {
		out = append(out, hostileFile{name: "vocab_size=" + v.what, arch: model.ArchLlama, kv: map[string]any{"llama.vocab_size": v.v}})
	}
	for _, name := range []string{"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"} {
		out = append(out, hostileFile{name: "without " + name, arch: model.ArchLlama, skip: []string{name}, want: "missing"})
	}
	for _, frac := range []struct {
		what string
		cut  func(int) int
	}{{"the magic", func(int) int { return 3 }}, {"the header", func(int) int { return 20 }}, {"the metadata", func(int) int { return 200 }},
		{"the tokenizer", func(int) int { return 4000 }}, {"the tensor table", func(n int) int { return n / 3 }},
		{"the data", func(n int) int { return n - 1000 }}, {"the last byte", func(n int) int { return n - 1 }}} {
		out = append(out, hostileFile{name: "cut in " + frac.what, arch: model.ArchLlama, cut: frac.cut})
	}
	return out
}

func nanScores(n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(math.NaN())
	}
	return s
}

// Every file of the corpus is refused with a clear error (never a crash
// or a hang) and loading it allocates little: its allocations stay under
// 64 MiB plus four times its size, where the first hostile round's
// block_count = 2^31 asked for 400 GB. The time each took is logged.
func TestHostileModelFilesAreRefused(t *testing.T) {
	corpus := hostileCorpus()
	if len(corpus) < 50 {
		t.Fatalf("the corpus has %d files, want at least 50", len(corpus))
	}
	var slowest time.Duration
	for _, h := range corpus {
		data := h.build(t)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		done := make(chan error, 1)
		go func() {
			f, err := gguf.Parse(data)
			if err == nil {
				var m *model.Model
				if m, err = model.Load(f); err == nil {
					m.Close()
				}
			}
			done <- err
		}()
		var err error
		select {
		case err = <-done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("%s: loading did not end within 2 minutes", h.name)
		}
		took := time.Since(start)
		slowest = max(slowest, took)
		runtime.ReadMemStats(&after)
		alloc := after.TotalAlloc - before.TotalAlloc
		t.Logf("%-45s %8.2f ms %8d KiB allocated: %v", h.name, took.Seconds()*1000, alloc>>10, err)
		switch {
		case err == nil:
			t.Errorf("%s: loaded", h.name)
		case h.want != "" && !strings.Contains(err.Error(), h.want):
			t.Errorf("%s: %v, want it to say %q", h.name, err, h.want)
		case !strings.HasPrefix(err.Error(), "model: ") && !strings.HasPrefix(err.Error(), "gguf: ") && !strings.HasPrefix(err.Error(), "tokenizer: "):
			t.Errorf("%s: %v: an error that does not say which part refused", h.name, err)
		}
		if limit := uint64(64<<20 + 4*len(data)); alloc > limit {
			t.Errorf("%s: %d bytes allocated, more than %d", h.name, alloc, limit)
		}
	}
	t.Logf("%d hostile files, the slowest refused in %v", len(corpus), slowest)
}

// FuzzLoad checks that loading any bytes as a model never panics and
// that what it refuses it refuses with an error of the part that refused.
// `make test` runs it for a few seconds; run it longer with
//
//	go test -run XXX -fuzz FuzzLoad -fuzztime 10m ./engine/model
func FuzzLoad(f *testing.F) {
	src, err := builtin.Build(builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 3, Type: kernels.Q8_0})
	if err != nil {
		f.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := src.WriteTo(&buf); err != nil {
		f.Fatal(err)
	}
	f.Add(buf.Bytes())
	f.Add(buf.Bytes()[:buf.Len()/2])
	f.Fuzz(func(t *testing.T, data []byte) {
		g, err := gguf.Parse(data)
		if err != nil {
			return
		}
		m, err := model.Load(g)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "model: ") && !strings.HasPrefix(err.Error(), "tokenizer: ") && !strings.HasPrefix(err.Error(), "gguf: ") {
				t.Fatalf("error of no part: %v", err)
			}
			return
		}
		m.Close()
	})
}
