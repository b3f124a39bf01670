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
	AttnNorm       []float32
	Q, K, V, O     *kernels.Matrix
	FFNNorm        []float32
	Gate, Up, Down *kernels.Matrix
	IndexQ, IndexK *kernels.Matrix // indexer projections (ArchLlamaDSA only)
	IndexW         *kernels.Matrix // per-head weight projection (ArchLlamaDSA only)
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
	if arch != ArchLlama && arch != ArchLlamaDSA {
		return Config{}, fmt.Errorf("model: unsupported architecture %q (pdkit runs %s and %s)", arch, ArchLlama, ArchLlamaDSA)
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
	if arch == ArchLlamaDSA {
		c.Indexer = &IndexerConfig{
			Heads: need("indexer.head_count"),
			Dim:   need("indexer.key_length"),
			TopK:  need("indexer.top_k"),
		}
	}
	if len(missing) > 0 {
		return Config{}, fmt.Errorf("model: missing metadata %v", missing)
	}
	c.KVHeads = opt("attention.head_count_kv", c.Heads)
	if c.Heads > 0 {
		c.HeadDim = opt("attention.key_length", c.Dim/c.Heads)
	}
	c.RopeDim = opt("rope.dimension_count", c.HeadDim)
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
	if v, ok := f.Uint(arch + ".attention.value_length"); ok && int(v) != c.HeadDim {
		return Config{}, fmt.Errorf("model: value length %d differs from key length %d; not supported", v, c.HeadDim)
	}
	return c, c.Validate()
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
		l.K = mat(p+"attn_k.weight", c.KVDim(), c.Dim)
		l.V = mat(p+"attn_v.weight", c.KVDim(), c.Dim)
		l.O = mat(p+"attn_output.weight", c.Dim, c.QDim())
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
	if c.Indexer != nil {
		return 12
	}
	return 9
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
