//go:build amd64

package cpu

import (
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/kerneltest"
)

// TestDot1x8StreamSameBits checks that the panel-looping decode kernels
// give the bits of the 1×8 kernels, panel by panel (rows longer than 8·n8
// columns too, with and without a prefetch), and that MatMul with one x row
// gives the same bits with them as without them (W rows not a multiple of
// 8 and fewer than 8, k not a multiple of 8, 1 and 2 threads, several
// prefetch distances). The F32 data is such that summing in another order
// changes some bits, so a kernel that reorders the FMAs fails.
func TestDot1x8StreamSameBits(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	r := rand.New(rand.NewPCG(5, 6))
	set := avx2Kernels()
	reordered := false
	for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16} {
		for _, n8 := range []int{1, 2, 5, 37, 96} {
			for _, pad := range []int{0, 1, 7} { // extra columns per row
				for _, np := range []int{1, 2, 5} {
					cols := 8*n8 + pad
					v := randVec(r, 8*np*cols, 1)
					for i := range v {
						v[i] *= float32(math.Exp2(float64(r.IntN(20) - 10)))
					}
					m := kerneltest.EncodeMatrix(d, 8*np, cols, v)
					rb := len(m.Data) / (8 * np)
					x := randVec(r, cols, 1)
					got := make([]float32, 8*np)
					for _, pf := range []int{0, 8 * rb} {
						clear(got)
						set.dot1x8S[d](&x[0], unsafe.Pointer(&m.Data[0]), rb, n8, np, &got[0], pf)
						for p := range np {
							var ptrs [8]unsafe.Pointer
							for j := range ptrs {
								ptrs[j] = unsafe.Pointer(&m.Data[(8*p+j)*rb])
							}
							var want [8]float32
							set.dot1x8[d](&x[0], &ptrs, n8, &want)
							for j, w := range want {
								if math.Float32bits(got[8*p+j]) != math.Float32bits(w) {
									t.Fatalf("%v n8=%d pad=%d np=%d pf=%d: row %d = %v, the 1×8 kernel %v", d, n8, pad, np, pf, 8*p+j, got[8*p+j], w)
								}
								if d != kernels.F32 {
									continue
								}
								var seq float32
								for c := range 8 * n8 {
									seq += x[c] * v[(8*p+j)*cols+c]
								}
								if seq != w {
									reordered = true
								}
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
	for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16} {
		for _, n := range []int{3, 8, 13, 64, 203} {
			for _, k := range []int{5, 8, 64, 300, 768, 1030} {
				w := benchMatrixRand(r, d, n, k)
				x := randVec(r, k, 1)
				for _, threads := range []int{1, 2} {
					be := New(threads)
					if be.k.dot1x8S[d] == nil {
						t.Fatalf("no %v dot1x8S in the AVX2 set", d)
					}
					plain := New(threads)
					k1 := *plain.k
					k1.dot1x8S = [4]dot1x8SFunc{}
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
								t.Fatalf("%v %d×%d threads=%d ahead=%d: out[%d] = %v with dot1x8S, %v without", d, n, k, threads, ahead, i, got[i], want[i])
							}
						}
					}
					be.Close()
					plain.Close()
				}
			}
		}
	}
}
