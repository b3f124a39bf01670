//go:build amd64

package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/kerneltest"
)

// TestExpAccuracy measures the vectorised exp against math.Exp over every
// 61st float32 from -110 to 89 (and all lengths of tail): at most 2 ulps
// where the result is normal, and within one subnormal step below.
func TestExpAccuracy(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	var src []float32
	for _, lim := range []float32{-110, 89} {
		for b := uint32(0); ; b += 997 {
			v := math.Float32frombits(b)
			if v > float32(math.Abs(float64(lim))) {
				break
			}
			if lim < 0 {
				v = -v
			}
			src = append(src, v)
		}
	}
	inf := float32(math.Inf(1))
	src = append(src, -inf, inf, float32(math.NaN()), 88.72, 88.73, -87.3, -87.4, -103.9, -104, 0)
	dst := make([]float32, len(src))
	expF32(&dst[0], &src[0], len(src))
	worst := 0.0
	for i, x := range src {
		want := math.Exp(float64(x))
		w32 := float32(want)
		got := dst[i]
		switch {
		case x != x:
			if got == got {
				t.Errorf("exp(NaN) = %v", got)
			}
			continue
		case math.IsInf(float64(w32), 0) || w32 == 0:
			if got != w32 {
				t.Errorf("exp(%v) = %v, want %v", x, got, w32)
			}
			continue
		}
		ulp := float64(math.Nextafter32(w32, inf) - w32)
		if w32 < 0x1p-126 {
			ulp = 0x1p-149
		}
		e := math.Abs(float64(got)-want) / ulp
		worst = max(worst, e)
		if e > 2 {
			t.Errorf("exp(%v) = %v, want %v: %.2f ulps", x, got, want, e)
		}
	}
	t.Logf("%d inputs, worst error %.3f ulps", len(src), worst)
	// Tails: every length below 16 gives the same values as the full run.
	for n := 1; n < 16; n++ {
		d := make([]float32, n)
		expF32(&d[0], &src[100], n)
		for i := range d {
			if math.Float32bits(d[i]) != math.Float32bits(dst[100+i]) {
				t.Fatalf("n=%d: exp(%v) = %v in a tail, %v in a block", n, src[100+i], d[i], dst[100+i])
			}
		}
	}
}

// avx2Only makes b use the AVX2 kernels alone (no AVX-512 kernel).
func avx2Only(b *Backend) *Backend {
	k := *b.k
	k.name, k.q8Pairs, k.dot6x8 = "avx2", nil, nil
	b.k = &k
	return b
}

// randQ8 is a Q8_0 matrix of random bytes with scales drawn from every
// class of finite half (normal, subnormal, ±0, large) and int8 from the
// whole range, -128 included.
func randQ8(r *rand.Rand, n, k int) *kernels.Matrix {
	rb := k / kernels.Q8Block * 34
	data := make([]byte, n*rb)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	for blk := 0; blk < len(data); blk += 34 {
		var h uint16
		switch r.IntN(8) {
		case 0:
			h = uint16(r.IntN(0x400)) // subnormal or +0
		case 1:
			h = 0x8000 | uint16(r.IntN(0x400)) // negative subnormal or -0
		case 2:
			h = uint16(r.IntN(0x7c00)) | uint16(r.IntN(2))<<15 // any finite
		default:
			h = kernels.F32ToF16((2*r.Float32() - 1) * 0.05)
		}
		data[blk], data[blk+1] = byte(h), byte(h>>8)
	}
	w, err := kernels.NewMatrix(kernels.Q8_0, n, k, data)
	if err != nil {
		panic(err)
	}
	return w
}

// TestQ8PairsMatchAVX2: the AVX-512 Q8_0 decode kernel gives the AVX2
// kernel's bits, for one and two x rows, every W row count class, split
// over threads or not, and with scales that are not finite (the kernel
// then hands the rows back to the AVX2 kernel).
func TestQ8PairsMatchAVX2(t *testing.T) {
	if !hasAVX512 {
		t.Skip("no AVX-512 (F, BW, VL, VBMI)")
	}
	r := rand.New(rand.NewPCG(11, 12))
	for _, threads := range []int{1, 2, 3} {
		for _, split := range []bool{false, true} {
			fast, slow := newBackend(threads, false), avx2Only(newBackend(threads, false))
			if fast.k.q8Pairs == nil {
				t.Fatal("AVX-512 kernel not selected")
			}
			if split {
				fast.minWork, slow.minWork = 1, 1
			}
			for _, n := range []int{1, 3, 4, 7, 8, 13, 16, 37, 203, 1000} {
				for _, k := range []int{32, 64, 288} {
					for _, special := range []string{"", "inf", "nan", "xinf"} {
						w := randQ8(r, n, k)
						x := randVec(r, 2*k, 4)
						for i := range x {
							// Some exact zeros, and a wide range of magnitudes.
							switch r.IntN(16) {
							case 0:
								x[i] = 0
							case 1:
								x[i] *= 1e-30
							case 2:
								x[i] *= 1e20
							}
						}
						row := r.IntN(n)
						blk := row*w.RowBytes() + 34*r.IntN(k/32)
						switch special {
						case "inf":
							// -Inf times positive q and x: -Inf in the AVX2
							// kernel, not NaN.
							w.Data[blk], w.Data[blk+1] = 0x00, 0xfc
							for i := range 32 {
								w.Data[blk+2+i] = byte(1 + r.IntN(127))
							}
							for i := range x {
								x[i] = float32(math.Abs(float64(x[i])))
							}
						case "nan":
							w.Data[blk], w.Data[blk+1] = 0x01, 0x7e
						case "xinf":
							x[r.IntN(len(x))] = float32(math.Inf(1))
						}
						for m := 1; m <= 2; m++ {
							got, want := make([]float32, m*n), make([]float32, m*n)
							fast.MatMul(got, x, w, m)
							slow.MatMul(want, x, w, m)
							sameBits(t, fmt.Sprintf("threads=%d split=%v n=%d k=%d m=%d %s", threads, split, n, k, m, special), got, want)
						}
					}
				}
			}
			fast.Close()
			slow.Close()
		}
	}
}

// TestQ8ScaleTable: every entry of the AVX-512 kernel's scale table is
// exact, so that d'·f − K is d·q with a single rounding of an exact value.
func TestQ8ScaleTable(t *testing.T) {
	if !hasAVX512 {
		t.Skip("no AVX-512 (F, BW, VL, VBMI)")
	}
	tab := q8ScaleTable()
	for h := range 1 << 16 {
		d := float64(kernels.F16ToF32(uint16(h)))
		if math.IsInf(d, 0) || math.IsNaN(d) {
			continue
		}
		if dp := float64(tab[h]); dp != d/256 {
			t.Fatalf("half %#04x: d' = %v, want %v", h, dp, d/256)
		}
		if k := float64(tab[1<<16+h]); k != d/256*(1<<23+1<<15) {
			t.Fatalf("half %#04x: K = %v, want %v", h, k, d/256*(1<<23+1<<15))
		}
	}
}

// TestGEMMAVX512MatchesAVX2: the AVX-512 prefill kernel gives the bits of
// the AVX2 3×4 tiles and of the 1×8 kernel alone (one x row at a time),
// for every weight type, k not a multiple of 8 or 16, and m and n that
// leave x rows and W rows over from the 6×8 tile.
func TestGEMMAVX512MatchesAVX2(t *testing.T) {
	if !hasAVX512GEMM {
		t.Skip("no AVX-512 (F, DQ, VL)")
	}
	r := rand.New(rand.NewPCG(13, 14))
	for _, threads := range []int{1, 2} {
		fast, slow := newBackend(threads, false), avx2Only(newBackend(threads, false))
		if fast.k.dot6x8 == nil {
			t.Fatal("AVX-512 GEMM kernel not selected")
		}
		fast.minWork, slow.minWork = 1, 1
		for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16, kernels.Q8_0} {
			ks := []int{3, 8, 16, 29, 40, 100, 288, 520, 1100}
			if d == kernels.Q8_0 {
				ks = []int{32, 96, 288, 544}
			}
			for _, k := range ks {
				for _, n := range []int{1, 5, 8, 13, 24, 203} {
					w := kerneltest.EncodeMatrix(d, n, k, randVec(r, n*k, 1))
					for _, m := range []int{3, 6, 7, 11, 12, 17, 40} {
						x := randVec(r, m*k, 2)
						what := fmt.Sprintf("%v threads=%d k=%d n=%d m=%d", d, threads, k, n, m)
						got, want := make([]float32, m*n), make([]float32, m*n)
						fast.MatMul(got, x, w, m)
						slow.MatMul(want, x, w, m)
						sameBits(t, what+" vs avx2", got, want)
						one := make([]float32, n)
						for i := range m {
							fast.MatMul(one, x[i*k:(i+1)*k], w, 1)
							sameBits(t, fmt.Sprintf("%s row %d vs 1×8", what, i), got[i*n:(i+1)*n], one)
						}
					}
				}
			}
		}
		fast.Close()
		slow.Close()
	}
}

// BenchmarkMatMulQ8Decode compares the AVX-512 Q8_0 decode kernel with the
// AVX2 one on the benchmark shapes, one and two x rows.
func BenchmarkMatMulQ8Decode(b *testing.B) {
	if !hasAVX512 {
		b.Skip("no AVX-512 (F, BW, VL, VBMI)")
	}
	for _, s := range benchShapes {
		w := benchMatrix(kernels.Q8_0, s.n, s.k)
		for _, m := range []int{1, 2} {
			x := randVec(rand.New(rand.NewPCG(9, 9)), m*s.k, 1)
			dst := make([]float32, m*s.n)
			for _, threads := range []int{1, 2} {
				for _, set := range []string{"avx2", "avx512"} {
					b.Run(fmt.Sprintf("%dx%d/m=%d/threads=%d/%s", s.n, s.k, m, threads, set), func(b *testing.B) {
						be := New(threads)
						defer be.Close()
						if set == "avx2" {
							avx2Only(be)
						}
						for b.Loop() {
							be.MatMul(dst, x, w, m)
						}
						reportMatMul(b, w, m)
					})
				}
			}
		}
	}
}

// TestDot1x8PrefetchSameBits checks that the prefetching 1×8 kernels give
// the bits of the plain ones, kernel by kernel and through MatMul's decode
// path (one and two x rows, one and two threads, W rows not a multiple of
// 8 and fewer than 8, the prefetch clamped at the end of a part).
func TestDot1x8PrefetchSameBits(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16} {
		for _, n8 := range []int{1, 2, 5, 37, 128} {
			k := 8 * n8
			w := benchMatrixRand(r, d, 8, k)
			x := randVec(r, k+1, 1)
			var ptrs [8]unsafe.Pointer
			for j := range ptrs {
				ptrs[j] = unsafe.Pointer(unsafe.SliceData(w.Data[j*len(w.Data)/8:]))
			}
			var want, got [8]float32
			avx2Kernels().dot1x8[d](&x[0], &ptrs, n8, &want)
			avx2Kernels().dot1x8P[d](&x[0], &ptrs, n8, &got, ptrs[0])
			for j := range want {
				if math.Float32bits(want[j]) != math.Float32bits(got[j]) {
					t.Errorf("%v n8=%d row %d: %v with the prefetch, %v without", d, n8, j, got[j], want[j])
				}
			}
		}
		for _, n := range []int{3, 8, 13, 64, 203} {
			for _, k := range []int{5, 64, 300, 1030} {
				w := benchMatrixRand(r, d, n, k)
				x := randVec(r, 2*k, 1)
				for _, threads := range []int{1, 2} {
					be := New(threads)
					for m := 1; m <= 2; m++ {
						want := make([]float32, m*n)
						got := make([]float32, m*n)
						saved := streamAhead
						streamAhead = 0
						be.MatMul(want, x, w, m)
						streamAhead = saved
						be.MatMul(got, x, w, m)
						for i := range want {
							if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
								t.Fatalf("%v %d×%d m=%d threads=%d: out[%d] = %v with the prefetch, %v without", d, n, k, m, threads, i, got[i], want[i])
							}
						}
					}
					be.Close()
				}
			}
		}
	}
}

func benchMatrixRand(r *rand.Rand, d kernels.DType, n, k int) *kernels.Matrix {
	return kerneltest.EncodeMatrix(d, n, k, randVec(r, n*k, 1))
}
