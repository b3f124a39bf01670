package cpu

import (
	"fmt"
	"math"
	"slices"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// The elementwise and per-row ops. Rows (tokens) are independent, so they
// are split over threads when a call is large; each row is computed by the
// same code whatever else the call holds.

// forRanges splits [0,n) into parts of work about perItem·len each and
// runs fn on each range.
func (b *Backend) forRanges(n, perItem int, fn func(lo, hi int)) {
	parts := min(n, b.parts(n*perItem))
	b.pool.run(parts, func(p int) { fn(p*n/parts, (p+1)*n/parts) })
}

func (b *Backend) RMSNorm(dst, x, weight []float32, rows int, eps float32) {
	n := len(weight)
	if rows <= 0 || n == 0 {
		return
	}
	if len(x) < rows*n || len(dst) < rows*n {
		panic(fmt.Sprintf("kernels/cpu: RMSNorm of %d rows of %d: len(x) = %d, len(dst) = %d", rows, n, len(x), len(dst)))
	}
	b.forRanges(rows, 4*n, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			rmsNormRow(dst[i*n:(i+1)*n], x[i*n:(i+1)*n], weight, eps)
		}
	})
}

// rmsNormRow sums squares in float64 in four lanes (the reference uses one
// lane: the sums differ in their last float64 bits at most, which seldom
// changes the float32 scale).
func rmsNormRow(dst, x, weight []float32, eps float32) {
	var s0, s1, s2, s3 float64
	c := 0
	for ; c+4 <= len(x); c += 4 {
		v := x[c : c+4 : c+4]
		s0 += float64(v[0]) * float64(v[0])
		s1 += float64(v[1]) * float64(v[1])
		s2 += float64(v[2]) * float64(v[2])
		s3 += float64(v[3]) * float64(v[3])
	}
	ss := (s0 + s1) + (s2 + s3)
	for ; c < len(x); c++ {
		ss += float64(x[c]) * float64(x[c])
	}
	inv := float32(1 / math.Sqrt(ss/float64(len(x))+float64(eps)))
	weight = weight[:len(x)]
	dst = dst[:len(x)]
	for c, v := range x {
		dst[c] = v * inv * weight[c]
	}
}

func (b *Backend) RoPE(x []float32, pos []int32, nHeads, headDim, ropeDim int, theta float32) {
	if len(pos) == 0 || nHeads <= 0 || ropeDim < 2 {
		return
	}
	if ropeDim > headDim || len(x) < len(pos)*nHeads*headDim {
		panic(fmt.Sprintf("kernels/cpu: RoPE: %d tokens × %d heads × %d (rope %d), len(x) = %d", len(pos), nHeads, headDim, ropeDim, len(x)))
	}
	half := ropeDim / 2
	// The frequencies, computed exactly as the reference does.
	freq := make([]float64, half)
	for i := range freq {
		freq[i] = math.Pow(float64(theta), -2*float64(i)/float64(ropeDim))
	}
	b.forRanges(len(pos), nHeads*ropeDim+20*half, func(lo, hi int) {
		cs := make([]float32, 2*half)
		for t := lo; t < hi; t++ {
			p := float64(pos[t])
			for i, f := range freq {
				sin, cos := math.Sincos(p * f)
				cs[2*i], cs[2*i+1] = float32(cos), float32(sin)
			}
			for h := range nHeads {
				v := x[(t*nHeads+h)*headDim:][:2*half]
				for i := range half {
					c, s := cs[2*i], cs[2*i+1]
					a, b := v[2*i], v[2*i+1]
					v[2*i] = float32(a*c) - float32(b*s)
					v[2*i+1] = float32(a*s) + float32(b*c)
				}
			}
		}
	})
}

func (b *Backend) SwiGLU(dst, gate, up []float32) {
	n := len(dst)
	gate, up = gate[:n], up[:n]
	b.forRanges(n, 16, func(lo, hi int) {
		b.k.swiglu(dst[lo:hi], gate[lo:hi], up[lo:hi])
	})
}

func (b *Backend) Softmax(x []float32, rows, cols int) {
	if rows <= 0 || cols <= 0 {
		return
	}
	x = x[:rows*cols]
	b.forRanges(rows, 16*cols, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			b.k.softmax(x[i*cols : (i+1)*cols])
		}
	})
}

// Attention runs each (token, head) as one unit: scores by 1×8 dot kernels
// over the token's slots (eight K rows a call), softmax, then the value sum
// in one kernel call. Units are split over threads by their slot counts.
func (b *Backend) Attention(a *kernels.AttentionArgs) {
	nt, H, hd := len(a.Slots), a.NHeads, a.HeadDim
	if nt == 0 || H == 0 || hd == 0 {
		return
	}
	if a.NKVHeads <= 0 || H%a.NKVHeads != 0 {
		panic(fmt.Sprintf("kernels/cpu: Attention: %d heads, %d KV heads", H, a.NKVHeads))
	}
	qDim, kvDim := H*hd, a.NKVHeads*hd
	if len(a.Q) < nt*qDim || len(a.Out) < nt*qDim {
		panic(fmt.Sprintf("kernels/cpu: Attention: %d tokens of %d: len(Q) = %d, len(Out) = %d", nt, qDim, len(a.Q), len(a.Out)))
	}
	var nSlots int
	switch a.KVType {
	case kernels.F32:
		nSlots = min(len(a.K), len(a.V)) / kvDim
	case kernels.F16, kernels.BF16:
		nSlots = min(len(a.K16), len(a.V16)) / kvDim
	default:
		panic(fmt.Sprintf("kernels/cpu: Attention: KV element type %v (want F32, F16 or BF16)", a.KVType))
	}
	total := 0
	for t, slots := range a.Slots {
		for _, s := range slots {
			if s < 0 || int(s) >= nSlots {
				panic(fmt.Sprintf("kernels/cpu: Attention: token %d: slot %d outside the %d-slot pool", t, s, nSlots))
			}
		}
		total += len(slots)
	}
	parts := b.parts(2 * total * H * hd)
	cuts := weightedCuts(nt*H, parts, func(u int) int { return len(a.Slots[u/H]) + 1 })
	b.pool.run(len(cuts)-1, func(p int) {
		sc := b.getScratch(0)
		for u := cuts[p]; u < cuts[p+1]; u++ {
			b.attnHead(a, u/H, u%H, sc)
		}
		b.putScratch(sc)
	})
}

// attnAhead is how many slots ahead of the one they compute the amd64 F32
// attention kernels (attnQK, attnPV) prefetch K and V rows: the slots'
// rows are scattered over the pool, where the hardware prefetchers cannot
// follow them. attnQK rounds it down to whole blocks of 8; 0 turns the
// prefetch off. 32 F32 rows are the bytes of 64 16-bit rows (attnAhead16);
// decode gains as much as at 64 and prefill, whose rows are in cache,
// loses less (docs/kernels.md). Only benchmarks and tests change it, never
// while a kernel runs.
var attnAhead = 32

// attnAhead16 is attnAhead for the 16-bit kernels (attn16_amd64.s
// attnQKF16, attnPVBF16, ...), in 16-bit rows: 64, the bytes of 32 F32
// rows; at 32, decode is slower and prefill the same (docs/kernels.md).
// Read by the assembly like attnAhead.
var attnAhead16 = 64

// attnHead computes one (token, head). An F32 pool and a 16-bit one run
// the same arithmetic in the same order: the 16-bit kernels widen each K
// and V element exactly before it meets the F32 path's multiply-add.
func (b *Backend) attnHead(a *kernels.AttentionArgs, t, h int, sc *[]float32) {
	hd := a.HeadDim
	qDim, kvDim := a.NHeads*hd, a.NKVHeads*hd
	kvOff := h / (a.NHeads / a.NKVHeads) * hd
	slots := a.Slots[t]
	ns := len(slots)
	out := a.Out[t*qDim+h*hd : t*qDim+(h+1)*hd]
	if ns == 0 {
		clear(out)
		return
	}
	if cap(*sc) < ns {
		*sc = make([]float32, ns)
	}
	scores := (*sc)[:ns]
	q := a.Q[t*qDim+h*hd : t*qDim+(h+1)*hd]
	hd8 := hd &^ 7
	kt := a.KVType
	// The head's first element of slot 0 in K and V, and the row stride.
	var kBase, vBase unsafe.Pointer
	stride := kernels.KVElemBytes(kt) * kvDim
	if kt == kernels.F32 {
		kBase, vBase = unsafe.Pointer(&a.K[kvOff]), unsafe.Pointer(&a.V[kvOff])
	} else {
		kBase, vBase = unsafe.Pointer(&a.K16[kvOff]), unsafe.Pointer(&a.V16[kvOff])
	}
	dot := b.k.dot1x8[kt]
	var ptrs [8]unsafe.Pointer
	var d, tail [8]float32
	j0 := 0
	if hd8 == hd {
		// Whole blocks of 8 slots in one call.
		nb := ns / 8
		if nb > 0 {
			if kt == kernels.F32 {
				b.k.attnQK(&scores[0], &q[0], (*float32)(kBase), &slots[0], nb, stride, hd/8, a.Scale)
			} else {
				b.k.attnQK16[kt](&scores[0], &q[0], kBase, &slots[0], nb, stride, hd/8, a.Scale)
			}
		}
		j0 = 8 * nb
	}
	for ; j0 < ns; j0 += 8 {
		nj := min(8, ns-j0)
		for l := range 8 {
			ptrs[l] = unsafe.Add(kBase, int(slots[j0+min(l, nj-1)])*stride)
		}
		dot(&q[0], &ptrs, hd8/8, &d)
		for l := range nj {
			s := d[l]
			if hd8 < hd {
				row := int(slots[j0+l])*kvDim + kvOff
				s = addTail(s, q[hd8:], kvTail(&tail, a.K, a.K16, kt, row+hd8, hd-hd8))
			}
			scores[j0+l] = s * a.Scale
		}
	}
	b.k.softmax(scores)
	if hd8 > 0 {
		if kt == kernels.F32 {
			b.k.attnPV(&out[0], &scores[0], (*float32)(vBase), &slots[0], ns, stride, hd8/8)
		} else {
			b.k.attnPV16[kt](&out[0], &scores[0], vBase, &slots[0], ns, stride, hd8/8)
		}
	}
	for c := hd8; c < hd; c++ {
		var s float32
		for j, sl := range slots {
			i := int(sl)*kvDim + kvOff + c
			s += float32(scores[j] * kvTail(&tail, a.V, a.V16, kt, i, 1)[0])
		}
		out[c] = s
	}
}

// kvTail returns the n (≤ 8) elements of a K or V layer from element off on
// as float32: the F32 layer's own, or the 16-bit layer's widened exactly
// into buf.
func kvTail(buf *[8]float32, f []float32, h []uint16, kt kernels.DType, off, n int) []float32 {
	switch kt {
	case kernels.F32:
		return f[off : off+n]
	case kernels.BF16:
		for i, v := range h[off : off+n] {
			buf[i] = kernels.BF16ToF32(v)
		}
	default:
		for i, v := range h[off : off+n] {
			buf[i] = kernels.F16ToF32(v)
		}
	}
	return buf[:n]
}

// weightedCuts splits units [0,n) into at most parts contiguous ranges of
// about equal total weight; it returns the boundaries (first 0, last n).
func weightedCuts(n, parts int, weight func(u int) int) []int {
	parts = max(1, min(parts, n))
	if parts == 1 {
		return []int{0, n}
	}
	total := 0
	for u := range n {
		total += weight(u)
	}
	cuts := make([]int, 1, parts+1)
	acc, next := 0, 1
	for u := range n {
		acc += weight(u)
		if next < parts && acc*parts >= next*total && u+1 < n {
			cuts = append(cuts, u+1)
			next++
		}
	}
	return append(cuts, n)
}

// IndexScore scores a token's slots eight at a time: the eight keys are
// decoded to float32 once, then each head's query meets them in a 1×8 dot
// kernel. Work is split over (token, run of slots).
func (b *Backend) IndexScore(a *kernels.IndexScoreArgs) {
	nt, H := len(a.Slots), a.NHeads
	keys := a.Keys
	d := keys.Dim
	if nt == 0 || H <= 0 || d <= 0 {
		return
	}
	if len(a.Q) < nt*H*d || len(a.W) < nt*H || len(a.Out) < nt {
		panic(fmt.Sprintf("kernels/cpu: IndexScore: %d tokens × %d heads × %d: len(Q) = %d, len(W) = %d, len(Out) = %d", nt, H, d, len(a.Q), len(a.W), len(a.Out)))
	}
	var nKeys int
	switch keys.DType {
	case kernels.IndexFP8:
		nKeys = min(len(keys.FP8)/d, len(keys.Scales))
	case kernels.IndexBF16:
		nKeys = len(keys.BF16) / d
	default:
		panic(fmt.Sprintf("kernels/cpu: IndexScore: key dtype %v", keys.DType))
	}
	total := 0
	for t, slots := range a.Slots {
		if len(a.Out[t]) < len(slots) {
			panic(fmt.Sprintf("kernels/cpu: IndexScore: token %d: %d slots, len(Out) = %d", t, len(slots), len(a.Out[t])))
		}
		for _, s := range slots {
			if s < 0 || int(s) >= nKeys {
				panic(fmt.Sprintf("kernels/cpu: IndexScore: token %d: slot %d outside the %d keys", t, s, nKeys))
			}
		}
		total += len(slots)
	}
	// Runs of at most chunk slots (a multiple of 8) of one token each.
	parts := b.parts(total * (H + 1) * d)
	chunk := max(64, ceilDiv(ceilDiv(total, parts), 8)*8)
	type run struct{ t, j0, j1 int }
	var runs []run
	for t, slots := range a.Slots {
		for j := 0; j < len(slots); j += chunk {
			runs = append(runs, run{t, j, min(len(slots), j+chunk)})
		}
	}
	cuts := weightedCuts(len(runs), parts, func(i int) int { return runs[i].j1 - runs[i].j0 + 8 })
	ds := (d + 7) &^ 7
	scratch := 8 * ds
	if d%8 == 0 {
		scratch = (indexBatch + 8) * d
	}
	b.pool.run(len(cuts)-1, func(p int) {
		sc := b.getScratch(scratch)
		for _, r := range runs[cuts[p]:cuts[p+1]] {
			b.indexRun(a, r.t, r.j0, r.j1, *sc, ds)
		}
		b.putScratch(sc)
	})
}

func (b *Backend) indexRun(a *kernels.IndexScoreArgs, t, j0, j1 int, kbuf []float32, ds int) {
	keys := a.Keys
	d, H := keys.Dim, a.NHeads
	slots := a.Slots[t][j0:j1]
	out := a.Out[t][j0:j1]
	if d%8 == 0 {
		// Decode a batch of keys, score them 8 at a time in one kernel call.
		q := a.Q[t*H*d : (t+1)*H*d]
		w := a.W[t*H : (t+1)*H]
		for s0 := 0; s0 < len(slots); s0 += indexBatch {
			s1 := min(len(slots), s0+indexBatch)
			nk := s1 - s0
			b.k.decodeKeys(kbuf, keys, slots[s0:s1])
			full := nk / 8
			if full > 0 {
				b.k.indexScore8(&out[s0], &q[0], &w[0], H, &kbuf[0], full, d/8)
			}
			if rem := nk - 8*full; rem > 0 {
				last := kbuf[(nk-1)*d : nk*d]
				for l := rem; l < 8; l++ {
					copy(kbuf[(8*full+l)*d:], last)
				}
				var tmp [8]float32
				b.k.indexScore8(&tmp[0], &q[0], &w[0], H, &kbuf[8*full*d], 1, d/8)
				copy(out[s0+8*full:s1], tmp[:rem])
			}
		}
		return
	}
	d8 := d &^ 7
	dot := b.k.dot1x8[kernels.F32]
	var ptrs [8]unsafe.Pointer
	var dots, acc [8]float32
	for jb := 0; jb < len(slots); jb += 8 {
		nj := min(8, len(slots)-jb)
		for l := range nj {
			b.decodeKey(kbuf[l*ds:l*ds+d], keys, int(slots[jb+l]))
		}
		for l := range 8 {
			ptrs[l] = unsafe.Pointer(&kbuf[min(l, nj-1)*ds])
		}
		acc = [8]float32{}
		for h := range H {
			q := a.Q[(t*H+h)*d : (t*H+h+1)*d]
			dot(&q[0], &ptrs, d8/8, &dots)
			wh := a.W[t*H+h]
			for l := range nj {
				s := addTail(dots[l], q[d8:], kbuf[l*ds+d8:l*ds+d])
				acc[l] += float32(wh * max(s, 0))
			}
		}
		copy(out[jb:jb+nj], acc[:nj])
	}
}

// indexBatch is how many keys IndexScore decodes at a time (a multiple of
// 8; 256 keys of 32 floats stay in L1).
const indexBatch = 256

// decodeKey writes the float32 index key of slot s, exactly as
// ref.IndexKey does.
func (b *Backend) decodeKey(dst []float32, keys *kernels.IndexKeys, s int) {
	d := keys.Dim
	d8 := d &^ 7
	switch keys.DType {
	case kernels.IndexFP8:
		src, scale := keys.FP8[s*d:(s+1)*d], keys.Scales[s]
		if d8 > 0 {
			b.k.cvtFP8(&dst[0], &src[0], d8/8, scale)
		}
		for c := d8; c < d; c++ {
			dst[c] = kernels.FP8ToF32(src[c]) * scale
		}
	case kernels.IndexBF16:
		src := keys.BF16[s*d : (s+1)*d]
		if d8 > 0 {
			b.k.cvt[kernels.BF16](&dst[0], unsafe.Pointer(&src[0]), d8/8)
		}
		for c := d8; c < d; c++ {
			dst[c] = kernels.BF16ToF32(src[c])
		}
	}
}

// TopK keeps the k best of a min-heap while scanning once (O(n log k)),
// then sorts the chosen indices. Scores map to ordered keys in which NaN
// is lowest and ties go to the lower index, as in ref.CompareScores.
func (b *Backend) TopK(dst []int32, scores []float32, k int) []int32 {
	n := len(scores)
	k = min(k, n)
	out := dst[:0]
	if k <= 0 {
		return out
	}
	if k == n {
		for i := range n {
			out = append(out, int32(i))
		}
		return out
	}
	heap := make([]uint64, k)
	for i := range k {
		heap[i] = rankKey(scores[i], i)
	}
	for i := k/2 - 1; i >= 0; i-- {
		siftDown(heap, i)
	}
	for i := k; i < n; i++ {
		if key := rankKey(scores[i], i); key > heap[0] {
			heap[0] = key
			siftDown(heap, 0)
		}
	}
	for _, key := range heap {
		out = append(out, int32(^uint32(key)))
	}
	slices.Sort(out)
	return out
}

// rankKey orders (score, index) pairs: a higher key is a better pair.
// The high word is the score as an ordered integer (NaN lowest, -0 = +0),
// the low word the complemented index (lower index wins a tie).
func rankKey(v float32, i int) uint64 {
	var o uint32
	bits := math.Float32bits(v)
	switch {
	case v != v:
		o = 0
	case v == 0:
		o = 1 << 31
	case bits>>31 != 0:
		o = ^bits
	default:
		o = bits | 1<<31
	}
	return uint64(o)<<32 | uint64(^uint32(i))
}

// siftDown restores the min-heap property below i.
func siftDown(h []uint64, i int) {
	n := len(h)
	for {
		c := 2*i + 1
		if c >= n {
			return
		}
		if c+1 < n && h[c+1] < h[c] {
			c++
		}
		if h[i] <= h[c] {
			return
		}
		h[i], h[c] = h[c], h[i]
		i = c
	}
}

func (b *Backend) QuantizeFP8(dst []uint8, src []float32) float32 {
	var amax float32
	for _, v := range src {
		amax = max(amax, float32(math.Abs(float64(v))))
	}
	scale := kernels.FP8Scale(amax)
	dst = dst[:len(src)]
	for i, v := range src {
		dst[i] = kernels.F32ToFP8(v / scale)
	}
	return scale
}

func (b *Backend) DequantizeFP8(dst []float32, src []uint8, scale float32) {
	n := len(src)
	dst = dst[:n]
	n8 := n &^ 7
	if n8 > 0 {
		b.k.cvtFP8(&dst[0], &src[0], n8/8, scale)
	}
	for i := n8; i < n; i++ {
		dst[i] = kernels.FP8ToF32(src[i]) * scale
	}
}

func (b *Backend) ToBF16(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	for i, v := range src {
		dst[i] = kernels.F32ToBF16(v)
	}
}

func (b *Backend) FromBF16(dst []float32, src []uint16) {
	n := len(src)
	dst = dst[:n]
	n8 := n &^ 7
	if n8 > 0 {
		b.k.cvt[kernels.BF16](&dst[0], unsafe.Pointer(&src[0]), n8/8)
	}
	for i := n8; i < n; i++ {
		dst[i] = kernels.BF16ToF32(src[i])
	}
}
