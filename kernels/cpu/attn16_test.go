package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// rand16 draws n finite 16-bit elements of type d from all their bit
// patterns (subnormals, zeros and the largest values included), scaled
// down in BF16 so that products and sums stay finite.
func rand16(r *rand.Rand, n int, d kernels.DType) []uint16 {
	h := make([]uint16, n)
	for i := range h {
		for {
			b := uint16(r.Uint32())
			if d == kernels.BF16 {
				// Exponents 2^-140..2^20 and the subnormals.
				b = b&0x807f | uint16(r.IntN(148))<<7
			}
			if v := decode16(b, d); !math.IsInf(float64(v), 0) && v == v {
				h[i] = b
				break
			}
		}
	}
	return h
}

func decode16(h uint16, d kernels.DType) float32 {
	if d == kernels.BF16 {
		return kernels.BF16ToF32(h)
	}
	return kernels.F16ToF32(h)
}

func widen(h []uint16, d kernels.DType) []float32 {
	f := make([]float32, len(h))
	kernels.DecodeKV(f, h, d)
	return f
}

// attn16Case is one kernel-level case: a pool of rows of rowLen elements,
// the head at element off of each, 8·n8 elements long.
type attn16Case struct {
	d                     kernels.DType
	pool, rowLen, off, n8 int
	k16, v16              []uint16
	kw, vw, q, p          []float32
	slots                 []int32
}

func attn16Cases(r *rand.Rand) []*attn16Case {
	var cs []*attn16Case
	for _, d := range []kernels.DType{kernels.F16, kernels.BF16} {
		for _, n8 := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17} {
			for _, ns := range []int{0, 1, 8, 13, 40, 150} {
				c := &attn16Case{d: d, pool: 37, n8: n8}
				c.off = 8 * r.IntN(3)
				c.rowLen = c.off + 8*n8 + r.IntN(3)
				c.k16, c.v16 = rand16(r, c.pool*c.rowLen, d), rand16(r, c.pool*c.rowLen, d)
				c.kw, c.vw = widen(c.k16, d), widen(c.v16, d)
				c.draw(r, ns)
				cs = append(cs, c)
			}
		}
	}
	return cs
}

func (c *attn16Case) String() string {
	return fmt.Sprintf("%v n8=%d slots=%d rowLen=%d off=%d", c.d, c.n8, len(c.slots), c.rowLen, c.off)
}

// qk16 and pv16 run a set's 16-bit kernels on c; qk32 and pv32 run its
// F32 kernels on the widened rows. The outputs start as NaN.
// draw fills the case's query (8*n8 values), its ns attention weights and
// ns slots drawn from the pool, in that order.
func (c *attn16Case) draw(r *rand.Rand, ns int) {
	c.q = randVec(r, 8*c.n8, 2)
	c.p = make([]float32, ns)
	for j := range c.p {
		c.p[j] = r.Float32()
	}
	c.slots = make([]int32, ns)
	for j := range c.slots {
		c.slots[j] = int32(r.IntN(c.pool))
	}
}

func (c *attn16Case) qk16(k *kernelSet) []float32 {
	out := nans(len(c.slots) &^ 7)
	if len(out) > 0 {
		k.attnQK16[c.d](&out[0], &c.q[0], unsafe.Pointer(&c.k16[c.off]), &c.slots[0], len(out)/8, 2*c.rowLen, c.n8, 0.3)
	}
	return out
}

func (c *attn16Case) qk32(k *kernelSet) []float32 {
	out := nans(len(c.slots) &^ 7)
	if len(out) > 0 {
		k.attnQK(&out[0], &c.q[0], &c.kw[c.off], &c.slots[0], len(out)/8, 4*c.rowLen, c.n8, 0.3)
	}
	return out
}

func (c *attn16Case) pv16(k *kernelSet) []float32 {
	out := nans(8 * c.n8)
	k.attnPV16[c.d](&out[0], unsafe.SliceData(c.p), unsafe.Pointer(&c.v16[c.off]), unsafe.SliceData(c.slots), len(c.slots), 2*c.rowLen, c.n8)
	return out
}

func (c *attn16Case) pv32(k *kernelSet) []float32 {
	out := nans(8 * c.n8)
	k.attnPV(&out[0], unsafe.SliceData(c.p), &c.vw[c.off], unsafe.SliceData(c.slots), len(c.slots), 4*c.rowLen, c.n8)
	return out
}

func nans(n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(math.NaN())
	}
	return v
}

// TestAttn16MatchesF32 checks, for every kernel set this machine runs,
// that the 16-bit attention kernels give bit for bit what the set's F32
// kernels give on the exactly widened rows (the F32 path's arithmetic in
// its order), over all classes of finite 16-bit values, every run of
// columns the value kernel splits a head into, and no slots at all.
func TestAttn16MatchesF32(t *testing.T) {
	r := rand.New(rand.NewPCG(16, 16))
	cases := attn16Cases(r)
	for _, set := range kernelSetsUnderTest() {
		b := testBackend(1, set)
		for _, c := range cases {
			sameBits(t, set+" QK "+c.String(), c.qk16(b.k), c.qk32(b.k))
			sameBits(t, set+" PV "+c.String(), c.pv16(b.k), c.pv32(b.k))
		}
		b.Close()
	}
}

// TestAttention16MatchesF32 is the same promise through Attention: a 16-bit
// pool gives the bits of the F32 pool of its widened values, with GQA, head
// dims with a tail, slot counts with and without whole blocks of 8, and
// tokens with no slots.
func TestAttention16MatchesF32(t *testing.T) {
	r := rand.New(rand.NewPCG(17, 17))
	const tokens, pool = 9, 70
	for _, set := range kernelSetsUnderTest() {
		b := testBackend(2, set)
		b.minWork = 1
		for _, d := range []kernels.DType{kernels.F16, kernels.BF16} {
			for _, shape := range []struct{ kv, group, hd int }{{2, 3, 48}, {1, 4, 20}, {2, 1, 64}, {1, 2, 3}, {2, 2, 128}, {1, 1, 40}, {1, 2, 72}} {
				H := shape.kv * shape.group
				qDim, kvDim := H*shape.hd, shape.kv*shape.hd
				a := kernels.AttentionArgs{
					Q: randVec(r, tokens*qDim, 2), K16: make([]uint16, pool*kvDim), V16: make([]uint16, pool*kvDim), KVType: d,
					Slots: make([][]int32, tokens), NHeads: H, NKVHeads: shape.kv, HeadDim: shape.hd,
					Scale: float32(1 / math.Sqrt(float64(shape.hd))),
				}
				kernels.EncodeKV(a.K16, randVec(r, pool*kvDim, 2), d)
				kernels.EncodeKV(a.V16, randVec(r, pool*kvDim, 1), d)
				for i := range a.Slots {
					a.Slots[i] = make([]int32, []int{0, 1, 7, 8, 16, 29, 70, 150, 300}[i%9])
					for j := range a.Slots[i] {
						a.Slots[i][j] = int32(r.IntN(pool))
					}
				}
				f := a
				f.K16, f.V16, f.KVType = nil, nil, kernels.F32
				f.K, f.V = widen(a.K16, d), widen(a.V16, d)
				a.Out, f.Out = nans(tokens*qDim), nans(tokens*qDim)
				b.Attention(&a)
				b.Attention(&f)
				sameBits(t, fmt.Sprintf("%s %v heads=%d/%d hd=%d", set, d, H, shape.kv, shape.hd), a.Out, f.Out)
			}
		}
		b.Close()
	}
}
