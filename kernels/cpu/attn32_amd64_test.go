//go:build amd64

package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// attnAheads are the prefetch distances the F32 attention tests run: the
// default, off, short ones (13 is rounded down to 8 by attnQK) that
// prefetch in cases of few slots too, and the 16-bit kernels' 64.
var attnAheads = []int{32, 0, 8, 13, 24, 64}

// attn32Cases are kernel-level cases over an F32 pool of values with
// exponents from 2^-20 to 2^20, so that the order of the sums shows in
// the bits; their slot counts reach over the prefetch distances from
// below and above. Every other case has its heads start cache lines (the
// pool 64-byte aligned, rows and offset multiples of 16 elements), where
// the kernels prefetch no row's last byte apart; the others mostly not.
func attn32Cases(r *rand.Rand) []*attn16Case {
	var cs []*attn16Case
	for _, n8 := range []int{1, 2, 3, 5, 6, 8, 9, 17} {
		for i, ns := range []int{0, 1, 8, 23, 33, 40, 64, 65, 72, 73, 150, 300, 0, 1, 8, 23, 33, 40, 64, 65, 72, 73, 150, 300} {
			c := &attn16Case{d: kernels.F32, pool: 37, n8: n8}
			c.off = 8 * r.IntN(3)
			c.rowLen = c.off + 8*n8 + r.IntN(3)
			if i%2 == 1 {
				c.off = 16 * r.IntN(2)
				c.rowLen = (c.off + 8*n8 + 15) &^ 15
			}
			c.kw, c.vw = lineAligned(wideVec(r, c.pool*c.rowLen)), lineAligned(wideVec(r, c.pool*c.rowLen))
			c.draw(r, ns)
			cs = append(cs, c)
		}
	}
	return cs
}

// lineAligned copies v to a slice that starts a 64-byte cache line.
func lineAligned[T float32 | uint16](v []T) []T {
	size := int(unsafe.Sizeof(v[0]))
	buf := make([]T, len(v)+64/size)
	skip := (64 - int(uintptr(unsafe.Pointer(&buf[0]))%64)) % 64 / size
	a := buf[skip : skip+len(v)]
	copy(a, v)
	return a
}

func wideVec(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(math.Ldexp(2*r.Float64()-1, r.IntN(41)-20))
	}
	return v
}

// TestAttnF32AsmMatchesModel pins the F32 attention kernels of the
// assembly sets bit for bit to the exact FMA model of the portable order
// (modelQK, modelPV), with the row prefetch at every distance in
// attnAheads: the prefetch must change no bit.
func TestAttnF32AsmMatchesModel(t *testing.T) {
	r := rand.New(rand.NewPCG(32, 32))
	asmMatchesModel(t, attn32Cases(r), &attnAhead, attnAheads, (*attn16Case).qk32, (*attn16Case).pv32)
}

// asmMatchesModel checks the assembly kernels qk and pv on every case
// against the FMA model, with *ahead set to each distance in aheads.
func asmMatchesModel(t *testing.T, cases []*attn16Case, ahead *int, aheads []int,
	qk, pv func(*attn16Case, *kernelSet) []float32) {
	t.Helper()
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	defer func(old int) { *ahead = old }(*ahead)
	asm := avx2Kernels()
	for _, c := range cases {
		wantQK, wantPV := modelQK(c, 0.3), modelPV(c)
		for _, a := range aheads {
			*ahead = a
			what := fmt.Sprintf("%v ahead=%d", c, a)
			sameBits(t, "asm QK vs fma model "+what, qk(c, asm), wantQK)
			sameBits(t, "asm PV vs fma model "+what, pv(c, asm), wantPV)
		}
	}
}

// sameBitsAtAheads runs b.Attention(a) without prefetch (*ahead = 0),
// then at each distance of aheads, each into a fresh NaN output, and
// checks that every output has the bits of the first.
func sameBitsAtAheads(t *testing.T, label string, ahead *int, aheads []int, b *Backend, a *kernels.AttentionArgs) {
	t.Helper()
	n := len(a.Q)
	*ahead = 0
	want := nans(n)
	a.Out = want
	b.Attention(a)
	for _, d := range aheads {
		*ahead = d
		a.Out = nans(n)
		b.Attention(a)
		sameBits(t, fmt.Sprintf("%s ahead=%d", label, d), a.Out, want)
	}
}

// TestAttentionPrefetchSameBits checks through Attention, for every kernel
// set, that an F32 pool gives the same bits with the F32 kernels' row
// prefetch at every distance in attnAheads as without it, and F16 and BF16
// pools with the 16-bit kernels' at every distance in attn16Aheads: GQA,
// head dims with a tail, and slot counts on both sides of the distance.
func TestAttentionPrefetchSameBits(t *testing.T) {
	defer func(old int) { attnAhead = old }(attnAhead)
	defer func(old int) { attnAhead16 = old }(attnAhead16)
	r := rand.New(rand.NewPCG(33, 33))
	const tokens, pool = 10, 90
	for _, set := range kernelSetsUnderTest() {
		b := testBackend(2, set)
		b.minWork = 1
		for _, shape := range []struct{ kv, group, hd int }{{2, 3, 48}, {1, 4, 20}, {2, 1, 64}, {2, 2, 128}, {1, 2, 72}} {
			H := shape.kv * shape.group
			qDim, kvDim := H*shape.hd, shape.kv*shape.hd
			a := kernels.AttentionArgs{
				Q: randVec(r, tokens*qDim, 2), K: wideVec(r, pool*kvDim), V: wideVec(r, pool*kvDim),
				Slots: make([][]int32, tokens), NHeads: H, NKVHeads: shape.kv, HeadDim: shape.hd,
				Scale: float32(1 / math.Sqrt(float64(shape.hd))),
			}
			for i := range a.Slots {
				a.Slots[i] = make([]int32, []int{0, 7, 33, 40, 65, 72, 73, 129, 150, 300}[i])
				for j := range a.Slots[i] {
					a.Slots[i][j] = int32(r.IntN(pool))
				}
			}
			sameBitsAtAheads(t, fmt.Sprintf("%s heads=%d/%d hd=%d", set, H, shape.kv, shape.hd), &attnAhead, attnAheads, b, &a)
			for _, d := range []kernels.DType{kernels.F16, kernels.BF16} {
				a16 := a
				a16.K, a16.V, a16.KVType = nil, nil, d
				a16.K16, a16.V16 = make([]uint16, len(a.K)), make([]uint16, len(a.V))
				kernels.EncodeKV(a16.K16, a.K, d)
				kernels.EncodeKV(a16.V16, a.V, d)
				sameBitsAtAheads(t, fmt.Sprintf("%s %v heads=%d/%d hd=%d", set, d, H, shape.kv, shape.hd), &attnAhead16, attn16Aheads, b, &a16)
			}
		}
		b.Close()
	}
}
