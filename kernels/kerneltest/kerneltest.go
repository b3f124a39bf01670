// Package kerneltest is the conformance suite of kernels.Backend: Run checks
// every op of a backend against the plain-Go reference (kernels/ref) on
// seeded random cases of many shapes, including the awkward ones (odd
// lengths, edge tiles, one-slot attention, ties and NaN in TopK, zero rows
// and huge values in FP8 quantization).
//
// Exact conversions (FP8, BF16) and TopK must match bit for bit. Ops that sum
// may round differently from the reference; each has a bound, stated in the
// table below, relative to the size of what was summed rather than to the
// result (which may have cancelled to near zero).
package kerneltest

import (
	"fmt"
	"math"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

// Tolerances: the largest |got − want| a backend may show against the
// reference.
//
//	op          bound
//	MatMul      matMulRel[dtype]·√k·Σ_c|x_c·w_c|
//	RMSNorm     normRel·|want|
//	RoPE        ropeRel·(|a|+|b|), a and b the input pair
//	SwiGLU      expRel·|want| + tinyAbs
//	Softmax     softmaxRel·|want| + softmaxAbs
//	Attention   (2·δ + attnRel·√n)·Σ_j p_j·|v_jc| + tinyAbs, with n the slot count and
//	            δ = matMulRel[F32]·√d·Scale·max_j Σ_c|q_c·k_jc| the bound on a score
//	IndexScore  (matMulRel[F32]·√d + indexRel)·Σ_h |w_h|·Σ_c|q_hc·k_c|
//	TopK, QuantizeFP8, DequantizeFP8, ToBF16, FromBF16: exact (NaN matches any NaN
//	where the result is a float)
//
// MatMul: 1e-5·√k is loose enough for any summation order and an FMA or
// not (the worst case of two float32 sums of k terms differs by about
// 2k·2^-24·Σ|x·w|, under 1e-5·√k·Σ|x·w| for k < 19000) and tight enough to
// see a lost or doubled term. F16, BF16 and Q8_0 weights decode to float32
// exactly (a Q8_0 weight is an fp16 scale times an int8: 19 significant bits
// at most), so every dtype has the same bound: what differs between backends
// is the order of the sum only.
var matMulRel = map[kernels.DType]float64{
	kernels.F32:  1e-5,
	kernels.F16:  1e-5,
	kernels.BF16: 1e-5,
	kernels.Q8_0: 1e-5,
}

const (
	normRel    = 1e-6 // RMSNorm: the float32 scale may differ by an ulp or two
	ropeRel    = 2e-6 // RoPE: sin and cos to float32, two products and a sum
	expRel     = 1e-6 // SwiGLU: exp to a few ulps, a division and a product
	softmaxRel = 1e-5 // Softmax: exp to a few ulps and a sum of up to ~1000 terms
	softmaxAbs = 1e-9 // Softmax: values that underflow
	attnRel    = 1e-5 // Attention: the value sum, per √(slot count)
	indexRel   = 1e-6 // IndexScore: the sum over heads
	tinyAbs    = 1e-37
)

// Run checks every op of b against the reference.
func Run(t *testing.T, b kernels.Backend) {
	t.Helper()
	t.Run("MatMul", func(t *testing.T) { testMatMul(t, b) })
	t.Run("RMSNorm", func(t *testing.T) { testRMSNorm(t, b) })
	t.Run("RoPE", func(t *testing.T) { testRoPE(t, b) })
	t.Run("SwiGLU", func(t *testing.T) { testSwiGLU(t, b) })
	t.Run("Softmax", func(t *testing.T) { testSoftmax(t, b) })
	t.Run("Attention", func(t *testing.T) { testAttention(t, b) })
	t.Run("IndexScore", func(t *testing.T) { testIndexScore(t, b) })
	t.Run("TopK", func(t *testing.T) { testTopK(t, b) })
	t.Run("QuantizeFP8", func(t *testing.T) { testQuantizeFP8(t, b) })
	t.Run("DequantizeFP8", func(t *testing.T) { testDequantizeFP8(t, b) })
	t.Run("ToBF16", func(t *testing.T) { testToBF16(t, b) })
	t.Run("FromBF16", func(t *testing.T) { testFromBF16(t, b) })
}

// checker reports at most a few mismatches per case.
type checker struct {
	t    *testing.T
	name string
	bad  int
}

const maxReports = 5

func newChecker(t *testing.T, format string, args ...any) *checker {
	return &checker{t: t, name: fmt.Sprintf(format, args...)}
}

// near checks got against want within tol; NaN must meet NaN and an
// infinity the same infinity.
func (c *checker) near(what string, i int, got, want float32, tol float64) {
	g, w := float64(got), float64(want)
	var ok bool
	switch {
	case math.IsNaN(w):
		ok = math.IsNaN(g)
	case math.IsInf(w, 0):
		ok = g == w
	default:
		ok = math.Abs(g-w) <= tol
	}
	if !ok {
		c.fail("%s[%d] = %v, want %v (|Δ| = %.3g > tol %.3g)", what, i, got, want, math.Abs(g-w), tol)
	}
}

// same checks bit equality (any NaN meets any NaN).
func (c *checker) same(what string, i int, got, want float32) {
	if math.Float32bits(got) != math.Float32bits(want) && !(got != got && want != want) {
		c.fail("%s[%d] = %v (%#08x), want %v (%#08x)", what, i, got, math.Float32bits(got), want, math.Float32bits(want))
	}
}

func (c *checker) fail(format string, args ...any) {
	c.t.Helper()
	c.bad++
	if c.bad <= maxReports {
		c.t.Errorf("%s: "+format, append([]any{c.name}, args...)...)
	} else if c.bad == maxReports+1 {
		c.t.Errorf("%s: more mismatches not shown", c.name)
	}
}

// unchanged checks that a backend left an input as it was.
func unchanged[T comparable](c *checker, what string, got, orig []T) {
	for i := range orig {
		if got[i] != orig[i] && got[i] == got[i] {
			c.fail("input %s[%d] was modified", what, i)
			return
		}
	}
}
