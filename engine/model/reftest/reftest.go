// Package reftest is an independent float64 forward pass of the llama and
// llama-dsa architectures (docs/llama-dsa.md) and of deepseek2 and
// deepseek2-dsa (docs/deepseek2.md; llama.cpp's deepseek2 GGUF layout: DeepSeek-V2's
// multi-head latent attention with dense SwiGLU layers, and for -dsa the
// llama-dsa indexer), used to check the engine's logits. It is written from
// the specifications, not from the engine: it reads the configuration and
// the raw tensor bytes straight from the GGUF file and decodes F32, F16,
// BF16 and Q8_0 with its own decoders, computes everything in float64, and
// models only what the specifications say the engine stores with less
// precision: the indexer's keys, which are quantized (fp8 e4m3 with a
// per-token scale, or bf16) before they are scored, and, on request
// (Options.KV), the KV cache's rows in a 16-bit type.
//
// Latent attention is computed in the uncompressed (naive) form, not in the
// absorbed one the engine runs: every head's position-free key and its
// value are expanded from the token's latent (attn_k_b, attn_v_b) and the
// head attends as in ordinary multi-head attention, its key the expanded
// position-free part followed by the shared RoPE key. The two forms are
// equal in exact arithmetic, so agreement checks the absorption too.
//
// It is slow and simple on purpose: the whole sequence goes through one layer
// after another, every position attending over its candidates (or its top_k
// selection) directly; there is no KV paging, chunking or batching.
package reftest

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/pdkit/pdkit/engine/gguf"
)

// Forward returns the logits of every position of tokens, run as one fresh
// sequence (positions 0..len-1). indexK is the index-K precision, "fp8" or
// "bf16"; it only matters for the indexer architectures (llama-dsa,
// deepseek2-dsa).
func Forward(f *gguf.File, tokens []int32, indexK string) ([][]float64, error) {
	r, err := Run(f, tokens, Options{IndexK: indexK})
	if err != nil {
		return nil, err
	}
	return r.Logits, nil
}

// Perturbation deliberately breaks the reference in one known way. It exists
// to show that a comparison against the reference is sensitive enough to
// catch real bugs: a test runs a perturbed reference and expects it to fail
// the tolerance that the unperturbed one passes.
type Perturbation int

const (
	Exact             Perturbation = iota // the specification
	NoRoPE                                // attention Q and K are not rotated
	WrongKVHead                           // query head h reads KV head h % kv_heads instead of h / group
	NoIndexerRoPE                         // index Q and K are not rotated
	UnquantizedIndexK                     // candidates are scored from the float64 key, not the stored one
	DenseIndexer                          // the indexer is ignored: attention is always dense
	NoFinalNorm                           // the final RMSNorm is skipped
	HalfSplitRoPE                         // attention RoPE pairs (i, i+rope_dim/2) (the "neox" layout) instead of (2i, 2i+1)
	DoubledEps                            // RMSNorm ε is twice the file's: a small, smooth error
	TopKPlusOne                           // the indexer selects top_k+1 tokens

	// Latent attention only (deepseek2, deepseek2-dsa).

	NoLatentNorm   // the latent is used as projected: attn_kv_a_norm's RMSNorm is skipped
	RoPEOnNope     // RoPE rotates the first rope_dim elements of each head's query and key (llama's layout, inside the position-free part), not the RoPE part
	LatentRowScale // scores are scaled by 1/√(kv_lora_rank+rope_dim), the cache row's length, not 1/√(nope+rope), the head's
	RoPERowsFirst  // each query head's rows and attn_kv_a_mqa's rows are read RoPE part first
	KBMisread      // attn_k_b is read as ne [kv_lora_rank, nope, heads] (each head nope×kv_lora_rank row-major): the same bytes, the other orientation
)

func (p Perturbation) String() string {
	switch p {
	case Exact:
		return "exact"
	case NoRoPE:
		return "no-rope"
	case WrongKVHead:
		return "wrong-kv-head"
	case NoIndexerRoPE:
		return "no-indexer-rope"
	case UnquantizedIndexK:
		return "unquantized-index-k"
	case DenseIndexer:
		return "dense-indexer"
	case NoFinalNorm:
		return "no-final-norm"
	case HalfSplitRoPE:
		return "half-split-rope"
	case DoubledEps:
		return "doubled-eps"
	case TopKPlusOne:
		return "top-k-plus-one"
	case NoLatentNorm:
		return "no-latent-norm"
	case RoPEOnNope:
		return "rope-on-nope"
	case LatentRowScale:
		return "latent-row-scale"
	case RoPERowsFirst:
		return "rope-rows-first"
	case KBMisread:
		return "k-b-misread"
	}
	return fmt.Sprintf("Perturbation(%d)", int(p))
}

// Options select the index-K precision and, for sensitivity checks only, a
// perturbation.
type Options struct {
	IndexK string // "fp8" or "bf16"
	// KV is the KV cache's element type: "" or "f32" keeps K and V in
	// float64 (the exact forward pass); "bf16" or "f16" reads every K and V
	// row (with latent attention, every latent row: the normalised latent
	// and the rotated RoPE key, from which the heads' keys and values are
	// then expanded) back as a 16-bit pool stores it: the float64 row
	// rounded to float32 (the engine computes it in float32), then to the
	// nearest 16-bit value, ties to even.
	KV      string
	Perturb Perturbation
}

// Result is the outcome of Run.
type Result struct {
	Logits [][]float64 // [position][vocab]

	// Selected[layer][t] is the positions token t attended to, in position
	// order, for the rows of an indexer architecture that used the top-k
	// path; nil for dense rows (and for llama and deepseek2).
	Selected [][][]int
	// SparseRows counts the (layer, token) pairs that used the top-k path.
	SparseRows int

	// How close the selections came to flipping. The engine computes the
	// scores in float32; where the k-th and the (k+1)-th best candidates are
	// within its rounding of each other, the engine may select differently
	// and its logits then differ from the reference by far more than
	// rounding.
	//
	// MinGap is the smallest non-zero score difference, over all sparse
	// rows, between the k-th and the (k+1)-th best candidate; MinGapLayer and
	// MinGapToken say where, and MinGapScale is the largest |score| of that
	// row, to judge the gap against (+Inf and -1 when there is none).
	MinGap                   float64
	MinGapLayer, MinGapToken int
	MinGapScale              float64
	// ExactTies counts the sparse rows whose k-th and (k+1)-th scores are
	// equal, so that position decides. That happens when candidates score
	// exactly zero (every head's dot product clamped by the ReLU); such a tie
	// is robust unless one of those dot products is close to zero, and
	// MinTieDot is the smallest |q·k̂| over the heads of the tied candidates
	// (+Inf when there is no tie), at MinTieLayer, MinTieToken.
	ExactTies                int
	MinTieDot                float64
	MinTieLayer, MinTieToken int
}

// Config is the model shape, read from the GGUF metadata with the defaults of
// the specification.
type Config struct {
	Arch                    string
	Vocab, Dim, Layers      int
	Hidden                  int
	Heads, KVHeads, HeadDim int
	RopeDim                 int
	RopeTheta, NormEps      float64
	// Indexer (llama-dsa and deepseek2-dsa; IdxHeads == 0 otherwise).
	IdxHeads, IdxDim, TopK int
	// Latent attention (deepseek2 and deepseek2-dsa; KVRank == 0
	// otherwise): the latent's length (kv_lora_rank), a head's
	// position-free query/key length and its value length. HeadDim is then
	// a head's query/key length, NopeDim + RopeDim (key_length_mla), and
	// KVHeads is 1.
	KVRank, NopeDim, VDim int
}

// MLA says whether c is a latent-attention model.
func (c *Config) MLA() bool { return c.KVRank > 0 }

// ReadConfig reads the model shape from the {arch}.* keys.
func ReadConfig(f *gguf.File) (Config, error) {
	var c Config
	c.Arch = f.Architecture()
	var mla, indexer bool
	switch c.Arch {
	case "llama":
	case "llama-dsa":
		indexer = true
	case "deepseek2":
		mla = true
	case "deepseek2-dsa":
		mla, indexer = true, true
	default:
		return c, fmt.Errorf("reftest: architecture %q is none of llama, llama-dsa, deepseek2, deepseek2-dsa", c.Arch)
	}
	var err error
	u := func(key string, def int, required bool) int {
		v, ok := f.Uint(c.Arch + "." + key)
		if !ok {
			if required && err == nil {
				err = fmt.Errorf("reftest: %s.%s is missing", c.Arch, key)
			}
			return def
		}
		return int(v)
	}
	fl := func(key string, def float64) float64 {
		if v, ok := f.Float(c.Arch + "." + key); ok {
			return v
		}
		return def
	}
	c.Dim = u("embedding_length", 0, true)
	c.Layers = u("block_count", 0, true)
	c.Hidden = u("feed_forward_length", 0, true)
	c.Heads = u("attention.head_count", 0, true)
	if err != nil {
		return c, err
	}
	c.KVHeads = u("attention.head_count_kv", c.Heads, false)
	c.HeadDim = u("attention.key_length", c.Dim/max(c.Heads, 1), false)
	c.RopeDim = u("rope.dimension_count", c.HeadDim, false)
	c.RopeTheta = fl("rope.freq_base", 10000)
	c.NormEps = fl("attention.layer_norm_rms_epsilon", 1e-5)
	if mla {
		// llama.cpp's deepseek2 keys: key_length and value_length are the
		// cache row's (the latent plus the RoPE key; the latent), the
		// head's are the *_mla ones.
		c.KVRank = u("attention.kv_lora_rank", 0, true)
		c.RopeDim = u("rope.dimension_count", 0, true)
		c.HeadDim = u("attention.key_length_mla", 0, true)
		c.VDim = u("attention.value_length_mla", 0, true)
		c.NopeDim = c.HeadDim - c.RopeDim
		if err != nil {
			return c, err
		}
		if k := u("attention.key_length", c.KVRank+c.RopeDim, false); k != c.KVRank+c.RopeDim {
			return c, fmt.Errorf("reftest: %s.attention.key_length is %d, not kv_lora_rank %d + rope %d", c.Arch, k, c.KVRank, c.RopeDim)
		}
		if v := u("attention.value_length", c.KVRank, false); v != c.KVRank {
			return c, fmt.Errorf("reftest: %s.attention.value_length is %d, not kv_lora_rank %d", c.Arch, v, c.KVRank)
		}
	}
	c.Vocab = u("vocab_size", 0, false)
	if c.Vocab == 0 {
		t, ok := f.Tensor("token_embd.weight")
		if !ok || len(t.Shape) < 2 {
			return c, errors.New("reftest: token_embd.weight is missing")
		}
		c.Vocab = int(t.Shape[1])
	}
	if indexer {
		c.IdxHeads = u("indexer.head_count", 0, true)
		c.IdxDim = u("indexer.key_length", 0, true)
		c.TopK = u("indexer.top_k", 0, true)
	}
	if err != nil {
		return c, err
	}
	if c.Dim <= 0 || c.Layers <= 0 || c.Hidden <= 0 || c.Heads <= 0 || c.KVHeads <= 0 || c.HeadDim <= 0 ||
		c.Heads%c.KVHeads != 0 || c.RopeDim <= 0 || c.RopeDim > c.HeadDim || c.RopeDim%2 != 0 {
		return c, fmt.Errorf("reftest: unusable shape %+v", c)
	}
	if mla && (c.KVRank <= 0 || c.NopeDim <= 0 || c.VDim <= 0 || c.KVHeads != 1) {
		return c, fmt.Errorf("reftest: unusable latent-attention shape %+v", c)
	}
	if indexer && (c.IdxHeads <= 0 || c.IdxDim <= 0 || c.IdxDim%2 != 0 || c.TopK <= 0) {
		return c, fmt.Errorf("reftest: unusable indexer shape %+v", c)
	}
	return c, nil
}

// matrix is a decoded weight: rows of cols values.
type matrix struct {
	rows, cols int
	w          [][]float64
}

// mul returns W·x.
func (m *matrix) mul(x []float64) []float64 {
	out := make([]float64, m.rows)
	for r, row := range m.w {
		var s float64
		for c, v := range row {
			s += v * x[c]
		}
		out[r] = s
	}
	return out
}

// loadMatrix decodes the named tensor, checking it is rows × cols (GGUF
// shape [cols, rows], or [cols] for a vector).
func loadMatrix(f *gguf.File, name string, rows, cols int) (*matrix, error) {
	return loadShaped(f, name, []int{cols, rows})
}

// loadHeads decodes the named stack of heads matrices of rows × cols each
// (GGUF shape [cols, rows, heads]: head h's rows follow head h-1's).
func loadHeads(f *gguf.File, name string, heads, rows, cols int) ([]*matrix, error) {
	m, err := loadShaped(f, name, []int{cols, rows, heads})
	if err != nil {
		return nil, err
	}
	out := make([]*matrix, heads)
	for h := range out {
		out[h] = &matrix{rows: rows, cols: cols, w: m.w[h*rows : (h+1)*rows]}
	}
	return out, nil
}

// trimShape drops trailing dimensions of 1 (but keeps the first).
func trimShape[T int | uint64](s []T) []T {
	for len(s) > 1 && s[len(s)-1] == 1 {
		s = s[:len(s)-1]
	}
	return s
}

// loadShaped decodes the named tensor, checking its GGUF shape is want
// (fastest-varying first, trailing 1s ignored), as a matrix of want[0]
// columns and the product of the other dimensions rows.
func loadShaped(f *gguf.File, name string, want []int) (*matrix, error) {
	t, ok := f.Tensor(name)
	if !ok {
		return nil, fmt.Errorf("reftest: tensor %q is missing", name)
	}
	shape, w := trimShape(t.Shape), trimShape(want)
	okShape := len(shape) == len(w)
	for i := 0; okShape && i < len(w); i++ {
		okShape = int(shape[i]) == w[i]
	}
	if !okShape {
		return nil, fmt.Errorf("reftest: tensor %q has shape %v, want %v", name, t.Shape, want)
	}
	cols, rows := want[0], 1
	for _, d := range want[1:] {
		rows *= d
	}
	data, err := f.TensorData(name)
	if err != nil {
		return nil, err
	}
	m := &matrix{rows: rows, cols: cols, w: make([][]float64, rows)}
	var rowBytes int
	switch t.Type {
	case gguf.TypeF32:
		rowBytes = 4 * cols
	case gguf.TypeF16, gguf.TypeBF16:
		rowBytes = 2 * cols
	case gguf.TypeQ8_0:
		if cols%32 != 0 {
			return nil, fmt.Errorf("reftest: Q8_0 tensor %q has rows of %d", name, cols)
		}
		rowBytes = cols / 32 * 34
	default:
		return nil, fmt.Errorf("reftest: tensor %q has type %v", name, t.Type)
	}
	if len(data) != rows*rowBytes {
		return nil, fmt.Errorf("reftest: tensor %q has %d bytes, want %d", name, len(data), rows*rowBytes)
	}
	for r := range rows {
		m.w[r] = decodeRow(t.Type, data[r*rowBytes:(r+1)*rowBytes], cols)
	}
	return m, nil
}

func le16(b []byte) uint16 { return uint16(b[0]) | uint16(b[1])<<8 }

func decodeRow(t gguf.Type, b []byte, cols int) []float64 {
	out := make([]float64, cols)
	switch t {
	case gguf.TypeF32:
		for i := range out {
			bits := uint32(b[4*i]) | uint32(b[4*i+1])<<8 | uint32(b[4*i+2])<<16 | uint32(b[4*i+3])<<24
			out[i] = float64(math.Float32frombits(bits))
		}
	case gguf.TypeF16:
		for i := range out {
			out[i] = F16(le16(b[2*i:]))
		}
	case gguf.TypeBF16:
		for i := range out {
			out[i] = BF16(le16(b[2*i:]))
		}
	case gguf.TypeQ8_0:
		for blk := range cols / 32 {
			p := b[blk*34:]
			d := F16(le16(p))
			for i := range 32 {
				out[blk*32+i] = d * float64(int8(p[2+i]))
			}
		}
	}
	return out
}

// decodeIEEE decodes a binary floating-point number with expBits exponent
// bits and manBits mantissa bits (IEEE layout: sign, biased exponent,
// mantissa; all-ones exponent is Inf/NaN).
func decodeIEEE(bits uint32, expBits, manBits uint) float64 {
	bias := 1<<(expBits-1) - 1
	sign := bits >> (expBits + manBits) & 1
	e := int(bits>>manBits) & (1<<expBits - 1)
	m := float64(bits & (1<<manBits - 1))
	var v float64
	switch e {
	case 0:
		v = math.Ldexp(m, 1-bias-int(manBits))
	case 1<<expBits - 1:
		if m != 0 {
			return math.NaN()
		}
		v = math.Inf(1)
	default:
		v = math.Ldexp(1+m/float64(uint64(1)<<manBits), e-bias)
	}
	if sign != 0 {
		v = -v
	}
	return v
}

// F16 decodes an IEEE half.
func F16(h uint16) float64 { return decodeIEEE(uint32(h), 5, 10) }

// BF16 decodes a bfloat16.
func BF16(h uint16) float64 { return decodeIEEE(uint32(h), 8, 7) }

// E4M3 decodes an fp8 e4m3 ("fn") code: bias 7, 3 mantissa bits, no
// infinities, S.1111.111 is NaN, largest finite value 448.
func E4M3(c uint8) float64 {
	if c&0x7F == 0x7F {
		return math.NaN()
	}
	e := int(c>>3) & 0xF
	m := float64(c & 7)
	var v float64
	if e == 0 {
		v = m * 0x1p-9
	} else {
		v = math.Ldexp(1+m/8, e-7)
	}
	if c&0x80 != 0 {
		v = -v
	}
	return v
}

// roundTo rounds x to the nearest number with manBits explicit mantissa bits
// whose exponent is at least minExp (below it, the spacing stays that of
// minExp: subnormals), ties to an even mantissa. It does not bound the
// exponent from above.
func roundTo(x float64, manBits, minExp int) float64 {
	if x == 0 || math.IsNaN(x) || math.IsInf(x, 0) {
		return x
	}
	_, e := math.Frexp(math.Abs(x)) // |x| = frac·2^e, frac in [0.5, 1): leading bit at 2^(e-1)
	exp := max(e-1, minExp)
	ulp := math.Ldexp(1, exp-manBits)
	// x/ulp is exact (a power-of-two scaling); RoundToEven picks the even
	// multiple on a tie, and the multiple's parity is the mantissa's last bit.
	return math.RoundToEven(x/ulp) * ulp
}

// RoundE4M3 is the e4m3 value nearest x, ties to even, saturated to ±448.
func RoundE4M3(x float64) float64 {
	v := roundTo(x, 3, -6)
	return math.Max(-448, math.Min(448, v))
}

// EncodeE4M3 encodes x as the code of RoundE4M3(x).
func EncodeE4M3(x float64) uint8 {
	if math.IsNaN(x) {
		return 0x7F
	}
	v := RoundE4M3(x)
	var sign uint8
	if math.Signbit(v) {
		sign = 0x80
	}
	a := math.Abs(v)
	if a < 0x1p-6 {
		return sign | uint8(a*0x1p9)
	}
	frac, e := math.Frexp(a)
	e--
	m := uint8((2*frac - 1) * 8)
	return sign | uint8(e+7)<<3 | m
}

// RoundBF16 is the bfloat16 value nearest x, ties to even (the exponent range
// of float32; overflow to infinity is not modelled, keys never come near it).
func RoundBF16(x float64) float64 { return roundTo(x, 7, -126) }

// RoundF16 is the half value nearest x, ties to even (no overflow handling).
func RoundF16(x float64) float64 { return roundTo(x, 10, -14) }

// quantizeIndexKey returns the key as the indexer reads it back from the
// index-K buffer. The engine computes the key in float32, so the float64 key
// is first rounded to float32; then fp8: scale = amax/448 (a float32, 1 for
// an all-zero key), each element the e4m3 value nearest key/scale, read back
// as code·scale; or bf16: the nearest bfloat16.
func quantizeIndexKey(k []float64, indexK string) []float64 {
	out := make([]float64, len(k))
	switch indexK {
	case "bf16":
		for i, v := range k {
			out[i] = RoundBF16(float64(float32(v)))
		}
	default: // fp8
		var amax float32
		for _, v := range k {
			amax = max(amax, float32(math.Abs(float64(float32(v)))))
		}
		scale := float32(1)
		if amax != 0 {
			scale = amax / 448
		}
		s := float64(scale)
		for i, v := range k {
			out[i] = RoundE4M3(float64(float32(v))/s) * s
		}
	}
	return out
}

func rmsNorm(x, w []float64, eps float64) []float64 {
	var ss float64
	for _, v := range x {
		ss += v * v
	}
	inv := 1 / math.Sqrt(ss/float64(len(x))+eps)
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = v * inv * w[i]
	}
	return out
}

// rope rotates, in place, the first ropeDim elements of each of the
// len(x)/headDim heads of x by position pos, pairing (2i, 2i+1) with
// frequency theta^(-2i/ropeDim).
func rope(x []float64, pos, headDim, ropeDim int, theta float64) {
	for h := 0; h < len(x)/headDim; h++ {
		v := x[h*headDim:]
		for i := 0; i < ropeDim/2; i++ {
			freq := math.Pow(theta, -float64(2*i)/float64(ropeDim))
			sin, cos := math.Sincos(float64(pos) * freq)
			a, b := v[2*i], v[2*i+1]
			v[2*i] = a*cos - b*sin
			v[2*i+1] = a*sin + b*cos
		}
	}
}

// ropeHalfSplit is rope with the other common pairing, (i, i+ropeDim/2):
// wrong for llama, used only by the HalfSplitRoPE perturbation.
func ropeHalfSplit(x []float64, pos, headDim, ropeDim int, theta float64) {
	half := ropeDim / 2
	for h := 0; h < len(x)/headDim; h++ {
		v := x[h*headDim:]
		for i := range half {
			freq := math.Pow(theta, -float64(2*i)/float64(ropeDim))
			sin, cos := math.Sincos(float64(pos) * freq)
			a, b := v[i], v[i+half]
			v[i] = a*cos - b*sin
			v[i+half] = a*sin + b*cos
		}
	}
}

func silu(x float64) float64 { return x / (1 + math.Exp(-x)) }

type layer struct {
	attnNorm, ffnNorm []float64
	q, k, v, o        *matrix
	gate, up, down    *matrix
	idxQ, idxK, idxW  *matrix
	// Latent attention: attn_kv_a_mqa (the latent's rows, then the shared
	// RoPE key's), the latent's norm weight, and per head KB (KVRank ×
	// NopeDim, attn_k_b) and VB (VDim × KVRank, attn_v_b).
	kva     *matrix
	kvaNorm []float64
	kb, vb  []*matrix
}

// headInputs are one layer's attention inputs in multi-head form: for every
// token and query head, the query it asks with and the key and value it
// offers to later tokens, [token][head][].
type headInputs struct{ q, k, v [][][]float64 }

func newHeadInputs(n, heads int) headInputs {
	hi := headInputs{make([][][]float64, n), make([][][]float64, n), make([][][]float64, n)}
	for t := range n {
		hi.q[t], hi.k[t], hi.v[t] = make([][]float64, heads), make([][]float64, heads), make([][]float64, heads)
	}
	return hi
}

// roundRows rounds, in place, each row as a 16-bit KV pool stores it: to
// float32 first, then with round.
func roundRows(round func(float64) float64, rows ...[]float64) {
	if round == nil {
		return
	}
	for _, row := range rows {
		for i, e := range row {
			row[i] = round(float64(float32(e)))
		}
	}
}

// gqaInputs are llama's grouped-query attention inputs: query head h reads
// KV head h / (heads / kv_heads).
func gqaInputs(c Config, l *layer, h [][]float64, opt Options, roundKV func(float64) float64) headInputs {
	hi := newHeadInputs(len(h), c.Heads)
	group := c.Heads / c.KVHeads
	hd := c.HeadDim
	for t := range h {
		q, k, v := l.q.mul(h[t]), l.k.mul(h[t]), l.v.mul(h[t])
		switch opt.Perturb {
		case NoRoPE:
		case HalfSplitRoPE:
			ropeHalfSplit(q, t, hd, c.RopeDim, c.RopeTheta)
			ropeHalfSplit(k, t, hd, c.RopeDim, c.RopeTheta)
		default:
			rope(q, t, hd, c.RopeDim, c.RopeTheta)
			rope(k, t, hd, c.RopeDim, c.RopeTheta)
		}
		roundRows(roundKV, k, v)
		for qh := range c.Heads {
			kvh := qh / group
			if opt.Perturb == WrongKVHead {
				kvh = qh % c.KVHeads
			}
			hi.q[t][qh] = q[qh*hd : (qh+1)*hd]
			hi.k[t][qh] = k[kvh*hd : (kvh+1)*hd]
			hi.v[t][qh] = v[kvh*hd : (kvh+1)*hd]
		}
	}
	return hi
}

// mlaInputs are deepseek2's latent attention inputs in the uncompressed
// form. For token t: q = attn_q·h, each head's rows the position-free part
// (NopeDim) then the RoPE part (RopeDim); kva = attn_kv_a_mqa·h, the latent
// (KVRank) then the shared RoPE key (RopeDim); the latent is RMS-normalised
// (attn_kv_a_norm), the RoPE parts rotated as llama's (pairs (2i, 2i+1) over
// the RopeDim elements), and the row (latent | RoPE key) is what the cache
// stores. Head h's key is then (KB_hᵀ·latent | RoPE key), its value
// VB_h·latent, its query (position-free part | rotated RoPE part).
func mlaInputs(c Config, l *layer, h [][]float64, opt Options, roundKV func(float64) float64) headInputs {
	hi := newHeadInputs(len(h), c.Heads)
	rank, nope, r, hd := c.KVRank, c.NopeDim, c.RopeDim, c.HeadDim
	rotate := func(x []float64, pos int) { // one head of RopeDim elements
		switch opt.Perturb {
		case NoRoPE, RoPEOnNope:
		case HalfSplitRoPE:
			ropeHalfSplit(x, pos, r, r, c.RopeTheta)
		default:
			rope(x, pos, r, r, c.RopeTheta)
		}
	}
	// kNope is head qh's position-free key, KB_hᵀ·latent: element d is
	// Σ_c KB_h[c][d]·latent[c].
	kNope := func(qh int, lat []float64) []float64 {
		out := make([]float64, nope)
		for ci, row := range l.kb[qh].w {
			for d, w := range row {
				out[d] += w * lat[ci]
			}
		}
		return out
	}
	if opt.Perturb == KBMisread {
		kNope = func(qh int, lat []float64) []float64 {
			flat := slices.Concat(l.kb[qh].w...)
			out := make([]float64, nope)
			for d := range out {
				for ci := range rank {
					out[d] += flat[d*rank+ci] * lat[ci]
				}
			}
			return out
		}
	}
	for t := range h {
		q, kva := l.q.mul(h[t]), l.kva.mul(h[t])
		lat, kpe := kva[:rank], slices.Clone(kva[rank:])
		if opt.Perturb == RoPERowsFirst {
			kpe, lat = slices.Clone(kva[:r]), kva[r:]
		}
		if opt.Perturb == NoLatentNorm {
			lat = slices.Clone(lat)
		} else {
			lat = rmsNorm(lat, l.kvaNorm, c.NormEps)
		}
		rotate(kpe, t)
		roundRows(roundKV, lat, kpe) // the cache row, as stored
		for qh := range c.Heads {
			qrow := q[qh*hd : (qh+1)*hd]
			qn, qp := qrow[:nope], qrow[nope:]
			if opt.Perturb == RoPERowsFirst {
				qp, qn = qrow[:r], qrow[r:]
			}
			qf := slices.Concat(qn, qp)
			kf := slices.Concat(kNope(qh, lat), kpe)
			rotate(qf[nope:], t)
			if opt.Perturb == RoPEOnNope {
				rope(qf, t, hd, r, c.RopeTheta)
				rope(kf, t, hd, r, c.RopeTheta)
			}
			hi.q[t][qh], hi.k[t][qh], hi.v[t][qh] = qf, kf, l.vb[qh].mul(lat)
		}
	}
	return hi
}

// Run is Forward with the indexer's selections and statistics.
func Run(f *gguf.File, tokens []int32, opt Options) (*Result, error) {
	if opt.IndexK != "fp8" && opt.IndexK != "bf16" {
		return nil, fmt.Errorf("reftest: index-K precision %q (want fp8 or bf16)", opt.IndexK)
	}
	var roundKV func(float64) float64
	switch opt.KV {
	case "", "f32":
	case "bf16":
		roundKV = RoundBF16
	case "f16":
		roundKV = RoundF16
	default:
		return nil, fmt.Errorf("reftest: KV type %q (want f32, bf16 or f16)", opt.KV)
	}
	c, err := ReadConfig(f)
	if err != nil {
		return nil, err
	}
	switch opt.Perturb {
	case DoubledEps:
		c.NormEps *= 2
	case TopKPlusOne:
		c.TopK++
	}
	qDim, kvDim := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	outDim := qDim // the attention output: every head's value
	if c.MLA() {
		outDim = c.Heads * c.VDim
	}
	var errs []error
	mat := func(name string, rows, cols int) *matrix {
		m, err := loadMatrix(f, name, rows, cols)
		if err != nil {
			errs = append(errs, err)
		}
		return m
	}
	vec := func(name string, n int) []float64 {
		m := mat(name, 1, n)
		if m == nil {
			return nil
		}
		return m.w[0]
	}
	stack := func(name string, rows, cols int) []*matrix {
		m, err := loadHeads(f, name, c.Heads, rows, cols)
		if err != nil {
			errs = append(errs, err)
		}
		return m
	}
	embd := mat("token_embd.weight", c.Vocab, c.Dim)
	outNorm := vec("output_norm.weight", c.Dim)
	output := embd
	if _, ok := f.Tensor("output.weight"); ok {
		output = mat("output.weight", c.Vocab, c.Dim)
	}
	layers := make([]layer, c.Layers)
	for i := range layers {
		l := &layers[i]
		p := fmt.Sprintf("blk.%d.", i)
		l.attnNorm = vec(p+"attn_norm.weight", c.Dim)
		l.q = mat(p+"attn_q.weight", qDim, c.Dim)
		if c.MLA() {
			l.kva = mat(p+"attn_kv_a_mqa.weight", c.KVRank+c.RopeDim, c.Dim)
			l.kvaNorm = vec(p+"attn_kv_a_norm.weight", c.KVRank)
			l.kb = stack(p+"attn_k_b.weight", c.KVRank, c.NopeDim)
			l.vb = stack(p+"attn_v_b.weight", c.VDim, c.KVRank)
		} else {
			l.k = mat(p+"attn_k.weight", kvDim, c.Dim)
			l.v = mat(p+"attn_v.weight", kvDim, c.Dim)
		}
		l.o = mat(p+"attn_output.weight", c.Dim, outDim)
		l.ffnNorm = vec(p+"ffn_norm.weight", c.Dim)
		l.gate = mat(p+"ffn_gate.weight", c.Hidden, c.Dim)
		l.up = mat(p+"ffn_up.weight", c.Hidden, c.Dim)
		l.down = mat(p+"ffn_down.weight", c.Dim, c.Hidden)
		if c.IdxHeads > 0 {
			l.idxQ = mat(p+"indexer.attn_q.weight", c.IdxHeads*c.IdxDim, c.Dim)
			l.idxK = mat(p+"indexer.attn_k.weight", c.IdxDim, c.Dim)
			l.idxW = mat(p+"indexer.proj.weight", c.IdxHeads, c.Dim)
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}

	n := len(tokens)
	x := make([][]float64, n)
	for t, tok := range tokens {
		if tok < 0 || int(tok) >= c.Vocab {
			return nil, fmt.Errorf("reftest: token %d at %d is outside the vocabulary of %d", tok, t, c.Vocab)
		}
		x[t] = append([]float64(nil), embd.w[tok]...)
	}
	res := &Result{
		MinGap: math.Inf(1), MinGapLayer: -1, MinGapToken: -1,
		MinTieDot: math.Inf(1), MinTieLayer: -1, MinTieToken: -1,
		Selected: make([][][]int, c.Layers),
	}
	// Scores are scaled by the head's query/key length (for latent
	// attention too: nope + rope, the uncompressed head's).
	scale := 1 / math.Sqrt(float64(c.HeadDim))
	if c.MLA() && opt.Perturb == LatentRowScale {
		scale = 1 / math.Sqrt(float64(c.KVRank+c.RopeDim))
	}
	for li := range layers {
		l := &layers[li]
		res.Selected[li] = make([][]int, n)
		// Attention inputs of every token (the KV cache of a fresh sequence).
		h := make([][]float64, n)
		for t := range n {
			h[t] = rmsNorm(x[t], l.attnNorm, c.NormEps)
		}
		var hi headInputs
		if c.MLA() {
			hi = mlaInputs(c, l, h, opt, roundKV)
		} else {
			hi = gqaInputs(c, l, h, opt, roundKV)
		}
		// Indexer: queries, weights and stored keys.
		var iq, iw, ik [][]float64
		if c.IdxHeads > 0 {
			iq, iw, ik = make([][]float64, n), make([][]float64, n), make([][]float64, n)
			wscale := 1 / math.Sqrt(float64(c.IdxHeads*c.IdxDim))
			for t := range n {
				iq[t] = l.idxQ.mul(h[t])
				key := l.idxK.mul(h[t])
				if opt.Perturb != NoIndexerRoPE {
					rope(iq[t], t, c.IdxDim, c.IdxDim, c.RopeTheta)
					rope(key, t, c.IdxDim, c.IdxDim, c.RopeTheta)
				}
				if opt.Perturb == UnquantizedIndexK {
					ik[t] = key
				} else {
					ik[t] = quantizeIndexKey(key, opt.IndexK)
				}
				iw[t] = l.idxW.mul(h[t])
				for j := range iw[t] {
					iw[t][j] *= wscale
				}
			}
		}
		// Attention of every token over its selected positions.
		attn := make([][]float64, n)
		for t := range n {
			sel := make([]int, t+1)
			for s := range sel {
				sel[s] = s
			}
			if c.IdxHeads > 0 && t+1 > c.TopK && opt.Perturb != DenseIndexer {
				sel = res.selectTopK(c, iq[t], iw[t], ik[:t+1], li, t)
				res.Selected[li][t] = sel
			}
			out := make([]float64, 0, outDim)
			for hd := range c.Heads {
				qh := hi.q[t][hd]
				sc := make([]float64, len(sel))
				m := math.Inf(-1)
				for i, s := range sel {
					kh := hi.k[s][hd]
					var d float64
					for j := range qh {
						d += qh[j] * kh[j]
					}
					sc[i] = d * scale
					m = math.Max(m, sc[i])
				}
				var sum float64
				for i := range sc {
					sc[i] = math.Exp(sc[i] - m)
					sum += sc[i]
				}
				oh := make([]float64, len(hi.v[t][hd]))
				for i, s := range sel {
					p := sc[i] / sum
					for j, e := range hi.v[s][hd] {
						oh[j] += p * e
					}
				}
				out = append(out, oh...)
			}
			attn[t] = out
		}
		// Output projection, residual, MLP, residual.
		for t := range n {
			o := l.o.mul(attn[t])
			for i := range x[t] {
				x[t][i] += o[i]
			}
			h2 := rmsNorm(x[t], l.ffnNorm, c.NormEps)
			g, u := l.gate.mul(h2), l.up.mul(h2)
			for i := range g {
				g[i] = silu(g[i]) * u[i]
			}
			d := l.down.mul(g)
			for i := range x[t] {
				x[t][i] += d[i]
			}
		}
	}
	res.Logits = make([][]float64, n)
	for t := range n {
		hn := x[t]
		if opt.Perturb != NoFinalNorm {
			hn = rmsNorm(x[t], outNorm, c.NormEps)
		}
		res.Logits[t] = output.mul(hn)
	}
	return res, nil
}

// selectTopK scores the candidates 0..t from their stored keys and returns
// the top_k best in position order (ties to the earlier position), recording
// how close the selection came to flipping.
func (r *Result) selectTopK(c Config, q, w []float64, keys [][]float64, li, t int) []int {
	type cand struct {
		pos    int
		score  float64
		minDot float64 // smallest |q·k| over the heads: distance of a ReLU from its kink
	}
	cs := make([]cand, len(keys))
	var scale float64
	for s, key := range keys {
		cd := cand{pos: s, minDot: math.Inf(1)}
		for hd := range c.IdxHeads {
			qh := q[hd*c.IdxDim : (hd+1)*c.IdxDim]
			var d float64
			for j := range qh {
				d += qh[j] * key[j]
			}
			cd.score += w[hd] * math.Max(d, 0)
			cd.minDot = math.Min(cd.minDot, math.Abs(d))
		}
		cs[s] = cd
		scale = math.Max(scale, math.Abs(cd.score))
	}
	// Stable: equal scores keep position order, so the earlier one wins.
	slices.SortStableFunc(cs, func(a, b cand) int { return cmp.Compare(b.score, a.score) })
	r.SparseRows++
	k := c.TopK
	if in, out := cs[k-1].score, cs[k].score; in != out {
		if gap := in - out; gap < r.MinGap {
			r.MinGap, r.MinGapLayer, r.MinGapToken, r.MinGapScale = gap, li, t, scale
		}
	} else {
		// An exact tie across the boundary: every candidate of the tied
		// score has all its ReLUs at zero (equal non-zero sums do not occur
		// in practice), and position decides. That is as robust as the
		// signs of the clamped dot products.
		r.ExactTies++
		for _, cd := range cs {
			if cd.score == in && cd.minDot < r.MinTieDot {
				r.MinTieDot, r.MinTieLayer, r.MinTieToken = cd.minDot, li, t
			}
		}
	}
	sel := make([]int, k)
	for i := range sel {
		sel[i] = cs[i].pos
	}
	slices.Sort(sel)
	return sel
}
