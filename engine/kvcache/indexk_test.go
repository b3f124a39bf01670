package kvcache

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// TestWriteIndexKRoundTrip writes index keys through the pool and reads them
// back the way the indexer does (ref.IndexKey): the value must be exactly the
// FP8 (e4m3 × per-token scale) or BF16 rounding of what was written, and
// neighbouring slots must be untouched.
func TestWriteIndexKRoundTrip(t *testing.T) {
	const dim = 16
	b := ref.New()
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		t.Run(dt.String(), func(t *testing.T) {
			c := Config{Layers: 2, KVDim: 4, PageSize: 3, Pages: 6, MaxSeqs: 2, MaxContext: 18,
				IndexK: &IndexKConfig{DType: dt, Dim: dim}}
			p := newPool(t, c)
			s, _ := p.NewSeq(1)
			if err := p.Reserve(s, 7); err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(3, uint64(dt)))
			keys := map[[2]int][]float32{}
			for pos, slot := range s.Slots() {
				for l := range c.Layers {
					key := make([]float32, dim)
					mag := float32(math.Pow(10, float64(rng.IntN(7)-3))) // 1e-3 .. 1e3
					for i := range key {
						key[i] = (rng.Float32()*2 - 1) * mag
					}
					if pos == 2 {
						clear(key) // an all-zero key keeps scale 1
					}
					p.WriteIndexK(b, l, slot, key)
					keys[[2]int{l, pos}] = key
				}
			}
			got := make([]float32, dim)
			want := make([]float32, dim)
			for pos, slot := range s.Slots() {
				for l := range c.Layers {
					key := keys[[2]int{l, pos}]
					ik := p.IndexKeys(l)
					if ik.DType != dt || ik.Dim != dim {
						t.Fatalf("layer %d index keys are %v×%d", l, ik.DType, ik.Dim)
					}
					ref.IndexKey(got, ik, slot)
					var amax float32
					for _, v := range key {
						amax = max(amax, float32(math.Abs(float64(v))))
					}
					switch dt {
					case kernels.IndexFP8:
						scale := kernels.FP8Scale(amax)
						if ik.Scales[slot] != scale {
							t.Fatalf("layer %d pos %d: scale %g, want %g", l, pos, ik.Scales[slot], scale)
						}
						for i, v := range key {
							want[i] = kernels.FP8ToF32(kernels.F32ToFP8(v/scale)) * scale
						}
					case kernels.IndexBF16:
						for i, v := range key {
							want[i] = kernels.BF16ToF32(kernels.F32ToBF16(v))
						}
					}
					for i := range got {
						if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
							t.Fatalf("layer %d pos %d [%d]: read %g, want %g (wrote %g)", l, pos, i, got[i], want[i], key[i])
						}
						// And the rounding is as small as the format promises:
						// e4m3 keeps 3 mantissa bits, bf16 keeps 7.
						tol := amax / 16
						if dt == kernels.IndexBF16 {
							tol = float32(math.Abs(float64(key[i]))) / 128
						}
						if d := float32(math.Abs(float64(got[i] - key[i]))); d > tol {
							t.Fatalf("layer %d pos %d [%d]: %g read back as %g", l, pos, i, key[i], got[i])
						}
					}
				}
			}
			// Slots beyond the footprint were never written.
			free := int32(s.Pages()[len(s.Pages())-1])*3 + 1 // position 7's slot, reserved-not
			ik := p.IndexKeys(0)
			ref.IndexKey(got, ik, free)
			for _, v := range got {
				if v != 0 {
					t.Fatalf("slot %d beyond the sequence holds %v", free, got)
				}
			}
		})
	}
}
