package kerneltest

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// randomSlots returns n distinct slots below pool, in increasing order
// (position order, as a paged pool hands them out).
func randomSlots(r *rand.Rand, n, pool int) []int32 {
	s := make([]int32, 0, n)
	for _, p := range r.Perm(pool)[:n] {
		s = append(s, int32(p))
	}
	slices.Sort(s)
	return s
}

func absAll(v []float32) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(math.Abs(float64(x)))
	}
	return out
}

type attnCase struct{ tokens, kvHeads, group, headDim, pool, maxSlots int }

func attentionCases(r *rand.Rand) []attnCase {
	var cs []attnCase
	for _, group := range []int{1, 2, 4} {
		for _, hd := range []int{1, 3, 8, 12, 16, 20, 48, 64} {
			pool := 1 + r.IntN(40)
			cs = append(cs, attnCase{1 + r.IntN(5), 1 + r.IntN(2), group, hd, pool, pool})
		}
	}
	// One slot only; then cases large enough to be split over threads,
	// whole blocks of 8 slots and a remainder, head dims with a tail.
	return append(cs, attnCase{2, 1, 2, 8, 1, 1}, attnCase{3, 2, 3, 48, 300, 300}, attnCase{40, 1, 4, 32, 64, 64},
		attnCase{4, 2, 2, 100, 200, 200}, attnCase{3, 1, 1, 136, 90, 90})
}

// attnKVTypes are the KV pool element types Attention is checked with.
var attnKVTypes = []kernels.DType{kernels.F32, kernels.BF16, kernels.F16}

// testAttention checks Attention over F32, BF16 and F16 pools. The pool
// values are drawn in float32 and stored as the pool stores them
// (kernels.EncodeKV); the reference reads the same stored values, and the
// bounds use them widened.
func testAttention(t *testing.T, b kernels.Backend) {
	for _, kt := range attnKVTypes {
		t.Run(kernels.KVName(kt), func(t *testing.T) { testAttentionKV(t, b, kt) })
	}
	t.Run("bad-type", func(t *testing.T) {
		for _, kt := range []kernels.DType{kernels.Q8_0, kernels.DType(9)} {
			a := kernels.AttentionArgs{
				Out: make([]float32, 8), Q: make([]float32, 8), K: make([]float32, 8), V: make([]float32, 8),
				K16: make([]uint16, 8), V16: make([]uint16, 8), KVType: kt,
				Slots: [][]int32{{0}}, NHeads: 1, NKVHeads: 1, HeadDim: 8, Scale: 1,
			}
			if !panics(func() { b.Attention(&a) }) {
				t.Errorf("Attention with KV type %v did not panic", kt)
			}
		}
	})
}

func panics(f func()) (p bool) {
	defer func() { p = recover() != nil }()
	f()
	return false
}

func testAttentionKV(t *testing.T, b kernels.Backend, kt kernels.DType) {
	rb := ref.New()
	r := newRand(21)
	for ci, tc := range attentionCases(r) {
		H, hd := tc.kvHeads*tc.group, tc.headDim
		c := newChecker(t, "%s case %d (tokens=%d heads=%d/%d headDim=%d pool=%d)", kernels.KVName(kt), ci, tc.tokens, H, tc.kvHeads, hd, tc.pool)
		kvDim, qDim := tc.kvHeads*hd, H*hd
		a := kernels.AttentionArgs{
			Q: make([]float32, tc.tokens*qDim), K: make([]float32, tc.pool*kvDim), V: make([]float32, tc.pool*kvDim),
			Slots: make([][]int32, tc.tokens), NHeads: H, NKVHeads: tc.kvHeads, HeadDim: hd,
			Scale: float32(1 / math.Sqrt(float64(hd))),
		}
		uniform(r, a.Q, 2)
		uniform(r, a.K, 2)
		uniform(r, a.V, 1)
		for i := range a.Slots {
			// Now and then a token with no slots (its output is zero).
			if tc.tokens > 1 && r.IntN(6) == 0 {
				a.Slots[i] = []int32{}
				continue
			}
			a.Slots[i] = randomSlots(r, 1+r.IntN(tc.maxSlots), tc.pool)
		}
		// f32 is the pool as float32: drawn, or stored and widened.
		f32 := a
		if kt != kernels.F32 {
			a.K16, a.V16 = make([]uint16, len(a.K)), make([]uint16, len(a.V))
			kernels.EncodeKV(a.K16, a.K, kt)
			kernels.EncodeKV(a.V16, a.V, kt)
			kernels.DecodeKV(f32.K, a.K16, kt)
			kernels.DecodeKV(f32.V, a.V16, kt)
			a.K, a.V, a.KVType = nil, nil, kt
		}
		want := make([]float32, tc.tokens*qDim)
		a.Out = want
		rb.Attention(&a)
		if kt != kernels.F32 {
			// The reference reads a 16-bit pool as the F32 pool of its
			// widened values.
			w32 := make([]float32, len(want))
			f32.Out = w32
			rb.Attention(&f32)
			for i := range want {
				c.same("ref 16-bit vs widened F32", i, want[i], w32[i])
			}
		}
		// Σ_j p_j·|v_jc|: the reference over |V| (the same probabilities).
		mag := make([]float32, len(want))
		av := f32
		av.V, av.Out = absAll(f32.V), mag
		rb.Attention(&av)

		q, k, v := slices.Clone(a.Q), slices.Clone(a.K), slices.Clone(a.V)
		k16, v16 := slices.Clone(a.K16), slices.Clone(a.V16)
		got := make([]float32, len(want))
		for i := range got {
			got[i] = float32(math.NaN()) // every element must be written
		}
		a.Out = got
		b.Attention(&a)
		unchanged(c, "Q", a.Q, q)
		unchanged(c, "K", a.K, k)
		unchanged(c, "V", a.V, v)
		unchanged(c, "K16", a.K16, k16)
		unchanged(c, "V16", a.V16, v16)
		for tok, slots := range a.Slots {
			for h := range H {
				// δ: the score bound.
				kvOff := h / tc.group * hd
				var smax float64
				for _, s := range slots {
					var sum float64
					for cc := range hd {
						sum += math.Abs(float64(a.Q[tok*qDim+h*hd+cc]) * float64(f32.K[int(s)*kvDim+kvOff+cc]))
					}
					smax = max(smax, sum)
				}
				delta := matMulRel[kernels.F32] * math.Sqrt(float64(hd)) * float64(a.Scale) * smax
				for cc := range hd {
					i := tok*qDim + h*hd + cc
					if len(slots) == 0 {
						c.same("out (no slots)", i, got[i], 0)
						continue
					}
					tol := (2*delta+attnRel*math.Sqrt(float64(len(slots))))*float64(mag[i]) + tinyAbs
					c.near("out", i, got[i], want[i], tol)
				}
			}
		}
	}
}

type indexCase struct {
	dt                       kernels.IndexKDType
	tokens, heads, dim, pool int
}

func indexCases(r *rand.Rand) []indexCase {
	var cs []indexCase
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, dim := range []int{1, 8, 13, 32, 64} {
			for range 2 {
				cs = append(cs, indexCase{dt, 1 + r.IntN(4), 1 + r.IntN(4), dim, 1 + r.IntN(60)})
			}
		}
		// Large enough to be split over threads (decode at long context).
		cs = append(cs, indexCase{dt, 1, 4, 32, 2000}, indexCase{dt, 30, 4, 32, 40})
	}
	return cs
}

// makeKeys quantizes pool random keys of dim elements as the indexer
// stores them.
func makeKeys(r *rand.Rand, dt kernels.IndexKDType, pool, dim int) *kernels.IndexKeys {
	rb := ref.New()
	keys := &kernels.IndexKeys{DType: dt, Dim: dim}
	v := make([]float32, pool*dim)
	uniform(r, v, 3)
	switch dt {
	case kernels.IndexFP8:
		keys.FP8 = make([]uint8, pool*dim)
		keys.Scales = make([]float32, pool)
		for s := range pool {
			keys.Scales[s] = rb.QuantizeFP8(keys.FP8[s*dim:(s+1)*dim], v[s*dim:(s+1)*dim])
		}
	case kernels.IndexBF16:
		keys.BF16 = make([]uint16, pool*dim)
		rb.ToBF16(keys.BF16, v)
	}
	return keys
}

// absKeys drops the sign of every key element.
func absKeys(k *kernels.IndexKeys) *kernels.IndexKeys {
	out := *k
	out.FP8 = make([]uint8, len(k.FP8))
	for i, c := range k.FP8 {
		out.FP8[i] = c &^ 0x80
	}
	out.BF16 = make([]uint16, len(k.BF16))
	for i, h := range k.BF16 {
		out.BF16[i] = h &^ 0x8000
	}
	return &out
}

func testIndexScore(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(22)
	for ci, tc := range indexCases(r) {
		c := newChecker(t, "case %d (%v tokens=%d heads=%d dim=%d pool=%d)", ci, tc.dt, tc.tokens, tc.heads, tc.dim, tc.pool)
		a := kernels.IndexScoreArgs{
			Q: make([]float32, tc.tokens*tc.heads*tc.dim), W: make([]float32, tc.tokens*tc.heads),
			Keys: makeKeys(r, tc.dt, tc.pool, tc.dim), Slots: make([][]int32, tc.tokens), NHeads: tc.heads,
		}
		uniform(r, a.Q, 1)
		uniform(r, a.W, 1)
		for i := range a.Slots {
			a.Slots[i] = randomSlots(r, 1+r.IntN(tc.pool), tc.pool)
		}
		alloc := func() [][]float32 {
			out := make([][]float32, tc.tokens)
			for i, s := range a.Slots {
				out[i] = make([]float32, len(s))
			}
			return out
		}
		want, mag, got := alloc(), alloc(), alloc()
		a.Out = want
		rb.IndexScore(&a)
		am := a
		am.Q, am.W, am.Keys, am.Out = absAll(a.Q), absAll(a.W), absKeys(a.Keys), mag
		rb.IndexScore(&am)
		a.Out = got
		b.IndexScore(&a)
		rel := matMulRel[kernels.F32]*math.Sqrt(float64(tc.dim)) + indexRel
		for tok := range want {
			for j := range want[tok] {
				c.near("out", tok*1000000+j, got[tok][j], want[tok][j], rel*float64(mag[tok][j]))
			}
		}
	}
}

func testTopK(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(23)
	nan := float32(math.NaN())
	inf := float32(math.Inf(1))
	kinds := []string{"random", "ties", "nan", "special"}
	for _, n := range []int{0, 1, 2, 7, 64, 100, 1000} {
		for _, kind := range kinds {
			scores := make([]float32, n)
			for i := range scores {
				switch kind {
				case "random":
					scores[i] = r.Float32()*2 - 1
				case "ties":
					scores[i] = float32(r.IntN(4))
				case "nan":
					scores[i] = float32(r.IntN(3))
					if r.IntN(3) == 0 {
						scores[i] = nan
					}
				case "special":
					scores[i] = []float32{nan, inf, -inf, 0, float32(math.Copysign(0, -1)), 1, -1, math.MaxFloat32}[r.IntN(8)]
				}
			}
			for _, k := range []int{0, 1, 3, 64, n - 1, n, n + 5} {
				if k < 0 {
					continue
				}
				c := newChecker(t, "%s n=%d k=%d", kind, n, k)
				want := rb.TopK(nil, scores, k)
				orig := slices.Clone(scores)
				got := b.TopK(make([]int32, 0, max(k, 0)), scores, k)
				unchanged(c, "scores", scores, orig)
				if !slices.Equal(got, want) {
					c.fail("got %v, want %v", got, want)
				}
				if got2 := b.TopK(nil, scores, k); !slices.Equal(got2, want) {
					c.fail("with a nil dst: got %v, want %v", got2, want)
				}
			}
		}
	}
}

func testQuantizeFP8(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(24)
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	fills := map[string]func(v []float32){
		"random": func(v []float32) { uniform(r, v, 5) },
		"zero":   func(v []float32) { clear(v) },
		"huge":   func(v []float32) { uniform(r, v, 3e38) },
		"tiny":   func(v []float32) { uniform(r, v, 1e-40) },
		"wide": func(v []float32) {
			for i := range v {
				v[i] = (2*r.Float32() - 1) * float32(math.Pow(10, float64(r.IntN(20)-10)))
			}
		},
		"inf": func(v []float32) {
			uniform(r, v, 5)
			v[len(v)/2] = -inf
		},
		"nan": func(v []float32) {
			uniform(r, v, 5)
			v[len(v)/2] = nan
		},
		"grid": func(v []float32) { // values on and between e4m3 codes after scaling
			for i := range v {
				v[i] = kernels.FP8ToF32(uint8(r.IntN(0x7F)))
				if r.IntN(2) == 0 {
					v[i] = (v[i] + kernels.FP8ToF32(uint8(r.IntN(0x7F)))) / 2
				}
			}
			v[0] = kernels.FP8Max
		},
	}
	for name, fill := range fills {
		for _, n := range []int{1, 7, 8, 32, 100} {
			c := newChecker(t, "%s n=%d", name, n)
			src := make([]float32, n)
			fill(src)
			want, got := make([]uint8, n), make([]uint8, n)
			ws := rb.QuantizeFP8(want, src)
			gs := b.QuantizeFP8(got, src)
			c.same("scale", 0, gs, ws)
			if !slices.Equal(got, want) {
				c.fail("codes %x, want %x", got, want)
			}
		}
	}
	var empty []uint8
	c := newChecker(t, "empty")
	c.same("scale", 0, b.QuantizeFP8(empty, nil), rb.QuantizeFP8(empty, nil))
}

func testDequantizeFP8(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	src := make([]uint8, 256+5)
	for i := range src {
		src[i] = uint8(i * 7)
	}
	for _, scale := range []float32{1, 0.5, 3.7e-3, 1e30, 1e-40} {
		for _, n := range []int{0, 1, 9, len(src)} {
			c := newChecker(t, "scale=%v n=%d", scale, n)
			want, got := make([]float32, n), make([]float32, n)
			rb.DequantizeFP8(want, src[:n], scale)
			b.DequantizeFP8(got, src[:n], scale)
			for i := range want {
				c.same("dst", i, got[i], want[i])
			}
		}
	}
}

func testToBF16(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(25)
	src := make([]float32, 4099)
	for i := range src {
		switch i % 4 {
		case 0: // any bits: NaNs, infinities, subnormals
			src[i] = math.Float32frombits(r.Uint32())
		case 1: // exact ties: the dropped half is 0x8000
			src[i] = math.Float32frombits(r.Uint32()&^0xFFFF | 0x8000)
		default:
			src[i] = (2*r.Float32() - 1) * 100
		}
	}
	for _, n := range []int{0, 1, 9, len(src)} {
		c := newChecker(t, "n=%d", n)
		want, got := make([]uint16, n), make([]uint16, n)
		rb.ToBF16(want, src[:n])
		b.ToBF16(got, src[:n])
		if !slices.Equal(got, want) {
			for i := range want {
				if got[i] != want[i] {
					c.fail("dst[%d] = %#04x, want %#04x (src %#08x)", i, got[i], want[i], math.Float32bits(src[i]))
				}
			}
		}
	}
}

func testFromBF16(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	src := make([]uint16, 1<<16+3)
	for i := range src {
		src[i] = uint16(i)
	}
	for _, n := range []int{0, 1, 9, len(src)} {
		c := newChecker(t, "n=%d", n)
		want, got := make([]float32, n), make([]float32, n)
		rb.FromBF16(want, src[:n])
		b.FromBF16(got, src[:n])
		for i := range want {
			c.same("dst", i, got[i], want[i])
		}
	}
}
