//go:build amd64

package cpu

import (
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// TestDot1x8StreamSameBits checks that the panel-looping decode kernel
// gives the bits of the 1×8 kernel, panel by panel (rows longer than 8·n8
// columns too, with and without a prefetch), and that MatMul with one x row
// gives the same bits with it as without it (W rows not a multiple of 8 and
// fewer than 8, k not a multiple of 8, 1 and 2 threads, several prefetch
// distances). The data is such that summing in another order changes some
// bits, so a kernel that reorders the FMAs fails.
func TestDot1x8StreamSameBits(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	r := rand.New(rand.NewPCG(5, 6))
	reordered := false
	for _, n8 := range []int{1, 2, 5, 37, 96} {
		for _, pad := range []int{0, 1, 7} { // extra floats per row
			for _, np := range []int{1, 2, 5} {
				rf := 8*n8 + pad
				w := randVec(r, 8*np*rf, 1)
				for i := range w {
					w[i] *= float32(math.Exp2(float64(r.IntN(20) - 10)))
				}
				x := randVec(r, rf, 1)
				got := make([]float32, 8*np)
				for _, pf := range []int{0, 8 * 4 * rf} {
					clear(got)
					dot1x8F32S(&x[0], unsafe.Pointer(&w[0]), 4*rf, n8, np, &got[0], pf)
					for p := range np {
						var ptrs [8]unsafe.Pointer
						for j := range ptrs {
							ptrs[j] = unsafe.Pointer(&w[(8*p+j)*rf])
						}
						var want [8]float32
						dot1x8F32(&x[0], &ptrs, n8, &want)
						for j, v := range want {
							if math.Float32bits(got[8*p+j]) != math.Float32bits(v) {
								t.Fatalf("n8=%d pad=%d np=%d pf=%d: row %d = %v, the 1×8 kernel %v", n8, pad, np, pf, 8*p+j, got[8*p+j], v)
							}
							var seq float32
							for c := range 8 * n8 {
								seq += x[c] * w[(8*p+j)*rf+c]
							}
							if seq != v {
								reordered = true
							}
						}
					}
				}
			}
		}
	}
	if !reordered {
		t.Fatal("no row's sum changes with the order: the test cannot tell")
	}
	for _, n := range []int{3, 8, 13, 64, 203} {
		for _, k := range []int{5, 8, 64, 300, 768, 1030} {
			w := benchMatrixRand(r, kernels.F32, n, k)
			x := randVec(r, k, 1)
			for _, threads := range []int{1, 2} {
				be := New(threads)
				if be.k.dot1x8S == nil {
					t.Fatal("no dot1x8S in the AVX2 set")
				}
				plain := New(threads)
				k1 := *plain.k
				k1.dot1x8S = nil
				plain.k = &k1
				for _, ahead := range []int{0, 8, 12, 64} {
					saved := streamAhead
					streamAhead = ahead
					want := make([]float32, n)
					got := make([]float32, n)
					plain.MatMul(want, x, w, 1)
					be.MatMul(got, x, w, 1)
					streamAhead = saved
					for i := range want {
						if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
							t.Fatalf("%d×%d threads=%d ahead=%d: out[%d] = %v with dot1x8S, %v without", n, k, threads, ahead, i, got[i], want[i])
						}
					}
				}
				be.Close()
				plain.Close()
			}
		}
	}
}
