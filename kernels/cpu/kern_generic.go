package cpu

import (
	"math"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// dot1x8Func computes eight dot products of one float32 row x against the
// rows w[0..7] of one weight encoding (the first 8·n8 elements of each).
type dot1x8Func func(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)

// dot1x8PFunc is a dot1x8Func that also prefetches, per 8 columns, the
// next bytes the eight rows take from pf on (see dot1x8F32P).
type dot1x8PFunc func(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)

// dot1x8SFunc is a dot1x8PFunc over np consecutive panels of rows rb bytes
// apart (see dot1x8F32S).
type dot1x8SFunc func(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)

// attnQK16Func is attnQK over 16-bit K rows: k points at the head's first
// element of slot 0, stride is the row stride in bytes.
type attnQK16Func func(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)

// attnPV16Func is attnPV over 16-bit V rows (v and stride as for
// attnQK16Func).
type attnPV16Func func(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)

// cvtFunc decodes 8·n8 weights of one encoding to float32.
type cvtFunc func(dst *float32, src unsafe.Pointer, n8 int)

// kernelSet is one implementation of the inner loops: AVX2 assembly
// (kern_amd64.s) or the portable Go below. A Backend uses one set for every
// call, which is what makes its results independent of batch size and
// thread count: each kernel of a set computes a dot product the same way.
//
// The canonical dot product over the first 8·n8 elements: eight lanes,
// lane l accumulating the products of elements c ≡ l (mod 8) in increasing
// c, starting from +0; then ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)). The
// assembly uses one fused multiply-add per product; the Go set rounds the
// product and the sum separately, so the two sets differ in the last bits
// (both stay within the conformance tolerances) but each is self-consistent.
// Callers add the elements past 8·n8 one at a time after the sum.
type kernelSet struct {
	name string
	// dot1x8 is indexed by kernels.DType. The Q8_0 kernel needs whole
	// 32-element blocks (n8 a multiple of 4).
	dot1x8 [4]dot1x8Func
	// dot1x8P, where not nil, is dot1x8 with a software prefetch of the
	// weights that follow (decode streams the matrix through it).
	dot1x8P [4]dot1x8PFunc
	// dot1x8S, where not nil, is dot1x8P looped over consecutive panels
	// (dot1x8F32S): decode streams a part in one call.
	dot1x8S [4]dot1x8SFunc
	// dot3x4 computes ntiles tiles of 3 float32 x rows by 4 float32 w rows.
	dot3x4 func(x *float32, xstride, ntiles int, w *[4]unsafe.Pointer, n8 int, out *float32, ostride int)
	// dot6x8, when not nil, is a faster prefill kernel computing the same
	// dots: ntiles tiles of 6 float32 x rows by a panel of 8 W rows packed
	// by pack8, resumable over ranges of k (acc, mode: see dot6x8Z).
	dot6x8 func(x *float32, xstride, ntiles int, wp *float32, n8 int, out *float32, ostride int, acc *float32, mode int)
	pack8  func(dst *float32, w *[8]unsafe.Pointer, n8 int)
	// cvt is indexed by kernels.DType (no F32 entry): exact widening.
	cvt [4]cvtFunc
	// cvtFP8 sets dst[i] = FP8ToF32(src[i])·scale.
	cvtFP8 func(dst *float32, src *uint8, n8 int, scale float32)
	// attnPV accumulates probability-weighted value rows (see kern_amd64.go).
	attnPV func(out, p, v *float32, slots *int32, nslots, stride, n8 int)
	// attnQK scores blocks of 8 slots: the scaled canonical dot of q with
	// each slot's K row (see kern_amd64.go).
	attnQK func(scores, q, k *float32, slots *int32, nblk, stride, n8 int, scale float32)
	// attnQK16 and attnPV16, indexed by kernels.DType (F16 and BF16
	// entries), are attnQK and attnPV over a 16-bit KV pool: each K or V
	// element is widened exactly, then meets the same arithmetic in the
	// same order as in attnQK and attnPV, so that a 16-bit pool gives the
	// bits an F32 pool holding the widened values gives.
	attnQK16 [4]attnQK16Func
	attnPV16 [4]attnPV16Func
	// softmax normalises one row in place; swiglu is silu(gate)·up. The
	// assembly uses a vectorised exp and an 8-lane sum, the Go set
	// math.Exp and a sequential sum exactly like the reference.
	softmax func(x []float32)
	swiglu  func(dst, gate, up []float32)
	// decodeKeys decodes the index keys of slots (Dim a multiple of 8, the
	// slots checked by the caller) into consecutive rows of dst, exactly
	// as ref.IndexKey.
	decodeKeys func(dst []float32, keys *kernels.IndexKeys, slots []int32)
	// indexScore8 scores blocks of 8 decoded keys: out[l] = Σ_h
	// w[h]·max(dot(q_h, key_l), 0), dots canonical, then per head one
	// rounded product and one rounded sum, in head order.
	indexScore8 func(out, q, w *float32, nh int, keys *float32, nblk, n8 int)
	// q8Pairs, when not nil, is a faster Q8_0 decode kernel computing the
	// same dots: ngroups groups of four pairs; pair p of group g is the lo
	// W row at byte g·gstride + p·pstride of w against x0 and the hi row
	// hoff bytes further against x1 (len(x0) a multiple of 32, x1 as long).
	// The lo sums of group g go to out[g·ostep/4 + p], the hi sums ohi
	// bytes after them. xd is scratch for 2·len(x0) floats. It reports
	// false when some output may differ from dot1x8 (it then has a sum
	// that is not finite, e.g. from a scale that is not): the caller must
	// compute those rows again.
	q8Pairs func(xd, x0, x1 []float32, w []byte, rb, pstride, hoff, gstride, ngroups int, out []float32, ostep, ohi int) bool
}

func genericKernels() *kernelSet {
	return &kernelSet{
		name:        "go",
		dot1x8:      [4]dot1x8Func{goDot1x8F32, goDot1x8Enc(kernels.F16), goDot1x8Enc(kernels.BF16), goDot1x8Enc(kernels.Q8_0)},
		dot3x4:      goDot3x4F32,
		cvt:         [4]cvtFunc{nil, goCvtF16, goCvtBF16, goCvtQ8},
		cvtFP8:      goCvtFP8,
		attnPV:      goAttnPV,
		attnQK:      goAttnQK,
		attnQK16:    [4]attnQK16Func{nil, goAttnQK16(kernels.F16), goAttnQK16(kernels.BF16), nil},
		attnPV16:    [4]attnPV16Func{nil, goAttnPV16(kernels.F16), goAttnPV16(kernels.BF16), nil},
		softmax:     ref.SoftmaxRow,
		swiglu:      goSwiGLU,
		decodeKeys:  goDecodeKeys,
		indexScore8: goIndexScore8,
	}
}

// hsum8 is the canonical horizontal sum.
func hsum8(a *[8]float32) float32 {
	return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

// acc8 adds x[c]·w[c] into the lanes for c < len(x) (a multiple of 8). The
// explicit conversions keep the compiler from fusing the multiply and add,
// so that every call site rounds the same way on every architecture.
func acc8(a *[8]float32, x, w []float32) {
	w = w[:len(x)]
	for c := 0; c+8 <= len(x); c += 8 {
		xs, ws := x[c:c+8:c+8], w[c:c+8:c+8]
		a[0] += float32(xs[0] * ws[0])
		a[1] += float32(xs[1] * ws[1])
		a[2] += float32(xs[2] * ws[2])
		a[3] += float32(xs[3] * ws[3])
		a[4] += float32(xs[4] * ws[4])
		a[5] += float32(xs[5] * ws[5])
		a[6] += float32(xs[6] * ws[6])
		a[7] += float32(xs[7] * ws[7])
	}
}

func f32s(p unsafe.Pointer, n int) []float32 { return unsafe.Slice((*float32)(p), n) }

func goDot1x8F32(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32) {
	xs := unsafe.Slice(x, 8*n8)
	for j := range 8 {
		var a [8]float32
		acc8(&a, xs, f32s(w[j], 8*n8))
		out[j] = hsum8(&a)
	}
}

// goDot1x8Enc decodes each row 32 elements at a time (one Q8_0 block) into
// a small buffer and accumulates it like goDot1x8F32.
func goDot1x8Enc(d kernels.DType) dot1x8Func {
	return func(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32) {
		xs := unsafe.Slice(x, 8*n8)
		var buf [kernels.Q8Block]float32
		for j := range 8 {
			var a [8]float32
			for c0 := 0; c0 < len(xs); c0 += len(buf) {
				cnt := min(len(buf), len(xs)-c0)
				decodeAt(d, buf[:cnt], w[j], c0)
				acc8(&a, xs[c0:c0+cnt], buf[:cnt])
			}
			out[j] = hsum8(&a)
		}
	}
}

// decodeAt decodes len(dst) weights of encoding d starting at element c0 of
// the row at p (c0 and len(dst) multiples of 32 for Q8_0).
func decodeAt(d kernels.DType, dst []float32, p unsafe.Pointer, c0 int) {
	switch d {
	case kernels.F16:
		goCvtF16(&dst[0], unsafe.Add(p, 2*c0), len(dst)/8)
		for i := len(dst) &^ 7; i < len(dst); i++ {
			dst[i] = kernels.F16ToF32(*(*uint16)(unsafe.Add(p, 2*(c0+i))))
		}
	case kernels.BF16:
		goCvtBF16(&dst[0], unsafe.Add(p, 2*c0), len(dst)/8)
		for i := len(dst) &^ 7; i < len(dst); i++ {
			dst[i] = kernels.BF16ToF32(*(*uint16)(unsafe.Add(p, 2*(c0+i))))
		}
	case kernels.Q8_0:
		goCvtQ8(&dst[0], unsafe.Add(p, c0/kernels.Q8Block*q8BlockBytes), len(dst)/8)
	}
}

// q8BlockBytes is the size of one Q8_0 block: fp16 scale, then 32 int8.
const q8BlockBytes = 2 + kernels.Q8Block

func goDot3x4F32(x *float32, xstride, ntiles int, w *[4]unsafe.Pointer, n8 int, out *float32, ostride int) {
	for t := range ntiles {
		for i := range 3 {
			xi := f32s(unsafe.Add(unsafe.Pointer(x), (3*t+i)*xstride), 8*n8)
			o := f32s(unsafe.Add(unsafe.Pointer(out), (3*t+i)*ostride), 4)
			for j := range 4 {
				var a [8]float32
				acc8(&a, xi, f32s(w[j], 8*n8))
				o[j] = hsum8(&a)
			}
		}
	}
}

func goCvtF16(dst *float32, src unsafe.Pointer, n8 int) {
	d, s := unsafe.Slice(dst, 8*n8), unsafe.Slice((*uint16)(src), 8*n8)
	for i, h := range s {
		d[i] = kernels.F16ToF32(h)
	}
}

func goCvtBF16(dst *float32, src unsafe.Pointer, n8 int) {
	d, s := unsafe.Slice(dst, 8*n8), unsafe.Slice((*uint16)(src), 8*n8)
	for i, h := range s {
		d[i] = kernels.BF16ToF32(h)
	}
}

func goCvtQ8(dst *float32, src unsafe.Pointer, n8 int) {
	n := 8 * n8
	kernels.DequantizeQ8Row(unsafe.Slice(dst, n), unsafe.Slice((*byte)(src), n/kernels.Q8Block*q8BlockBytes))
}

func goCvtFP8(dst *float32, src *uint8, n8 int, scale float32) {
	d, s := unsafe.Slice(dst, 8*n8), unsafe.Slice(src, 8*n8)
	for i, c := range s {
		d[i] = kernels.FP8ToF32(c) * scale
	}
}

func goAttnQK(scores, q, k *float32, slots *int32, nblk, stride, n8 int, scale float32) {
	ss, sl := unsafe.Slice(scores, 8*nblk), unsafe.Slice(slots, 8*nblk)
	var ptrs [8]unsafe.Pointer
	var d [8]float32
	for b := range nblk {
		for l := range 8 {
			ptrs[l] = unsafe.Add(unsafe.Pointer(k), int(sl[8*b+l])*stride)
		}
		goDot1x8F32(q, &ptrs, n8, &d)
		for l, v := range d {
			ss[8*b+l] = v * scale
		}
	}
}

func goAttnPV(out, p, v *float32, slots *int32, nslots, stride, n8 int) {
	o := unsafe.Slice(out, 8*n8)
	ps, ss := unsafe.Slice(p, nslots), unsafe.Slice(slots, nslots)
	clear(o)
	for j, s := range ss {
		row := f32s(unsafe.Add(unsafe.Pointer(v), int(s)*stride), len(o))
		pj := ps[j]
		for c, vc := range row {
			o[c] += float32(pj * vc)
		}
	}
}

// goAttnQK16 is goAttnQK over 16-bit rows of type d: the 1×8 kernel of d
// widens the elements exactly, then accumulates as goDot1x8F32.
func goAttnQK16(d kernels.DType) attnQK16Func {
	dot := goDot1x8Enc(d)
	return func(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32) {
		ss, sl := unsafe.Slice(scores, 8*nblk), unsafe.Slice(slots, 8*nblk)
		var ptrs [8]unsafe.Pointer
		var dd [8]float32
		for b := range nblk {
			for l := range 8 {
				ptrs[l] = unsafe.Add(k, int(sl[8*b+l])*stride)
			}
			dot(q, &ptrs, n8, &dd)
			for l, v := range dd {
				ss[8*b+l] = v * scale
			}
		}
	}
}

// goAttnPV16 is goAttnPV over 16-bit rows of type d, a run of columns at a
// time: each slot's run is widened exactly into a buffer, then added as
// goAttnPV adds it (every output element sums its terms in slot order, so
// the runs give goAttnPV's bits).
func goAttnPV16(d kernels.DType) attnPV16Func {
	return func(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int) {
		o := unsafe.Slice(out, 8*n8)
		ps, ss := unsafe.Slice(p, nslots), unsafe.Slice(slots, nslots)
		clear(o)
		var buf [64]float32
		for c0 := 0; c0 < len(o); c0 += len(buf) {
			oc := o[c0:min(len(o), c0+len(buf))]
			row := buf[:len(oc)]
			for j, s := range ss {
				decodeAt(d, row, unsafe.Add(v, int(s)*stride), c0)
				pj := ps[j]
				for c, vc := range row {
					oc[c] += float32(pj * vc)
				}
			}
		}
	}
}

// goSwiGLU computes silu(gate)·up as the reference does.
func goSwiGLU(dst, gate, up []float32) {
	gate, up = gate[:len(dst)], up[:len(dst)]
	for i, g := range gate {
		dst[i] = g / (1 + float32(math.Exp(float64(-g)))) * up[i]
	}
}

func goDecodeKeys(dst []float32, keys *kernels.IndexKeys, slots []int32) {
	d := keys.Dim
	for i, s := range slots {
		row := dst[i*d : (i+1)*d]
		switch keys.DType {
		case kernels.IndexFP8:
			scale := keys.Scales[s]
			for c, code := range keys.FP8[int(s)*d : int(s+1)*d] {
				row[c] = kernels.FP8ToF32(code) * scale
			}
		case kernels.IndexBF16:
			for c, h := range keys.BF16[int(s)*d : int(s+1)*d] {
				row[c] = kernels.BF16ToF32(h)
			}
		}
	}
}

func goIndexScore8(out, q, w *float32, nh int, keys *float32, nblk, n8 int) {
	d := 8 * n8
	qs, ws := unsafe.Slice(q, nh*d), unsafe.Slice(w, nh)
	ks, os := unsafe.Slice(keys, nblk*8*d), unsafe.Slice(out, nblk*8)
	for b := range nblk {
		var acc [8]float32
		for h, wh := range ws {
			for l := range 8 {
				var a [8]float32
				acc8(&a, qs[h*d:(h+1)*d], ks[(8*b+l)*d:(8*b+l+1)*d])
				acc[l] += float32(wh * max(hsum8(&a), 0))
			}
		}
		copy(os[8*b:8*b+8], acc[:])
	}
}
