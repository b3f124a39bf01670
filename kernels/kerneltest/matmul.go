package kerneltest

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// newRand is the suite's seeded source: a failure names its seed.
func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }

// uniform fills v with values in (-scale, scale).
func uniform(r *rand.Rand, v []float32, scale float32) {
	for i := range v {
		v[i] = (2*r.Float32() - 1) * scale
	}
}

// EncodeMatrix encodes rows×cols float32 values (row-major) as a dtype
// matrix: the weights a test model would load. Q8_0 needs cols % 32 == 0.
func EncodeMatrix(d kernels.DType, rows, cols int, v []float32) *kernels.Matrix {
	rb, err := kernels.RowBytes(d, cols)
	if err != nil {
		panic(err)
	}
	var data []byte
	switch d {
	case kernels.F32:
		f := make([]float32, rows*cols)
		copy(f, v)
		data = kernels.F32Bytes(f)
	case kernels.F16, kernels.BF16:
		data = make([]byte, rb*rows)
		for i, x := range v[:rows*cols] {
			h := kernels.F32ToF16(x)
			if d == kernels.BF16 {
				h = kernels.F32ToBF16(x)
			}
			data[2*i], data[2*i+1] = byte(h), byte(h>>8)
		}
	case kernels.Q8_0:
		data = make([]byte, rb*rows)
		for r := range rows {
			kernels.QuantizeQ8Row(data[r*rb:(r+1)*rb], v[r*cols:(r+1)*cols])
		}
	}
	m, err := kernels.NewMatrix(d, rows, cols, data)
	if err != nil {
		panic(err)
	}
	return m
}

type mmCase struct{ m, n, k int }

// matMulCases: every small shape class (one x row, two, a 3-row tile and
// leftovers; W rows not a multiple of 4 or 8; k below 8, not a multiple of
// 8, or of 32 for Q8_0), then a few large enough to be split over threads.
func matMulCases(d kernels.DType, r *rand.Rand) []mmCase {
	ks := []int{1, 3, 8, 9, 16, 31, 40, 100, 288}
	if d == kernels.Q8_0 {
		ks = []int{32, 64, 96, 288}
	}
	ns := []int{1, 2, 5, 8, 9, 13, 33, 67}
	ms := []int{1, 2, 3, 4, 5, 7, 33}
	var cs []mmCase
	for _, k := range ks {
		for range 6 {
			cs = append(cs, mmCase{ms[r.IntN(len(ms))], ns[r.IntN(len(ns))], k})
		}
	}
	k := 288
	if d != kernels.Q8_0 {
		k = 100
	}
	return append(cs, mmCase{1, 1000, 288}, mmCase{2, 777, k}, mmCase{37, 101, k}, mmCase{64, 24, 96}, mmCase{200, 3, 64})
}

func testMatMul(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16, kernels.Q8_0} {
		seed := uint64(d) + 1
		r := newRand(seed)
		for ci, tc := range matMulCases(d, r) {
			m, n, k := tc.m, tc.n, tc.k
			c := newChecker(t, "%v seed %d case %d (m=%d n=%d k=%d)", d, seed, ci, m, n, k)
			wv := make([]float32, n*k)
			uniform(r, wv, 1)
			if n > 2 {
				clear(wv[k : 2*k]) // a zero row
				for i := range k { // a row of fp16 subnormals and tiny values
					wv[2*k+i] *= 1e-6
				}
			}
			w := EncodeMatrix(d, n, k, wv)
			x := make([]float32, m*k)
			uniform(r, x, 2)
			if m > 1 {
				clear(x[:k])
			}
			want := make([]float32, m*n)
			rb.MatMul(want, x, w, m)

			const pad = 8
			got := make([]float32, m*n+pad)
			for i := range got {
				got[i] = -12345
			}
			xc, wc := append([]float32(nil), x...), append([]byte(nil), w.Data...)
			b.MatMul(got, x, w, m)
			unchanged(c, "x", x, xc)
			unchanged(c, "W", w.Data, wc)
			for i := m * n; i < len(got); i++ {
				if got[i] != -12345 {
					c.fail("wrote dst[%d] past m·n = %d", i, m*n)
				}
			}
			dec := make([]float32, k)
			for row := range n {
				w.DecodeRow(dec, row)
				for i := range m {
					var mag float64
					for cc, v := range dec {
						mag += math.Abs(float64(x[i*k+cc]) * float64(v))
					}
					c.near("dst", i*n+row, got[i*n+row], want[i*n+row], matMulRel[d]*math.Sqrt(float64(k))*mag)
				}
			}
		}
	}
}

func testRMSNorm(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(11)
	for _, n := range []int{1, 7, 8, 64, 288, 301} {
		for _, rows := range []int{1, 3, 33} {
			c := newChecker(t, "rows=%d n=%d", rows, n)
			x := make([]float32, rows*n)
			for i := range rows {
				uniform(r, x[i*n:(i+1)*n], float32(math.Pow(10, float64(r.IntN(7)-3))))
			}
			if rows > 1 {
				clear(x[n : 2*n])
			}
			weight := make([]float32, n)
			uniform(r, weight, 2)
			eps := float32(1e-5)
			want := make([]float32, rows*n)
			got := make([]float32, rows*n)
			rb.RMSNorm(want, x, weight, rows, eps)
			b.RMSNorm(got, x, weight, rows, eps)
			for i := range want {
				c.near("dst", i, got[i], want[i], normRel*math.Abs(float64(want[i])))
			}
		}
	}
}

func testRoPE(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(12)
	for _, hd := range []int{2, 8, 48, 64} {
		for _, rd := range []int{hd, hd / 2 &^ 1} {
			if rd < 2 {
				continue
			}
			for _, tc := range []struct{ tokens, heads int }{{1, 1}, {3, 2}, {17, 6}} {
				theta := []float32{10000, 500000}[r.IntN(2)]
				c := newChecker(t, "tokens=%d heads=%d headDim=%d ropeDim=%d theta=%v", tc.tokens, tc.heads, hd, rd, theta)
				x := make([]float32, tc.tokens*tc.heads*hd)
				uniform(r, x, 3)
				pos := make([]int32, tc.tokens)
				for i := range pos {
					pos[i] = int32(r.IntN(8192))
				}
				pos[0] = 0
				want, got := append([]float32(nil), x...), append([]float32(nil), x...)
				rb.RoPE(want, pos, tc.heads, hd, rd, theta)
				b.RoPE(got, pos, tc.heads, hd, rd, theta)
				for i := range want {
					p := i &^ 1
					mag := math.Abs(float64(x[p])) + math.Abs(float64(x[p+1]))
					c.near("x", i, got[i], want[i], ropeRel*mag)
				}
			}
		}
	}
}

func testSwiGLU(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(13)
	for _, n := range []int{0, 1, 7, 100, 5000} {
		c := newChecker(t, "n=%d", n)
		gate, up := make([]float32, n), make([]float32, n)
		uniform(r, gate, 20)
		uniform(r, up, 3)
		for i := 0; i < n; i += 17 {
			gate[i] = float32(100 - 200*(i/17%2))
		}
		want, got := make([]float32, n), make([]float32, n)
		rb.SwiGLU(want, gate, up)
		b.SwiGLU(got, gate, up)
		for i := range want {
			c.near("dst", i, got[i], want[i], expRel*math.Abs(float64(want[i]))+tinyAbs)
		}
	}
}

func testSoftmax(t *testing.T, b kernels.Backend) {
	rb := ref.New()
	r := newRand(14)
	for _, cols := range []int{1, 2, 7, 100, 1000} {
		for _, rows := range []int{1, 3, 10} {
			c := newChecker(t, "rows=%d cols=%d", rows, cols)
			x := make([]float32, rows*cols)
			uniform(r, x, 10)
			if cols > 1 {
				x[cols/2] = float32(math.Inf(-1))
			}
			want, got := append([]float32(nil), x...), append([]float32(nil), x...)
			rb.Softmax(want, rows, cols)
			b.Softmax(got, rows, cols)
			for i := range want {
				c.near("x", i, got[i], want[i], softmaxRel*math.Abs(float64(want[i]))+softmaxAbs)
			}
		}
	}
}
