package model

import (
	"errors"
	"fmt"
	"slices"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/tokenizer"
	"github.com/pdkit/pdkit/kernels"
)

// Model is a loaded model: configuration, tokenizer and weights. Weight
// matrices point into the GGUF mapping, so the file must stay open while the
// model is in use. A Model is immutable and safe for concurrent readers.
type Model struct {
	Config    Config
	Tokenizer tokenizer.Tokenizer
	// Name is general.name when the file has one.
	Name string

	TokenEmbd  *kernels.Matrix // vocab × dim
	OutputNorm []float32
	Output     *kernels.Matrix // vocab × dim (TokenEmbd when tied)
	Layers     []Layer

	file  *gguf.File
	watch *fileWatch // the file loaded from and its fingerprint; nil from Load alone
}

// Layer is one transformer block's weights.
type Layer struct {
	AttnNorm   []float32
	Q, K, V, O *kernels.Matrix // K and V: the llama architectures only
	// The latent attention's (the MLA architectures only): the latent and
	// RoPE key projection (attn_kv_a_mqa), the latent's norm, and per head
	// the latent's key and value expansions, head after head: KB is
	// Heads·KVRank × NopeDim (absorbed into the query), VB Heads·VDim ×
	// KVRank (applied to the attention output).
	KVA            *kernels.Matrix
	KVANorm        []float32
	KB, VB         *kernels.Matrix
	FFNNorm        []float32
	Gate, Up, Down *kernels.Matrix
	IndexQ, IndexK *kernels.Matrix // indexer projections (the indexer architectures only)
	IndexW         *kernels.Matrix // per-head weight projection (the indexer architectures only)
}

// Open maps a GGUF file and loads the model in it.
func Open(path string) (*Model, error) {
	f, err := gguf.Open(path)
	if err != nil {
		return nil, err
	}
	m, err := Load(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if m.watch, err = newFileWatch(path, f.DataOffset); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// Close releases the file mapping; the model must not be used afterwards.
func (m *Model) Close() error {
	if m.file == nil {
		return nil
	}
	return m.file.Close()
}

// Load reads the configuration, tokenizer and weights from an open GGUF file.
// The model takes ownership of f (Close closes it).
func Load(f *gguf.File) (*Model, error) {
	cfg, err := ReadConfig(f)
	if err != nil {
		return nil, err
	}
	vocab, err := ReadVocab(f)
	if err != nil {
		return nil, err
	}
	tok, err := tokenizer.New(vocab)
	if err != nil {
		return nil, err
	}
	if tok.VocabSize() != cfg.VocabSize {
		return nil, fmt.Errorf("model: tokenizer has %d tokens, model vocab is %d", tok.VocabSize(), cfg.VocabSize)
	}
	m := &Model{Config: cfg, Tokenizer: tok, file: f}
	m.Name, _ = f.String("general.name")
	if err := m.loadWeights(f); err != nil {
		return nil, err
	}
	m.Config.TiedOutput = m.Output == m.TokenEmbd
	return m, nil
}

// ReadConfig reads the model shape from the standard {arch}.* keys.
func ReadConfig(f *gguf.File) (Config, error) {
	arch := f.Architecture()
	if arch == "" {
		return Config{}, errors.New("model: general.architecture is missing")
	}
	if !slices.Contains(Archs, arch) {
		return Config{}, fmt.Errorf("model: unsupported architecture %q (pdkit runs %s)", arch, ArchList())
	}
	var missing []string
	need := func(key string) int {
		v, ok := f.Uint(arch + "." + key)
		if !ok {
			missing = append(missing, arch+"."+key)
		}
		return int(min(v, 1<<31))
	}
	opt := func(key string, def int) int {
		if v, ok := f.Uint(arch + "." + key); ok {
			return int(min(v, 1<<31))
		}
		return def
	}
	optf := func(key string, def float64) float32 {
		if v, ok := f.Float(arch + "." + key); ok {
			return float32(v)
		}
		return float32(def)
	}
	c := Config{Arch: arch}
	c.Dim = need("embedding_length")
	c.Layers = need("block_count")
	c.Hidden = need("feed_forward_length")
	c.Heads = need("attention.head_count")
	c.ContextLen = need("context_length")
	if HasIndexer(arch) {
		c.Indexer = &IndexerConfig{
			Heads: need("indexer.head_count"),
			Dim:   need("indexer.key_length"),
			TopK:  need("indexer.top_k"),
		}
	}
	if IsMLA(arch) {
		if err := readMLA(&c, need, opt); err != nil {
			return Config{}, err
		}
	}
	if len(missing) > 0 {
		return Config{}, fmt.Errorf("model: missing metadata %v", missing)
	}
	if c.MLA == nil {
		c.KVHeads = opt("attention.head_count_kv", c.Heads)
		if c.Heads > 0 {
			c.HeadDim = opt("attention.key_length", c.Dim/c.Heads)
		}
		c.RopeDim = opt("rope.dimension_count", c.HeadDim)
	}
	c.RopeTheta = optf("rope.freq_base", 10000)
	c.NormEps = optf("attention.layer_norm_rms_epsilon", 1e-5)
	c.VocabSize = opt("vocab_size", 0)
	if c.VocabSize == 0 {
		if t, ok := f.Tensor("token_embd.weight"); ok && len(t.Shape) == 2 {
			c.VocabSize = int(min(t.Shape[1], 1<<31))
		}
	}
	// Features of the llama family that this forward pass does not implement
	// are refused rather than run wrongly.
	if n, ok := f.Uint(arch + ".expert_count"); ok && n > 0 {
		return Config{}, fmt.Errorf("model: mixture-of-experts (%d experts) is not supported", n)
	}
	if st, ok := f.String(arch + ".rope.scaling.type"); ok && st != "" && st != "none" {
		return Config{}, fmt.Errorf("model: RoPE scaling %q is not supported", st)
	}
	if _, ok := f.Tensor("rope_freqs.weight"); ok {
		return Config{}, errors.New("model: per-dimension RoPE frequencies (rope_freqs.weight, as in Llama 3.1) are not supported")
	}
	if v, ok := f.Uint(arch + ".attention.value_length"); ok && c.MLA == nil && int(v) != c.HeadDim {
		return Config{}, fmt.Errorf("model: value length %d differs from key length %d; not supported", v, c.HeadDim)
	}
	return c, c.Validate()
}

// readMLA reads the latent attention's shape as llama.cpp's deepseek2
// files write it (the absorbed form): the cache row is a single KV head
// whose key is the latent plus the RoPE key (attention.key_length) and
// whose value is the latent (attention.value_length); a query head's key
// and value lengths are the *_mla keys. Shapes this forward pass does not
// run are refused: a low-rank query (q_lora_rank), mixture-of-experts
// layers (any layer past leading_dense_block_count).
func readMLA(c *Config, need func(string) int, opt func(string, int) int) error {
	m := &MLAConfig{KVRank: need("attention.kv_lora_rank")}
	c.RopeDim = need("rope.dimension_count")
	c.HeadDim = need("attention.key_length_mla")
	m.VDim = need("attention.value_length_mla")
	m.NopeDim = c.HeadDim - c.RopeDim
	c.KVHeads = opt("attention.head_count_kv", 1)
	c.MLA = m
	if q := opt("attention.q_lora_rank", 0); q != 0 {
		return fmt.Errorf("model: a low-rank query (q_lora_rank %d) is not supported; pdkit runs attn_q directly", q)
	}
	if dense := opt("leading_dense_block_count", c.Layers); dense < c.Layers {
		return fmt.Errorf("model: %d of %d blocks are mixture-of-experts (leading_dense_block_count %d); pdkit runs dense blocks only", c.Layers-dense, c.Layers, dense)
	}
	if k := opt("attention.key_length", m.KVRank+c.RopeDim); k != m.KVRank+c.RopeDim {
		return fmt.Errorf("model: cache key length %d is not the latent %d plus the RoPE key %d", k, m.KVRank, c.RopeDim)
	}
	if v := opt("attention.value_length", m.KVRank); v != m.KVRank {
		return fmt.Errorf("model: cache value length %d is not the latent rank %d", v, m.KVRank)
	}
	return nil
}

// ReadVocab reads the tokenizer.ggml.* keys.
func ReadVocab(f *gguf.File) (tokenizer.Vocab, error) {
	v := tokenizer.Vocab{BOS: -1, EOS: -1, UNK: -1, PAD: -1}
	var ok bool
	if v.Model, ok = f.String("tokenizer.ggml.model"); !ok {
		return v, errors.New("model: tokenizer.ggml.model is missing")
	}
	if v.Tokens, ok = f.Strings("tokenizer.ggml.tokens"); !ok {
		return v, errors.New("model: tokenizer.ggml.tokens is missing")
	}
	v.Pre, _ = f.String("tokenizer.ggml.pre")
	v.Scores, _ = f.Float32s("tokenizer.ggml.scores")
	v.Types, _ = f.Int32s("tokenizer.ggml.token_type")
	v.Merges, _ = f.Strings("tokenizer.ggml.merges")
	id := func(key string, dst *int32) {
		if x, ok := f.Int("tokenizer.ggml." + key); ok && x >= 0 && x < int64(len(v.Tokens)) {
			*dst = int32(x)
		}
	}
	id("bos_token_id", &v.BOS)
	id("eos_token_id", &v.EOS)
	id("unknown_token_id", &v.UNK)
	id("padding_token_id", &v.PAD)
	v.AddBOS = v.Model == "llama"
	if b, ok := f.Bool("tokenizer.ggml.add_bos_token"); ok {
		v.AddBOS = b
	}
	v.AddSpacePrefix = v.Model == "llama"
	if b, ok := f.Bool("tokenizer.ggml.add_space_prefix"); ok {
		v.AddSpacePrefix = b
	}
	return v, nil
}

func dtypeOf(t gguf.Type) (kernels.DType, error) {
	switch t {
	case gguf.TypeF32:
		return kernels.F32, nil
	case gguf.TypeF16:
		return kernels.F16, nil
	case gguf.TypeBF16:
		return kernels.BF16, nil
	case gguf.TypeQ8_0:
		return kernels.Q8_0, nil
	}
	return 0, fmt.Errorf("tensor type %v is not supported (pdkit runs F32, F16, BF16 and Q8_0)", t)
}

func (m *Model) loadWeights(f *gguf.File) error {
	c := &m.Config
	var err error
	mat := func(name string, rows, cols int) *kernels.Matrix {
		if err != nil {
			return nil
		}
		var x *kernels.Matrix
		x, err = loadMatrix(f, name, rows, cols)
		return x
	}
	vec := func(name string, n int) []float32 {
		if err != nil {
			return nil
		}
		var x *kernels.Matrix
		if x, err = loadMatrix(f, name, 1, n); err != nil {
			return nil
		}
		out := make([]float32, n)
		x.DecodeRow(out, 0)
		return out
	}
	m.TokenEmbd = mat("token_embd.weight", c.VocabSize, c.Dim)
	m.OutputNorm = vec("output_norm.weight", c.Dim)
	if _, ok := f.Tensor("output.weight"); ok {
		m.Output = mat("output.weight", c.VocabSize, c.Dim)
	} else {
		m.Output = m.TokenEmbd
	}
	if err != nil {
		return err
	}
	// The block count is the file's word; each block needs its tensors,
	// so a count the tensor table cannot hold is refused before a layer
	// is allocated, and the first missing tensor ends the load.
	if perLayer := layerTensors(c); c.Layers > len(f.Tensors)/perLayer {
		return fmt.Errorf("model: block count %d needs %d tensors; the file has %d in all", c.Layers, c.Layers*perLayer, len(f.Tensors))
	}
	if _, ok := f.Tensor(fmt.Sprintf("blk.%d.attn_norm.weight", c.Layers-1)); !ok {
		return fmt.Errorf("model: block count %d, but tensor %q is missing", c.Layers, fmt.Sprintf("blk.%d.attn_norm.weight", c.Layers-1))
	}
	m.Layers = make([]Layer, c.Layers)
	for i := range m.Layers {
		if err != nil {
			return err
		}
		l := &m.Layers[i]
		p := fmt.Sprintf("blk.%d.", i)
		l.AttnNorm = vec(p+"attn_norm.weight", c.Dim)
		l.Q = mat(p+"attn_q.weight", c.QDim(), c.Dim)
		if ml := c.MLA; ml != nil {
			l.KVA = mat(p+"attn_kv_a_mqa.weight", c.KVDim(), c.Dim)
			l.KVANorm = vec(p+"attn_kv_a_norm.weight", ml.KVRank)
			if err == nil {
				l.KB, err = loadHeads(f, p+"attn_k_b.weight", c.Heads, ml.KVRank, ml.NopeDim)
			}
			if err == nil {
				l.VB, err = loadHeads(f, p+"attn_v_b.weight", c.Heads, ml.VDim, ml.KVRank)
			}
		} else {
			l.K = mat(p+"attn_k.weight", c.KVDim(), c.Dim)
			l.V = mat(p+"attn_v.weight", c.KVDim(), c.Dim)
		}
		l.O = mat(p+"attn_output.weight", c.Dim, c.AttnOutDim())
		l.FFNNorm = vec(p+"ffn_norm.weight", c.Dim)
		l.Gate = mat(p+"ffn_gate.weight", c.Hidden, c.Dim)
		l.Up = mat(p+"ffn_up.weight", c.Hidden, c.Dim)
		l.Down = mat(p+"ffn_down.weight", c.Dim, c.Hidden)
		if ix := c.Indexer; ix != nil {
			l.IndexQ = mat(p+"indexer.attn_q.weight", ix.Heads*ix.Dim, c.Dim)
			l.IndexK = mat(p+"indexer.attn_k.weight", ix.Dim, c.Dim)
			l.IndexW = mat(p+"indexer.proj.weight", ix.Heads, c.Dim)
		}
	}
	return err
}

// layerTensors is the number of tensors each block of c holds.
func layerTensors(c *Config) int {
	n := 9
	if c.MLA != nil {
		n = 11 // attn_kv_a_mqa, attn_kv_a_norm, attn_k_b, attn_v_b for attn_k, attn_v
	}
	if c.Indexer != nil {
		n += 3
	}
	return n
}

// loadHeads loads a per-head stack of heads matrices of rows×cols each
// (GGUF ne = [cols, rows, heads]) as one matrix of heads·rows rows, head
// after head, so that a tensor-parallel rank's heads are a row range.
func loadHeads(f *gguf.File, name string, heads, rows, cols int) (*kernels.Matrix, error) {
	t, ok := f.Tensor(name)
	if !ok {
		return nil, fmt.Errorf("model: tensor %q is missing", name)
	}
	if want := []uint64{uint64(cols), uint64(rows), uint64(heads)}; !equalShape(t.Shape, want) {
		return nil, fmt.Errorf("model: tensor %q has shape %v, want %v", name, t.Shape, want)
	}
	return tensorMatrix(f, t, name, heads*rows, cols)
}

// loadMatrix checks a tensor's shape (GGUF ne = [cols, rows]; a vector is
// [cols]) and type, and wraps its mapped bytes.
func loadMatrix(f *gguf.File, name string, rows, cols int) (*kernels.Matrix, error) {
	t, ok := f.Tensor(name)
	if !ok {
		return nil, fmt.Errorf("model: tensor %q is missing", name)
	}
	want := []uint64{uint64(cols), uint64(rows)}
	if rows == 1 {
		want = want[:1]
	}
	shape := t.Shape
	if !equalShape(shape, want) {
		return nil, fmt.Errorf("model: tensor %q has shape %v, want %v", name, shape, want)
	}
	return tensorMatrix(f, t, name, rows, cols)
}

// tensorMatrix wraps tensor t's mapped bytes as a rows×cols matrix.
func tensorMatrix(f *gguf.File, t *gguf.TensorInfo, name string, rows, cols int) (*kernels.Matrix, error) {
	dt, err := dtypeOf(t.Type)
	if err != nil {
		return nil, fmt.Errorf("model: tensor %q: %w", name, err)
	}
	data, err := f.TensorData(name)
	if err != nil {
		return nil, err
	}
	mx, err := kernels.NewMatrix(dt, rows, cols, data)
	if err != nil {
		return nil, fmt.Errorf("model: tensor %q: %w", name, err)
	}
	return mx, nil
}

// equalShape compares shapes ignoring trailing 1s (GGUF writers differ).
func equalShape(a, b []uint64) bool {
	trim := func(s []uint64) []uint64 {
		for len(s) > 1 && s[len(s)-1] == 1 {
			s = s[:len(s)-1]
		}
		return s
	}
	return slices.Equal(trim(a), trim(b))
}
