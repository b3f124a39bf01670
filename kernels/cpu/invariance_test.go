package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/kerneltest"
)

// TestInvariance checks the batch- and thread-invariance promise bit for
// bit: an output computed for one row (token) alone equals the same output
// computed inside a batch of 33, for 1, 2 and 3 threads, with calls split
// as usual and split as finely as allowed. Each kernel set is checked on
// its own (the assembly and the portable kernels round differently), and
// the AVX2 kernels alone too where AVX-512 ones replace some of them.
func TestInvariance(t *testing.T) {
	for _, set := range kernelSetsUnderTest() {
		portable := set == "portable"
		var variants []*Backend
		for _, threads := range []int{1, 2, 3} {
			for _, split := range []bool{false, true} {
				b := testBackend(threads, set)
				if split {
					b.minWork = 1
				}
				variants = append(variants, b)
			}
		}
		t.Run(set, func(t *testing.T) {
			t.Run("MatMul", func(t *testing.T) { invMatMul(t, variants, portable) })
			t.Run("Attention", func(t *testing.T) { invAttention(t, variants) })
			t.Run("IndexScore", func(t *testing.T) { invIndexScore(t, variants) })
			t.Run("RowOps", func(t *testing.T) { invRowOps(t, variants) })
		})
		for _, b := range variants {
			b.Close()
		}
	}
}

func vname(b *Backend) string { return fmt.Sprintf("threads=%d minWork=%d", b.threads, b.minWork) }

// sameBits reports the first index where got and want differ in bits.
func sameBits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Errorf("%s: [%d] = %v (%#08x), want %v (%#08x)", what, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
			return
		}
	}
}

func randVec(r *rand.Rand, n int, scale float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = (2*r.Float32() - 1) * scale
	}
	return v
}

func invMatMul(t *testing.T, variants []*Backend, portable bool) {
	r := rand.New(rand.NewPCG(1, 2))
	const m = 33
	for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16, kernels.Q8_0} {
		k := 100 // not a multiple of 8: the tails too
		if d == kernels.Q8_0 {
			k = 96
		}
		shapes := []int{20, 203} // few panels (split over x rows too), many
		if !portable {
			shapes = append(shapes, 1000)
		}
		for _, n := range shapes {
			w := kerneltest.EncodeMatrix(d, n, k, randVec(r, n*k, 1))
			x := randVec(r, m*k, 2)
			want := make([]float32, m*n)
			variants[0].MatMul(want, x, w, m)
			for _, b := range variants {
				what := fmt.Sprintf("%v n=%d k=%d %s", d, n, k, vname(b))
				got := make([]float32, m*n)
				b.MatMul(got, x, w, m)
				sameBits(t, what+" batch", got, want)
				one := make([]float32, n)
				for i := range m {
					b.MatMul(one, x[i*k:(i+1)*k], w, 1)
					sameBits(t, fmt.Sprintf("%s row %d alone", what, i), one, want[i*n:(i+1)*n])
				}
				// Sub-batches that start mid-tile.
				for _, sb := range [][2]int{{1, 3}, {5, 9}, {7, 31}} {
					part := make([]float32, (sb[1]-sb[0])*n)
					b.MatMul(part, x[sb[0]*k:sb[1]*k], w, sb[1]-sb[0])
					sameBits(t, fmt.Sprintf("%s rows %d..%d", what, sb[0], sb[1]), part, want[sb[0]*n:sb[1]*n])
				}
			}
		}
	}
}

func invAttention(t *testing.T, variants []*Backend) {
	for _, kt := range []kernels.DType{kernels.F32, kernels.BF16, kernels.F16} {
		t.Run(kernels.KVName(kt), func(t *testing.T) { invAttentionKV(t, variants, kt) })
	}
}

func invAttentionKV(t *testing.T, variants []*Backend, kt kernels.DType) {
	r := rand.New(rand.NewPCG(3, 4))
	const tokens, pool = 33, 150
	for _, shape := range []struct{ kv, group, hd int }{{2, 3, 48}, {1, 4, 20}, {2, 1, 64}, {1, 2, 3}} {
		H := shape.kv * shape.group
		qDim, kvDim := H*shape.hd, shape.kv*shape.hd
		a := kernels.AttentionArgs{
			Q: randVec(r, tokens*qDim, 2), K: randVec(r, pool*kvDim, 2), V: randVec(r, pool*kvDim, 1),
			Slots: make([][]int32, tokens), NHeads: H, NKVHeads: shape.kv, HeadDim: shape.hd,
			Scale: float32(1 / math.Sqrt(float64(shape.hd))),
		}
		if kt != kernels.F32 {
			a.K16, a.V16 = make([]uint16, len(a.K)), make([]uint16, len(a.V))
			kernels.EncodeKV(a.K16, a.K, kt)
			kernels.EncodeKV(a.V16, a.V, kt)
			a.K, a.V, a.KVType = nil, nil, kt
		}
		for i := range a.Slots {
			a.Slots[i] = make([]int32, 1+r.IntN(pool))
			for j := range a.Slots[i] {
				a.Slots[i][j] = int32(r.IntN(pool))
			}
		}
		want := make([]float32, tokens*qDim)
		a.Out = want
		variants[0].Attention(&a)
		for _, b := range variants {
			what := fmt.Sprintf("%v heads=%d/%d hd=%d %s", kt, H, shape.kv, shape.hd, vname(b))
			got := make([]float32, tokens*qDim)
			a2 := a
			a2.Out = got
			b.Attention(&a2)
			sameBits(t, what+" batch", got, want)
			for i := range tokens {
				one := a
				one.Q, one.Slots, one.Out = a.Q[i*qDim:(i+1)*qDim], a.Slots[i:i+1], make([]float32, qDim)
				b.Attention(&one)
				sameBits(t, fmt.Sprintf("%s token %d alone", what, i), one.Out, want[i*qDim:(i+1)*qDim])
			}
		}
	}
}

func invIndexScore(t *testing.T, variants []*Backend) {
	r := rand.New(rand.NewPCG(5, 6))
	const tokens, pool, H = 33, 400, 4
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, dim := range []int{32, 20} {
			keys := &kernels.IndexKeys{DType: dt, Dim: dim}
			kv := randVec(r, pool*dim, 3)
			if dt == kernels.IndexFP8 {
				keys.FP8, keys.Scales = make([]uint8, pool*dim), make([]float32, pool)
				for s := range pool {
					keys.Scales[s] = variants[0].QuantizeFP8(keys.FP8[s*dim:(s+1)*dim], kv[s*dim:(s+1)*dim])
				}
			} else {
				keys.BF16 = make([]uint16, pool*dim)
				variants[0].ToBF16(keys.BF16, kv)
			}
			a := kernels.IndexScoreArgs{Q: randVec(r, tokens*H*dim, 1), W: randVec(r, tokens*H, 1), Keys: keys, Slots: make([][]int32, tokens), NHeads: H}
			for i := range a.Slots {
				a.Slots[i] = make([]int32, 1+r.IntN(pool))
				for j := range a.Slots[i] {
					a.Slots[i][j] = int32(r.IntN(pool))
				}
			}
			alloc := func(slots [][]int32) [][]float32 {
				out := make([][]float32, len(slots))
				for i, s := range slots {
					out[i] = make([]float32, len(s))
				}
				return out
			}
			want := alloc(a.Slots)
			a.Out = want
			variants[0].IndexScore(&a)
			for _, b := range variants {
				what := fmt.Sprintf("%v dim=%d %s", dt, dim, vname(b))
				a2 := a
				a2.Out = alloc(a.Slots)
				b.IndexScore(&a2)
				for i := range tokens {
					sameBits(t, fmt.Sprintf("%s batch token %d", what, i), a2.Out[i], want[i])
					one := a
					one.Q, one.W, one.Slots, one.Out = a.Q[i*H*dim:(i+1)*H*dim], a.W[i*H:(i+1)*H], a.Slots[i:i+1], alloc(a.Slots[i:i+1])
					b.IndexScore(&one)
					sameBits(t, fmt.Sprintf("%s token %d alone", what, i), one.Out[0], want[i])
				}
			}
		}
	}
}

func invRowOps(t *testing.T, variants []*Backend) {
	r := rand.New(rand.NewPCG(7, 8))
	const rows, n = 33, 301
	x := randVec(r, rows*n, 3)
	u := randVec(r, rows*n, 3)
	weight := randVec(r, n, 2)
	const heads, hd, rd = 6, 48, 32
	xr := randVec(r, rows*heads*hd, 3)
	pos := make([]int32, rows)
	for i := range pos {
		pos[i] = int32(r.IntN(4096))
	}
	type op struct {
		name string
		run  func(b *Backend, lo, hi int) []float32
	}
	ops := []op{
		{"RMSNorm", func(b *Backend, lo, hi int) []float32 {
			out := make([]float32, (hi-lo)*n)
			b.RMSNorm(out, x[lo*n:hi*n], weight, hi-lo, 1e-5)
			return out
		}},
		{"Softmax", func(b *Backend, lo, hi int) []float32 {
			out := slices.Clone(x[lo*n : hi*n])
			b.Softmax(out, hi-lo, n)
			return out
		}},
		{"SwiGLU", func(b *Backend, lo, hi int) []float32 {
			out := make([]float32, (hi-lo)*n)
			b.SwiGLU(out, x[lo*n:hi*n], u[lo*n:hi*n])
			return out
		}},
		{"RoPE", func(b *Backend, lo, hi int) []float32 {
			out := slices.Clone(xr[lo*heads*hd : hi*heads*hd])
			b.RoPE(out, pos[lo:hi], heads, hd, rd, 10000)
			return out
		}},
	}
	for _, o := range ops {
		want := o.run(variants[0], 0, rows)
		per := len(want) / rows
		for _, b := range variants {
			sameBits(t, o.name+" batch "+vname(b), o.run(b, 0, rows), want)
			for i := range rows {
				sameBits(t, fmt.Sprintf("%s row %d alone %s", o.name, i, vname(b)), o.run(b, i, i+1), want[i*per:(i+1)*per])
			}
		}
	}
}
