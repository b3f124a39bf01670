//go:build amd64

package cpu

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

// fma32 is a·b + c rounded once to float32 (nearest even), as
// VFMADD231PS computes it: the exact value in a big.Float (float32
// products and sums need well under 1024 bits), then one rounding.
func fma32(a, b, c float32) float32 {
	x := new(big.Float).SetPrec(1024).SetFloat64(float64(a))
	x.Mul(x, new(big.Float).SetFloat64(float64(b)))
	x.Add(x, new(big.Float).SetFloat64(float64(c)))
	if x.Sign() == 0 {
		// Exact zero: +0 unless both the product and c are -0 (IEEE).
		if math.Signbit(float64(a)) != math.Signbit(float64(b)) && math.Signbit(float64(c)) {
			return float32(math.Copysign(0, -1))
		}
		return 0
	}
	f, _ := x.Float32()
	return f
}

// The model of the kernels' arithmetic: the order of goAttnQK16 and
// goAttnPV16 (the portable set), each product and sum fused into one
// rounding, as the assembly does.
func modelQK(c *attn16Case, scale float32) []float32 {
	out := make([]float32, len(c.slots)&^7)
	d := 8 * c.n8
	for j := range out {
		row := c.kw[int(c.slots[j])*c.rowLen+c.off:][:d]
		var a [8]float32
		for i, v := range row {
			a[i%8] = fma32(c.q[i], v, a[i%8])
		}
		out[j] = hsum8(&a) * scale
	}
	return out
}

func modelPV(c *attn16Case) []float32 {
	out := make([]float32, 8*c.n8)
	for j, s := range c.slots {
		row := c.vw[int(s)*c.rowLen+c.off:][:len(out)]
		for i, v := range row {
			out[i] = fma32(c.p[j], v, out[i])
		}
	}
	return out
}

// TestAttn16AsmMatchesModel checks the assembly 16-bit attention kernels
// bit for bit against the Go model of the portable kernels' order with
// fused multiply-adds, and against the portable kernels themselves within
// the bound that separate rounding of the products allows: both sum the
// same terms in the same order, so each result is within γ_n·Σ|terms| of
// the exact sum (γ_n = n·u/(1−n·u), u = 2^-24, n terms per sum plus the
// lane tree), and the two are within twice that of each other.
func TestAttn16AsmMatchesModel(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	asm, gen := avx2Kernels(), genericKernels()
	r := rand.New(rand.NewPCG(18, 18))
	for _, c := range attn16Cases(r) {
		sameBits(t, "asm QK vs fma model "+c.String(), c.qk16(asm), modelQK(c, 0.3))
		sameBits(t, "asm PV vs fma model "+c.String(), c.pv16(asm), modelPV(c))

		got, want := c.qk16(asm), c.qk16(gen)
		for j := range want {
			row := c.kw[int(c.slots[j])*c.rowLen+c.off:][:8*c.n8]
			var sum float64
			for i, v := range row {
				sum += math.Abs(float64(c.q[i]) * float64(v))
			}
			within(t, "asm QK vs portable "+c.String(), j, got[j], want[j], 0.3*sum*gamma(c.n8+3))
		}
		got, want = c.pv16(asm), c.pv16(gen)
		for i := range want {
			var sum float64
			for j, s := range c.slots {
				sum += math.Abs(float64(c.p[j]) * float64(c.vw[int(s)*c.rowLen+c.off+i]))
			}
			within(t, "asm PV vs portable "+c.String(), i, got[i], want[i], sum*gamma(len(c.slots)))
		}
	}
}

// gamma is twice γ_n, plus an ulp of the final product by the scale.
func gamma(n int) float64 {
	u := 0x1p-24
	return 2*float64(n+1)*u/(1-float64(n+1)*u) + u
}

func within(t *testing.T, what string, i int, got, want float32, tol float64) {
	t.Helper()
	if d := math.Abs(float64(got) - float64(want)); !(d <= tol) {
		t.Errorf("%s: [%d] = %v, want %v (|Δ| = %.3g > %.3g)", what, i, got, want, d, tol)
	}
}
