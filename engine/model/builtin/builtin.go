// Package builtin generates pdkit's built-in models: llama- and
// DeepSeek-shaped GGUF files whose weights come deterministically from a
// seed, so that a fresh machine can run, test and benchmark the whole system
// with nothing to download. The weights are random, so the text is
// meaningless, but every code path (GGUF, tokenizer, forward pass, latent
// attention, indexer, KV, sampling) is the real one, and the variants
// without an indexer (llama, deepseek2) load in llama.cpp.
package builtin

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/tokenizer"
	"github.com/pdkit/pdkit/kernels"
)

// Sizes of built-in models.
const (
	SizeTiny  = "tiny"  // for tests: generated in milliseconds
	SizeSmall = "small" // the shape of llama2.c's stories15M plus the indexer: demo and benchmarks
	// SizeMedium is the shape of llama2.c's stories110M plus the indexer:
	// weights far beyond the caches, so decode is bandwidth-bound.
	SizeMedium = "medium"
)

// Sizes lists the built-in sizes, smallest first.
var Sizes = []string{SizeTiny, SizeSmall, SizeMedium}

// DefaultSeed is the seed of the default model.
const DefaultSeed = 1

// Spec names one built-in model.
type Spec struct {
	Arch string // one of model.Archs
	Size string // one of Sizes
	Seed uint64
	Type kernels.DType // weight type of the matrices (norms stay F32)
}

// Default is the model a command uses when none is given.
func Default() Spec {
	return Spec{Arch: model.ArchLlamaDSA, Size: SizeSmall, Seed: DefaultSeed, Type: kernels.F32}
}

// Shape returns the configuration of a built-in model.
func Shape(arch, size string) (model.Config, error) {
	var c model.Config
	switch size {
	case SizeTiny:
		// 8 query heads over 4 KV heads: grouped-query attention that
		// shards over TP = 1, 2 and 4.
		c = model.Config{VocabSize: 512, Dim: 64, Layers: 2, Hidden: 128, Heads: 8, KVHeads: 4, HeadDim: 8, ContextLen: 512}
		c.Indexer = &model.IndexerConfig{Heads: 2, Dim: 16, TopK: 8}
	case SizeSmall:
		c = model.Config{VocabSize: 32000, Dim: 288, Layers: 6, Hidden: 768, Heads: 6, KVHeads: 6, HeadDim: 48, ContextLen: 2048, TiedOutput: true}
		c.Indexer = &model.IndexerConfig{Heads: 4, Dim: 32, TopK: 128}
	case SizeMedium:
		// stories110M ties the output to the embedding as stories15M does.
		c = model.Config{VocabSize: 32000, Dim: 768, Layers: 12, Hidden: 2048, Heads: 12, KVHeads: 12, HeadDim: 64, ContextLen: 2048, TiedOutput: true}
		c.Indexer = &model.IndexerConfig{Heads: 8, Dim: 64, TopK: 256}
	default:
		return c, fmt.Errorf("builtin: unknown size %q (want %s)", size, SizeList())
	}
	c.Arch = arch
	c.RopeDim = c.HeadDim
	c.RopeTheta = 10000
	c.NormEps = 1e-5
	if !slices.Contains(model.Archs, arch) {
		return c, fmt.Errorf("builtin: unknown architecture %q (want %s)", arch, model.ArchList())
	}
	if model.IsMLA(arch) {
		deepSeekShape(&c, size)
	}
	if !model.HasIndexer(arch) {
		c.Indexer = nil
	}
	return c, c.Validate()
}

// deepSeekShape turns the llama shape c of size into its DeepSeek-shaped
// sibling: the same width, depth, feed-forward and vocabulary, with
// multi-head latent attention in DeepSeek-V2/V3's proportions (a latent of
// eight times the RoPE key, a position-free query/key part of twice it)
// and DeepSeek-V3.2's index keys (128 dims against a 512+64 latent row).
// medium has DeepSeek-V3's very attention sizes (latent 512, RoPE 64,
// position-free 128, value 128, index keys 128); small and tiny scale them
// down, tiny keeping each matrix's columns a multiple of 32 (Q8_0 blocks).
func deepSeekShape(c *model.Config, size string) {
	var rope, nope, rank, vdim, heads int
	switch size {
	case SizeTiny:
		heads, rope, nope, rank, vdim = 4, 8, 32, 64, 32
		c.Indexer = &model.IndexerConfig{Heads: 2, Dim: 16, TopK: 8}
	case SizeSmall:
		heads, rope, nope, rank, vdim = 6, 32, 64, 256, 64
		c.Indexer = &model.IndexerConfig{Heads: 4, Dim: 64, TopK: 128}
	default: // SizeMedium
		heads, rope, nope, rank, vdim = 12, 64, 128, 512, 128
		c.Indexer = &model.IndexerConfig{Heads: 8, Dim: 128, TopK: 256}
	}
	c.Heads, c.KVHeads, c.RopeDim, c.HeadDim = heads, 1, rope, nope+rope
	c.MLA = &model.MLAConfig{KVRank: rank, NopeDim: nope, VDim: vdim}
}

// SizeList names the sizes for messages and help: "tiny, small or medium".
func SizeList() string {
	n := len(Sizes)
	return strings.Join(Sizes[:n-1], ", ") + " or " + Sizes[n-1]
}

// Version numbers the generator: it is part of the cache file name, so a
// change to how weights or vocabulary are generated never reuses a file an
// older generator wrote. Bump it whenever Build's output changes.
const Version = 3

// FileName is the cache file name of a spec.
func (s Spec) FileName() string {
	return fmt.Sprintf("builtin-v%d-%s-%s-%s-seed%d.gguf", Version, s.Arch, s.Size, typeName(s.Type), s.Seed)
}

// Name is the model's general.name, also the model id the server reports.
func (s Spec) Name() string {
	return fmt.Sprintf("pdkit-builtin-%s-%s-seed%d", s.Arch, s.Size, s.Seed)
}

func typeName(t kernels.DType) string {
	switch t {
	case kernels.F32:
		return "f32"
	case kernels.F16:
		return "f16"
	case kernels.BF16:
		return "bf16"
	case kernels.Q8_0:
		return "q8_0"
	}
	return t.String()
}

// ParseType reads a weight type name: f32, f16, bf16 or q8_0.
func ParseType(s string) (kernels.DType, error) {
	for _, t := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16, kernels.Q8_0} {
		if typeName(t) == s {
			return t, nil
		}
	}
	return 0, fmt.Errorf("weight type %q: want f32, f16, bf16 or q8_0", s)
}

// ggml file types (general.file_type) for the weight types we write.
func fileType(t kernels.DType) uint32 {
	switch t {
	case kernels.F16:
		return 1
	case kernels.Q8_0:
		return 7
	case kernels.BF16:
		return 32
	}
	return 0
}

func ggufType(t kernels.DType) gguf.Type {
	switch t {
	case kernels.F16:
		return gguf.TypeF16
	case kernels.BF16:
		return gguf.TypeBF16
	case kernels.Q8_0:
		return gguf.TypeQ8_0
	}
	return gguf.TypeF32
}

// Build generates the model described by s as a GGUF writer. The writer
// holds each tensor's encoded bytes once (it does not copy them), so a model
// costs its file size in memory plus the largest tensor as F32 while it is
// drawn.
func Build(s Spec) (*gguf.Writer, error) {
	c, err := Shape(s.Arch, s.Size)
	if err != nil {
		return nil, err
	}
	if _, err := kernels.RowBytes(s.Type, c.Dim); err != nil {
		return nil, fmt.Errorf("builtin: %w", err)
	}
	w, err := newWriter(s, c)
	if err != nil {
		return nil, err
	}
	g := &gen{rng: rand.New(rand.NewPCG(s.Seed, 0x9e3779b97f4a7c15)), w: w, typ: s.Type}
	for _, t := range tensors(c) {
		g.draw(t)
	}
	if g.err != nil {
		return nil, g.err
	}
	return w, nil
}

// newWriter starts the file of s: its metadata, named as llama.cpp's
// converters name them, so the llama variant loads there.
func newWriter(s Spec, c model.Config) (*gguf.Writer, error) {
	vocab, err := tokenizer.BuiltinVocab(c.VocabSize)
	if err != nil {
		return nil, err
	}
	w := gguf.NewWriter()
	a := c.Arch
	w.Add("general.architecture", a)
	w.Add("general.name", s.Name())
	w.Add("general.file_type", fileType(s.Type))
	w.Add(a+".vocab_size", uint32(c.VocabSize))
	w.Add(a+".context_length", uint32(c.ContextLen))
	w.Add(a+".embedding_length", uint32(c.Dim))
	w.Add(a+".block_count", uint32(c.Layers))
	w.Add(a+".feed_forward_length", uint32(c.Hidden))
	w.Add(a+".attention.head_count", uint32(c.Heads))
	w.Add(a+".attention.head_count_kv", uint32(c.KVHeads))
	w.Add(a+".attention.layer_norm_rms_epsilon", c.NormEps)
	w.Add(a+".rope.dimension_count", uint32(c.RopeDim))
	w.Add(a+".rope.freq_base", c.RopeTheta)
	if ml := c.MLA; ml != nil {
		// llama.cpp's deepseek2 keys for the absorbed form: the cache row
		// is one KV head whose key is the latent plus the RoPE key and
		// whose value is the latent; every block is dense.
		w.Add(a+".attention.key_length", uint32(c.KVDim()))
		w.Add(a+".attention.value_length", uint32(ml.KVRank))
		w.Add(a+".attention.key_length_mla", uint32(c.HeadDim))
		w.Add(a+".attention.value_length_mla", uint32(ml.VDim))
		w.Add(a+".attention.kv_lora_rank", uint32(ml.KVRank))
		w.Add(a+".attention.q_lora_rank", uint32(0))
		w.Add(a+".leading_dense_block_count", uint32(c.Layers))
		w.Add(a+".expert_count", uint32(0))
		w.Add(a+".expert_used_count", uint32(0))
		w.Add(a+".expert_shared_count", uint32(0))
		w.Add(a+".expert_feed_forward_length", uint32(0))
		w.Add(a+".expert_weights_scale", float32(1))
	}
	if ix := c.Indexer; ix != nil {
		w.Add(a+".indexer.head_count", uint32(ix.Heads))
		w.Add(a+".indexer.key_length", uint32(ix.Dim))
		w.Add(a+".indexer.top_k", uint32(ix.TopK))
	}
	w.Add("tokenizer.ggml.model", vocab.Model)
	w.Add("tokenizer.ggml.tokens", vocab.Tokens)
	w.Add("tokenizer.ggml.scores", vocab.Scores)
	w.Add("tokenizer.ggml.token_type", vocab.Types)
	w.Add("tokenizer.ggml.bos_token_id", uint32(vocab.BOS))
	w.Add("tokenizer.ggml.eos_token_id", uint32(vocab.EOS))
	w.Add("tokenizer.ggml.unknown_token_id", uint32(vocab.UNK))
	w.Add("tokenizer.ggml.add_bos_token", true)
	w.Add("tokenizer.ggml.add_space_prefix", true)
	return w, nil
}

// tensorKind says how a tensor's values are drawn.
type tensorKind int

const (
	normWeight tensorKind = iota // F32 vector near 1
	embedding                    // rows of equal norm
	projection                   // N(0, std²), in the spec's weight type
)

// tensorPlan is one tensor of a model: what Build draws, in file order.
type tensorPlan struct {
	name       string
	kind       tensorKind
	rows, cols int // a vector has one row
	heads      int // > 1: a stack of heads matrices of rows/heads rows each (GGUF ne [cols, rows/heads, heads])
	std        float64
}

// tensors lists the tensors of a model of shape c in the order Build writes
// them (the order fixes the random stream, so it must not change without a
// Version bump).
//
// Variance-preserving init: projections draw from N(0, 1/fan_in); the
// projections that write into the residual stream are scaled down by the
// depth so activations stay bounded across layers.
func tensors(c model.Config) []tensorPlan {
	resid := 1 / math.Sqrt(2*float64(c.Layers))
	in := 1 / math.Sqrt(float64(c.Dim))
	vecN := func(name string, n int) tensorPlan { return tensorPlan{name: name, kind: normWeight, rows: 1, cols: n} }
	vec := func(name string) tensorPlan { return vecN(name, c.Dim) }
	proj := func(name string, rows, cols int, std float64) tensorPlan {
		return tensorPlan{name: name, kind: projection, rows: rows, cols: cols, std: std}
	}
	ts := []tensorPlan{
		{name: "token_embd.weight", kind: embedding, rows: c.VocabSize, cols: c.Dim, std: 0.02},
		vec("output_norm.weight"),
	}
	if !c.TiedOutput {
		ts = append(ts, proj("output.weight", c.VocabSize, c.Dim, in))
	}
	for l := range c.Layers {
		p := fmt.Sprintf("blk.%d.", l)
		ts = append(ts, vec(p+"attn_norm.weight"), proj(p+"attn_q.weight", c.QDim(), c.Dim, in))
		if ml := c.MLA; ml != nil {
			heads := func(name string, rows, cols int) tensorPlan {
				return tensorPlan{name: name, kind: projection, rows: c.Heads * rows, cols: cols, heads: c.Heads, std: 1 / math.Sqrt(float64(cols))}
			}
			ts = append(ts,
				proj(p+"attn_kv_a_mqa.weight", c.KVDim(), c.Dim, in),
				vecN(p+"attn_kv_a_norm.weight", ml.KVRank),
				heads(p+"attn_k_b.weight", ml.KVRank, ml.NopeDim),
				heads(p+"attn_v_b.weight", ml.VDim, ml.KVRank),
			)
		} else {
			ts = append(ts,
				proj(p+"attn_k.weight", c.KVDim(), c.Dim, in),
				proj(p+"attn_v.weight", c.KVDim(), c.Dim, in),
			)
		}
		ts = append(ts,
			proj(p+"attn_output.weight", c.Dim, c.AttnOutDim(), resid/math.Sqrt(float64(c.AttnOutDim()))),
			vec(p+"ffn_norm.weight"),
			proj(p+"ffn_gate.weight", c.Hidden, c.Dim, in),
			proj(p+"ffn_up.weight", c.Hidden, c.Dim, in),
			proj(p+"ffn_down.weight", c.Dim, c.Hidden, resid/math.Sqrt(float64(c.Hidden))),
		)
		if ix := c.Indexer; ix != nil {
			ts = append(ts,
				proj(p+"indexer.attn_q.weight", ix.Heads*ix.Dim, c.Dim, in),
				proj(p+"indexer.attn_k.weight", ix.Dim, c.Dim, in),
				proj(p+"indexer.proj.weight", ix.Heads, c.Dim, in),
			)
		}
	}
	return ts
}

// WriteFile generates s into path (atomically).
func WriteFile(path string, s Spec) error {
	w, err := Build(s)
	if err != nil {
		return err
	}
	return w.WriteFile(path)
}

// Ensure returns the path of s in the cache folder dir, generating it on
// first use, and anew when the cached file is damaged (a truncated copy, a
// disk that filled while it was written): the cache is pdkit's own, so a
// file that does not parse as a whole GGUF (gguf.Open checks that every
// tensor's data lies inside it, touching none) is replaced; Repaired
// reports why. Concurrent callers are safe: the file appears by rename.
func Ensure(dir string, s Spec) (string, error) {
	path, _, err := EnsureRepaired(dir, s)
	return path, err
}

// EnsureRepaired is Ensure, and says why it replaced a damaged cached file
// (nil when the file was sound or new).
func EnsureRepaired(dir string, s Spec) (path string, repaired error, err error) {
	path = filepath.Join(dir, s.FileName())
	if _, serr := os.Stat(path); serr == nil {
		f, oerr := gguf.Open(path)
		if oerr == nil {
			f.Close()
			return path, nil, nil
		}
		repaired = oerr
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", repaired, fmt.Errorf("builtin: cache folder: %w", err)
	}
	if err := WriteFile(path, s); err != nil {
		return "", repaired, err
	}
	return path, repaired, nil
}

// Home is the cache folder: $PDKIT_HOME, else ~/.cache/pdkit.
func Home() (string, error) {
	if h := os.Getenv("PDKIT_HOME"); h != "" {
		return h, nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("no cache folder (set PDKIT_HOME): %w", err)
	}
	return filepath.Join(d, "pdkit"), nil
}

type gen struct {
	rng *rand.Rand
	w   *gguf.Writer
	typ kernels.DType
	err error
}

// draw generates one planned tensor and adds it to the writer.
func (g *gen) draw(t tensorPlan) {
	switch t.kind {
	case normWeight:
		g.vector(t.name, t.cols)
	case embedding:
		g.embedding(t.name, t.rows, t.cols, t.std)
	default:
		g.matrix(t.name, t.rows, t.cols, t.heads, t.std)
	}
}

func (g *gen) normals(n int, std float64) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(g.rng.NormFloat64() * std)
	}
	return out
}

// vector writes a norm weight: F32 as llama.cpp expects, near 1.
func (g *gen) vector(name string, n int) {
	v := g.normals(n, 0.05)
	for i := range v {
		v[i] += 1
	}
	g.add(name, gguf.TypeF32, []uint64{uint64(n)}, f32le(v))
}

// embedding writes token embeddings whose rows all have the same norm. With
// random rows of unequal norm, the few longest win the (tied) output
// projection for almost any hidden state, and greedy decoding of a random
// model collapses onto them; equal norms spread the argmax over the vocab.
func (g *gen) embedding(name string, rows, cols int, std float64) {
	v := g.normals(rows*cols, std)
	want := std * math.Sqrt(float64(cols))
	for r := range rows {
		row := v[r*cols : (r+1)*cols]
		var ss float64
		for _, x := range row {
			ss += float64(x) * float64(x)
		}
		if ss > 0 {
			k := float32(want / math.Sqrt(ss))
			for i := range row {
				row[i] *= k
			}
		}
	}
	g.encode(name, rows, cols, v)
}

func (g *gen) matrix(name string, rows, cols, heads int, std float64) {
	g.encodeHeads(name, rows, cols, heads, g.normals(rows*cols, std))
}

// encode stores a rows×cols f32 matrix in the spec's weight type.
func (g *gen) encode(name string, rows, cols int, v []float32) {
	g.encodeHeads(name, rows, cols, 1, v)
}

// encodeHeads is encode for a stack of heads matrices of rows/heads rows.
func (g *gen) encodeHeads(name string, rows, cols, heads int, v []float32) {
	rb, err := kernels.RowBytes(g.typ, cols)
	if err != nil {
		g.err = err
		return
	}
	data := make([]byte, rb*rows)
	for r := range rows {
		src, dst := v[r*cols:(r+1)*cols], data[r*rb:(r+1)*rb]
		switch g.typ {
		case kernels.F32:
			for i, x := range src {
				binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(x))
			}
		case kernels.F16:
			for i, x := range src {
				binary.LittleEndian.PutUint16(dst[2*i:], kernels.F32ToF16(x))
			}
		case kernels.BF16:
			for i, x := range src {
				binary.LittleEndian.PutUint16(dst[2*i:], kernels.F32ToBF16(x))
			}
		case kernels.Q8_0:
			kernels.QuantizeQ8Row(dst, src)
		}
	}
	shape := []uint64{uint64(cols), uint64(rows)}
	if heads > 1 {
		shape = []uint64{uint64(cols), uint64(rows / heads), uint64(heads)}
	}
	g.add(name, ggufType(g.typ), shape, data)
}

func (g *gen) add(name string, t gguf.Type, shape []uint64, data []byte) {
	if g.err == nil {
		g.err = g.w.AddTensor(name, t, shape, data)
	}
}

func f32le(v []float32) []byte {
	out := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(x))
	}
	return out
}
