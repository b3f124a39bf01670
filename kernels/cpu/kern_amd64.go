//go:build amd64

package cpu

import (
	"unsafe"

	"golang.org/x/sys/cpu"
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

// dot3x4F32 computes ntiles tiles of 3 x rows by the 4 float32 rows w[0..3]:
// tile t reads x rows at x + (3t+i)·xstride bytes and stores four sums at
// out + (3t+i)·ostride bytes, for i < 3.
//
//go:noescape
func dot3x4F32(x *float32, xstride, ntiles int, w *[4]unsafe.Pointer, n8 int, out *float32, ostride int)

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

// attnPV sets out[c] = Σ_j p[j]·v[slots[j]·stride/4 + c] for c < 8·n8 and
// j < nslots, in slot order, one FMA per term, from +0. stride is in bytes.
//
//go:noescape
func attnPV(out, p, v *float32, slots *int32, nslots, stride, n8 int)

// hasAVX2 reports whether this CPU (and OS) runs the assembly kernels.
var hasAVX2 = cpu.X86.HasAVX && cpu.X86.HasAVX2 && cpu.X86.HasFMA && cpu.X86.HasF16C

func asmKernels() *kernelSet {
	if !hasAVX2 {
		return nil
	}
	return &kernelSet{
		name:   "avx2",
		dot1x8: [4]dot1x8Func{dot1x8F32, dot1x8F16, dot1x8BF16, dot1x8Q8},
		dot3x4: dot3x4F32,
		cvt:    [4]cvtFunc{nil, cvtF16, cvtBF16, cvtQ8},
		cvtFP8: cvtFP8,
		attnPV: attnPV,
	}
}
