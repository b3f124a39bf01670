//go:build amd64

package cpu

import (
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
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

// attn16Aheads are the prefetch distances the 16-bit attention tests run
// (attnAhead16): the default, off, short ones (13 is rounded down to 8 by
// the QK kernels) that prefetch in cases of few slots too, and long ones.
var attn16Aheads = []int{64, 0, 8, 13, 24, 32, 128}

// attn16PfCases are kernel-level cases over 16-bit pools whose slot counts
// reach over the prefetch distances from below and above, over every
// sequence of runs of columns the value kernels split a head into. Every
// other case has its heads start cache lines (the pool 64-byte aligned,
// rows and offset multiples of 32 elements), where the kernels prefetch no
// row's last byte apart; the others mostly not.
func attn16PfCases(r *rand.Rand) []*attn16Case {
	var cs []*attn16Case
	for _, d := range []kernels.DType{kernels.F16, kernels.BF16} {
		for _, n8 := range []int{1, 2, 3, 4, 5, 6, 7, 9, 14, 16, 17} {
			for i, ns := range []int{1, 8, 23, 33, 64, 65, 72, 73, 129, 300, 1, 8, 23, 33, 64, 65, 72, 73, 129, 300} {
				c := &attn16Case{d: d, pool: 37, n8: n8}
				c.off = 8 * r.IntN(3)
				c.rowLen = c.off + 8*n8 + r.IntN(3)
				if i%2 == 1 {
					c.off = 32 * r.IntN(2)
					c.rowLen = (c.off + 8*n8 + 31) &^ 31
				}
				c.k16 = lineAligned(rand16(r, c.pool*c.rowLen, d))
				c.v16 = lineAligned(rand16(r, c.pool*c.rowLen, d))
				c.kw, c.vw = widen(c.k16, d), widen(c.v16, d)
				c.draw(r, ns)
				cs = append(cs, c)
			}
		}
	}
	return cs
}

// TestAttn16PrefetchMatchesModel pins the assembly 16-bit attention
// kernels bit for bit to the exact FMA model with the row prefetch at
// every distance in attn16Aheads, on rows that start cache lines and rows
// that need not: the prefetch must change no bit.
func TestAttn16PrefetchMatchesModel(t *testing.T) {
	r := rand.New(rand.NewPCG(19, 19))
	asmMatchesModel(t, attn16PfCases(r), &attnAhead16, attn16Aheads, (*attn16Case).qk16, (*attn16Case).pv16)
}

// BenchmarkAttn16Cached runs the 16-bit attention kernels alone on rows
// that are all in cache (1024 slots over a pool of 512 rows, scattered),
// where their row prefetch can only cost, each call alternating with the
// F32 kernel without prefetch on the widened rows: vs-f32 is the 16-bit
// time over the F32 one. PD_ATTN_AHEAD16 sets the 16-bit distance.
func BenchmarkAttn16Cached(b *testing.B) {
	if !hasAVX2 {
		b.Skip("no AVX2/FMA")
	}
	setFromEnv(b, "PD_ATTN_AHEAD16", &attnAhead16)
	defer func(old int) { attnAhead = old }(attnAhead)
	asm := avx2Kernels()
	r := rand.New(rand.NewPCG(20, 20))
	const pool, ns = 512, 1024
	for _, d := range []kernels.DType{kernels.BF16, kernels.F16} {
		for _, n8 := range []int{6, 16} {
			c := &attn16Case{d: d, pool: pool, n8: n8, rowLen: 8 * n8}
			c.k16, c.v16 = lineAligned(rand16(r, pool*c.rowLen, d)), lineAligned(rand16(r, pool*c.rowLen, d))
			c.kw, c.vw = lineAligned(widen(c.k16, d)), lineAligned(widen(c.v16, d))
			c.q, c.p = randVec(r, 8*n8, 1), randVec(r, ns, 1)
			c.slots = make([]int32, ns)
			for j := range c.slots {
				c.slots[j] = int32(r.IntN(pool))
			}
			out := make([]float32, ns)
			for _, kern := range []string{"qk", "pv"} {
				b.Run(fmt.Sprintf("%v/hd=%d/%s", d, 8*n8, kern), func(b *testing.B) {
					var on, alt time.Duration
					for b.Loop() {
						t0 := time.Now()
						if kern == "qk" {
							asm.attnQK16[d](&out[0], &c.q[0], unsafe.Pointer(&c.k16[0]), &c.slots[0], ns/8, 2*c.rowLen, n8, 0.3)
						} else {
							asm.attnPV16[d](&out[0], &c.p[0], unsafe.Pointer(&c.v16[0]), &c.slots[0], ns, 2*c.rowLen, n8)
						}
						t1 := time.Now()
						attnAhead = 0
						if kern == "qk" {
							asm.attnQK(&out[0], &c.q[0], &c.kw[0], &c.slots[0], ns/8, 4*c.rowLen, n8, 0.3)
						} else {
							asm.attnPV(&out[0], &c.p[0], &c.vw[0], &c.slots[0], ns, 4*c.rowLen, n8)
						}
						on, alt = on+t1.Sub(t0), alt+time.Since(t1)
					}
					b.ReportMetric(float64(on.Nanoseconds())/float64(b.N), "ns/call")
					b.ReportMetric(on.Seconds()/alt.Seconds(), "vs-f32")
				})
			}
		}
	}
}
