//go:build amd64

package cpu

import (
	"sync"
	"unsafe"

	"golang.org/x/sys/cpu"

	"github.com/pdkit/pdkit/kernels"
)

// The assembly kernels (kern_amd64.s). Every pointer must cover what the
// kernel reads or writes; the callers in matmul.go and ops.go check the
// bounds before calling.

// dot1x8F32 sets out[j] = Σ_{c<8·n8} x[c]·w[j][c] for the eight float32 rows
// w[0..7] (repeat a pointer to compute fewer rows), with the canonical
// accumulation (see kernelSet).
//
//go:noescape
func dot1x8F32(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)

// dot1x8F16 is dot1x8F32 over rows of IEEE halves, widened exactly.
//
//go:noescape
func dot1x8F16(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)

// dot1x8BF16 is dot1x8F32 over rows of bfloat16s, widened exactly.
//
//go:noescape
func dot1x8BF16(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)

// dot1x8Q8 is dot1x8F32 over Q8_0 rows: each weight is dequantized to
// scale·q in float32 (exact) before its FMA. n8 must be a multiple of 4.
//
//go:noescape
func dot1x8Q8(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)

// dot1x8F32P, dot1x8F16P and dot1x8BF16P are dot1x8F32, dot1x8F16 and
// dot1x8BF16 (the same FMAs in the same order) that also prefetch, per 8
// columns, the next cache lines of W from pf on: 256 bytes for F32, 128 for
// halves, as many bytes as the eight rows take. Prefetches never fault.
//
//go:noescape
func dot1x8F32P(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)

//go:noescape
func dot1x8F16P(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)

//go:noescape
func dot1x8BF16P(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)

// dot3x4F32 computes ntiles tiles of 3 x rows by the 4 float32 rows w[0..3]:
// tile t reads x rows at x + (3t+i)·xstride bytes and stores four sums at
// out + (3t+i)·ostride bytes, for i < 3.
//
//go:noescape
func dot3x4F32(x *float32, xstride, ntiles int, w *[4]unsafe.Pointer, n8 int, out *float32, ostride int)

// dot6x8Z computes ntiles tiles of 6 x rows by a panel of 8 float32 W rows
// packed by pack8Z (gemm_avx512_amd64.s): tile t reads x rows at
// x + (6t+i)·xstride bytes and stores eight sums at out + (6t+i)·ostride
// bytes, for i < 6, each the canonical dot as dot1x8F32 computes it. acc
// holds 384 floats per tile: the accumulators to start from (mode&1) and
// to save instead of the sums (mode&2), to cut k into ranges.
//
//go:noescape
func dot6x8Z(x *float32, xstride, ntiles int, wp *float32, n8 int, out *float32, ostride int, acc *float32, mode int)

// pack8Z lays out 8·n8 columns of the eight float32 rows w[0..7] for
// dot6x8Z: per 8 columns, rows 0 and 4, 1 and 5, 2 and 6, 3 and 7.
//
//go:noescape
func pack8Z(dst *float32, w *[8]unsafe.Pointer, n8 int)

// fmaPeakZ and fmaPeakY run n iterations of 24 independent FMAs on zmm or
// ymm registers: the machine's FMA peak, for benchmarks.
func fmaPeakZ(n int)
func fmaPeakY(n int)

// dotQ8PairsZ is the AVX-512 Q8_0 decode kernel (kern_avx512_amd64.s):
// groups of four pairs of dot products, each pair a lo W row against x0
// and a hi W row against x1, every dot computed exactly as dot1x8Q8 does
// unless a block scale is infinite or NaN; then some sum is NaN and bad is
// nonzero. xd is scratch for 2·32·nb floats; tab is q8ScaleTable.
//
//go:noescape
func dotQ8PairsZ(xd, x0, x1 *float32, nb int, w unsafe.Pointer, pstride, hoff, gstride, ngroups int, out *float32, ostep, ohi int, tab *float32, pfstep int) (bad int)

// cvtF16 widens 8·n8 IEEE halves.
//
//go:noescape
func cvtF16(dst *float32, src unsafe.Pointer, n8 int)

// cvtBF16 widens 8·n8 bfloat16s.
//
//go:noescape
func cvtBF16(dst *float32, src unsafe.Pointer, n8 int)

// cvtQ8 dequantizes 8·n8 Q8_0 weights (n8 a multiple of 4).
//
//go:noescape
func cvtQ8(dst *float32, src unsafe.Pointer, n8 int)

// cvtFP8 sets dst[i] = FP8ToF32(src[i])·scale for i < 8·n8.
//
//go:noescape
func cvtFP8(dst *float32, src *uint8, n8 int, scale float32)

// decodeFP8Keys decodes the fp8 index keys (8·d8 codes and a scale each)
// of slots[0..n) into consecutive float32 rows of dst.
//
//go:noescape
func decodeFP8Keys(dst *float32, codes *uint8, scales *float32, slots *int32, n, d8 int)

// decodeBF16Keys decodes the bf16 index keys of slots[0..n) likewise.
//
//go:noescape
func decodeBF16Keys(dst *float32, src *uint16, slots *int32, n, d8 int)

// indexScore8 scores nblk blocks of 8 decoded keys against nh query heads
// (see kern_amd64.s).
//
//go:noescape
func indexScore8(out, q, w *float32, nh int, keys *float32, nblk, n8 int)

// attnQK sets scores[8b+l] = dot(q, K row slots[8b+l])·scale for nblk
// blocks of 8 slots, each dot as dot1x8F32 computes it (n8 ≥ 1). k points
// at the head's first element of slot 0; stride is in bytes. At long
// context attnQK and attnPV prefetch the rows of the slots attnAhead (ops.go)
// ahead (see kern_amd64.s).
//
//go:noescape
func attnQK(scores, q, k *float32, slots *int32, nblk, stride, n8 int, scale float32)

// attnPV sets out[c] = Σ_j p[j]·v[slots[j]·stride/4 + c] for c < 8·n8 and
// j < nslots, in slot order, one FMA per term, from +0. stride is in bytes.
//
//go:noescape
func attnPV(out, p, v *float32, slots *int32, nslots, stride, n8 int)

// attnQKF16 and attnQKBF16 are attnQK over 16-bit K rows (attn16_amd64.s):
// each element widened exactly, then the FMAs of attnQK in its order, the
// bits of attnQK on the widened rows. k points at the head's first element
// of slot 0; stride is in bytes. At long context they prefetch the rows of
// the slots attnAhead16 (ops.go) ahead (see attn16_amd64.s).
//
//go:noescape
func attnQKF16(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)

//go:noescape
func attnQKBF16(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)

// attnPVF16 and attnPVBF16 are attnPV over 16-bit V rows likewise.
//
//go:noescape
func attnPVF16(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)

//go:noescape
func attnPVBF16(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)

// expF32 sets dst[i] = exp(src[i]) with the vectorised exp that softmaxF32
// and swigluF32 use (see kern_amd64.s); for tests.
//
//go:noescape
func expF32(dst, src *float32, n int)

// softmaxF32 normalises x[:n] in place (n ≥ 1).
//
//go:noescape
func softmaxF32(x *float32, n int)

// swigluF32 sets dst[i] = gate[i]/(1+exp(-gate[i]))·up[i] for i < n.
//
//go:noescape
func swigluF32(dst, gate, up *float32, n int)

func asmSoftmax(x []float32) {
	if len(x) > 0 {
		softmaxF32(&x[0], len(x))
	}
}

func asmSwiGLU(dst, gate, up []float32) {
	n := len(dst)
	gate, up = gate[:n], up[:n]
	if n > 0 {
		swigluF32(&dst[0], &gate[0], &up[0], n)
	}
}

// hasAVX2 reports whether this CPU (and OS) runs the assembly kernels.
var hasAVX2 = cpu.X86.HasAVX && cpu.X86.HasAVX2 && cpu.X86.HasFMA && cpu.X86.HasF16C

// hasAVX512 reports whether the AVX-512 decode kernel runs here as well.
var hasAVX512 = hasAVX2 && cpu.X86.HasAVX512F && cpu.X86.HasAVX512BW && cpu.X86.HasAVX512VL && cpu.X86.HasAVX512VBMI

// hasAVX512GEMM reports whether the AVX-512 prefill kernel runs here.
var hasAVX512GEMM = hasAVX2 && cpu.X86.HasAVX512F && cpu.X86.HasAVX512DQ && cpu.X86.HasAVX512VL

// q8ScaleTable holds, for every IEEE half d (widened by VCVTPH2PS, as
// the AVX2 kernels widen scales), d' = d·2^-8 at [d] and K = d'·(2^23+2^15)
// at [1<<16 + d], both exact (see kern_avx512_amd64.s).
var q8ScaleTable = sync.OnceValue(func() *[2 << 16]float32 {
	var codes [1 << 16]uint16
	for i := range codes {
		codes[i] = uint16(i)
	}
	t := new([2 << 16]float32)
	cvtF16(&t[0], unsafe.Pointer(&codes[0]), len(codes)/8)
	for i := range 1 << 16 {
		t[i] *= 0x1p-8
		t[1<<16+i] = t[i] * (0x1p23 + 0x1p15)
	}
	return t
})

// asmQ8Pairs runs dotQ8PairsZ on whole groups (see kernelSet.q8Pairs).
func asmQ8Pairs(xd, x0, x1 []float32, w []byte, rb, pstride, hoff, gstride, ngroups int, out []float32, ostep, ohi int) bool {
	nb := len(x0) / kernels.Q8Block
	if nb == 0 || ngroups <= 0 {
		return true
	}
	x1 = x1[:len(x0)]
	_ = xd[2*len(x0)-1]
	// The last byte read: the hi row of the last pair of the last group.
	_ = w[(ngroups-1)*gstride+3*pstride+hoff+rb-1]
	_ = out[((ngroups-1)*ostep+ohi+16)/4-1]
	tab := q8ScaleTable()
	return dotQ8PairsZ(&xd[0], &x0[0], &x1[0], nb, unsafe.Pointer(&w[0]), pstride, hoff, gstride, ngroups, &out[0], ostep, ohi, &tab[0], 34*gstride/rb) == 0
}

func asmKernels() *kernelSet {
	if !hasAVX2 {
		return nil
	}
	k := avx2Kernels()
	if hasAVX512 {
		k.q8Pairs = asmQ8Pairs
	}
	if hasAVX512GEMM {
		k.dot6x8, k.pack8 = dot6x8Z, pack8Z
	}
	if hasAVX512 || hasAVX512GEMM {
		k.name = "avx2+avx512"
	}
	return k
}

// avx2Kernels is the AVX2 set alone.
func avx2Kernels() *kernelSet {
	return &kernelSet{
		name:     "avx2",
		dot1x8:   [4]dot1x8Func{dot1x8F32, dot1x8F16, dot1x8BF16, dot1x8Q8},
		dot1x8P:  [4]dot1x8PFunc{dot1x8F32P, dot1x8F16P, dot1x8BF16P, nil},
		dot1x8S:  [4]dot1x8SFunc{dot1x8F32S, dot1x8F16S, dot1x8BF16S, nil},
		dot3x4:   dot3x4F32,
		cvt:      [4]cvtFunc{nil, cvtF16, cvtBF16, cvtQ8},
		cvtFP8:   cvtFP8,
		attnPV:   attnPV,
		attnQK:   attnQK,
		attnQK16: [4]attnQK16Func{nil, attnQKF16, attnQKBF16, nil},
		attnPV16: [4]attnPV16Func{nil, attnPVF16, attnPVBF16, nil},
		softmax:  asmSoftmax,
		swiglu:   asmSwiGLU,
		decodeKeys: func(dst []float32, keys *kernels.IndexKeys, slots []int32) {
			d8 := keys.Dim / 8
			if len(slots) == 0 || d8 == 0 {
				return
			}
			_ = dst[len(slots)*8*d8-1]
			if keys.DType == kernels.IndexFP8 {
				decodeFP8Keys(&dst[0], &keys.FP8[0], &keys.Scales[0], &slots[0], len(slots), d8)
			} else {
				decodeBF16Keys(&dst[0], &keys.BF16[0], &slots[0], len(slots), d8)
			}
		},
		indexScore8: indexScore8,
	}
}
