package cpu

import (
	"fmt"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// MatMul computes dst[i][r] = Σ_c x[i][c]·W[r][c].
//
// Work is cut into parts over W rows (panels of 8) and, when there are too
// few panels for the threads, over x rows too. Inside a part:
//
//   - fewer than 3 x rows (decode): each x row meets 8 W rows at a time in a
//     1×8 kernel that reads the weights in their own encoding (F16/BF16/Q8_0
//     decoded in registers), so decode reads the fewest bytes; Q8_0 uses
//     the paired AVX-512 kernel instead where there is one (q8Pairs); the
//     F32/F16/BF16 kernels prefetch the next panel as they go (prefetch);
//     with one x row the F32/F16/BF16 kernel loops over the part's
//     panels in one call (stream);
//   - otherwise (prefill): a panel of 8 W rows is decoded to float32 once
//     (F32 is used in place) and register tiles sweep a cache-sized block
//     of x rows over it: 6×8 tiles on a packed copy of the panel where
//     the CPU has AVX-512 (dot6x8), then 3×4 tiles, and the 1×8 kernel on
//     the panel for the rows left over.
//
// Every kernel accumulates a dot product the same way (kernelSet), and a
// decoded weight is the same float32 in every path, so all paths give the
// same bits for the same (x row, W row).
func (b *Backend) MatMul(dst, x []float32, w *kernels.Matrix, m int) {
	if m <= 0 {
		return
	}
	n, k := w.Rows, w.Cols
	if len(x) < m*k || len(dst) < m*n {
		panic(fmt.Sprintf("kernels/cpu: MatMul of %d×%d by %v %d×%d: len(x) = %d, len(dst) = %d", m, k, w.DType, n, k, len(x), len(dst)))
	}
	rb, err := kernels.RowBytes(w.DType, k)
	if err != nil || len(w.Data) < rb*n {
		panic(fmt.Sprintf("kernels/cpu: MatMul: malformed %v matrix %d×%d (%d bytes)", w.DType, n, k, len(w.Data)))
	}
	mm := matmul{b: b, dst: dst, x: x, w: w, m: m, n: n, k: k, rb: rb}
	parts := b.parts(m * n * k)
	panels := ceilDiv(n, panel)
	pn, pm := parts, 1
	if panels < parts {
		pn = panels
		pm = min(ceilDiv(parts, panels), ceilDiv(m, tileRows))
	}
	nChunk := ceilDiv(panels, pn) * panel
	mChunk := ceilDiv(ceilDiv(m, tileRows), pm) * tileRows
	pn, pm = ceilDiv(n, nChunk), ceilDiv(m, mChunk)
	b.pool.run(pm*pn, func(p int) {
		i0, r0 := p/pn*mChunk, p%pn*nChunk
		mm.part(i0, min(m, i0+mChunk), r0, min(n, r0+nChunk))
	})
}

// panel is the number of W rows a kernel call covers.
const panel = 8

// xBlockBytes bounds the block of x rows swept over one panel, to keep it
// in L2 (1 MiB per core on Zen 5) while the panel's slice stays in L1: half of
// L2 measured faster than a quarter (fewer passes over W) and than three
// quarters (the block no longer stays).
const xBlockBytes = 512 << 10

type matmul struct {
	b       *Backend
	dst, x  []float32
	w       *kernels.Matrix
	m, n, k int
	rb      int // bytes per W row
}

// part computes dst rows [i0,i1) × columns [r0,r1).
func (mm *matmul) part(i0, i1, r0, r1 int) {
	if i1-i0 < 3 {
		mm.rows(i0, i1, r0, r1)
	} else {
		mm.tiles(i0, i1, r0, r1)
	}
}

// rowPtr points at W row r in its own encoding.
func (mm *matmul) rowPtr(r int) unsafe.Pointer {
	return unsafe.Pointer(&mm.w.Data[r*mm.rb])
}

// decodeTail writes the float32 values of W row r from column k8 on.
func (mm *matmul) decodeTail(dst []float32, r, k8 int) {
	row := mm.w.Data[r*mm.rb : (r+1)*mm.rb]
	for c := range dst {
		i := k8 + c
		switch mm.w.DType {
		case kernels.F32:
			dst[c] = *(*float32)(unsafe.Pointer(&row[4*i]))
		case kernels.F16:
			dst[c] = kernels.F16ToF32(uint16(row[2*i]) | uint16(row[2*i+1])<<8)
		case kernels.BF16:
			dst[c] = kernels.BF16ToF32(uint16(row[2*i]) | uint16(row[2*i+1])<<8)
		}
	}
}

// addTail finishes a dot product: s plus x[c]·w[c] for the elements past
// the kernel's multiple of 8, one rounded product and one rounded sum at a
// time. Every path ends its dot products here.
func addTail(s float32, x, w []float32) float32 {
	w = w[:len(x)]
	for c, v := range x {
		s += float32(v * w[c])
	}
	return s
}

// rows is the decode path: 1×8 kernels in the weights' own encoding.
func (mm *matmul) rows(i0, i1, r0, r1 int) {
	if mm.w.DType == kernels.Q8_0 && mm.b.k.q8Pairs != nil {
		r0 = mm.q8Pairs(i0, i1, r0, r1)
	}
	if i1-i0 == 1 && mm.b.k.dot1x8S[mm.w.DType] != nil {
		r0 = mm.stream(i0, r0, r1)
	}
	k, n := mm.k, mm.n
	k8 := k &^ 7
	dot := mm.b.k.dot1x8[mm.w.DType]
	dotP := mm.b.k.dot1x8P[mm.w.DType]
	var ptrs [panel]unsafe.Pointer
	var out [panel]float32
	var tails [panel][7]float32
	for r := r0; r < r1; r += panel {
		nr := min(panel, r1-r)
		for j := range panel {
			ptrs[j] = mm.rowPtr(r + min(j, nr-1))
		}
		if k8 < k {
			for j := range nr {
				mm.decodeTail(tails[j][:k-k8], r+j, k8)
			}
		}
		for i := i0; i < i1; i++ {
			xi := mm.x[i*k : (i+1)*k]
			if pf := mm.prefetch(dotP != nil && i == i0, r, r1, k8/8); pf != nil {
				dotP(&xi[0], &ptrs, k8/8, &out, pf)
			} else {
				dot(&xi[0], &ptrs, k8/8, &out)
			}
			d := mm.dst[i*n+r : i*n+r+nr]
			for j := range d {
				d[j] = addTail(out[j], xi[k8:], tails[j][:])
			}
		}
	}
}

// stream runs dot1x8S for x row i over the whole panels of W rows from r0
// (F32, F16 or BF16 weights), adds the tails past 8·⌊k/8⌋, and returns the
// first row it left. The prefetch runs streamAhead rows ahead of the panel
// being read, as in prefetch: the panels whose region would pass the end of
// the part (r1) run in a second call that prefetches from their own rows.
func (mm *matmul) stream(i, r0, r1 int) int {
	k, n, rb := mm.k, mm.n, mm.rb
	k8 := k &^ 7
	np := (r1 - r0) / panel
	if np == 0 || k8 == 0 {
		return r0
	}
	xi := mm.x[i*k : (i+1)*k]
	d := mm.dst[i*n+r0 : i*n+r0+panel*np]
	w := mm.w.Data[r0*rb : (r0+panel*np)*rb]
	// Panels [0,pa) prefetch inside the part, the rest from themselves.
	ahead, pa := streamAhead, 0
	if ahead > 0 {
		pa = max(0, min(np, (r1-r0-ahead)/panel))
	}
	dot := mm.b.k.dot1x8S[mm.w.DType]
	if pa > 0 {
		dot(&xi[0], unsafe.Pointer(&w[0]), rb, k8/8, pa, &d[0], ahead*rb)
	}
	if pa < np {
		dot(&xi[0], unsafe.Pointer(&w[pa*panel*rb]), rb, k8/8, np-pa, &d[pa*panel], 0)
	}
	if k8 < k {
		var tail [7]float32
		for j := range d {
			mm.decodeTail(tail[:k-k8], r0+j, k8)
			d[j] = addTail(d[j], xi[k8:], tail[:k-k8])
		}
	}
	return r0 + panel*np
}

// streamAhead is how far ahead of the panel it reads, in W rows, the 1×8
// kernel prefetches: the hardware prefetchers follow eight short row
// streams badly, and a software prefetch of the next panel, one sequential
// region as long as the panel, keeps DRAM busy (see docs/kernels.md).
var streamAhead = 8

// prefetch returns where the 1×8 kernel on the panel at W row r (a part
// ending at row r1, n8 steps of 8 columns) prefetches from, or nil for no
// prefetch: only on the first x row, and only inside the part's rows.
func (mm *matmul) prefetch(first bool, r, r1, n8 int) unsafe.Pointer {
	if !first || n8 == 0 || streamAhead == 0 {
		return nil
	}
	span := n8 * 8 * panel * 4 // F32
	if mm.w.DType != kernels.F32 {
		span /= 2 // F16, BF16
	}
	end := r1 * mm.rb
	off := min((r+streamAhead)*mm.rb, end-span)
	if off < r*mm.rb {
		return nil
	}
	return unsafe.Pointer(&mm.w.Data[off])
}

// tiles is the prefill path: float32 panels swept by register tiles.
func (mm *matmul) tiles(i0, i1, r0, r1 int) {
	k, n := mm.k, mm.n
	k8 := k &^ 7
	ks := (k + 7) &^ 7 // scratch row stride
	dt := mm.w.DType
	var wf []float32 // F32 weights in place
	var sc *[]float32
	if dt == kernels.F32 {
		wf = unsafe.Slice((*float32)(unsafe.Pointer(&mm.w.Data[0])), mm.n*k)
	} else {
		sc = mm.b.getScratch(panel * ks)
		defer mm.b.putScratch(sc)
	}
	var packed []float32
	if mm.b.k.dot6x8 != nil && k8 > 0 {
		ps := mm.b.getScratch(panel * k8)
		defer mm.b.putScratch(ps)
		packed = *ps
	}
	mb := max(tileRows, xBlockBytes/(4*k)/tileRows*tileRows)
	kern := mm.b.k
	var rowp [panel]unsafe.Pointer
	var rows [panel][]float32 // the panel's rows as float32
	for b0 := i0; b0 < i1; b0 += mb {
		b1 := min(i1, b0+mb)
		for r := r0; r < r1; r += panel {
			nr := min(panel, r1-r)
			for j := range nr {
				if dt == kernels.F32 {
					rows[j] = wf[(r+j)*k : (r+j+1)*k]
				} else {
					rows[j] = (*sc)[j*ks : j*ks+k]
					if k8 > 0 {
						kern.cvt[dt](&rows[j][0], mm.rowPtr(r+j), k8/8)
					}
					mm.decodeTail(rows[j][k8:], r+j, k8)
				}
			}
			for j := range panel {
				rowp[j] = unsafe.Pointer(&rows[min(j, nr-1)][0])
			}
			s0 := b0
			if packed != nil {
				kern.pack8(&packed[0], &rowp, k8/8)
				s0 = mm.sweep6x8(b0, b1, r, nr, packed)
			}
			mm.sweep3x4(s0, b1, r, nr, &rowp)
			if k8 < k {
				for i := b0; i < b1; i++ {
					xt := mm.x[i*k+k8 : (i+1)*k]
					d := mm.dst[i*n+r : i*n+r+nr]
					for j := range d {
						d[j] = addTail(d[j], xt, rows[j][k8:])
					}
				}
			}
		}
	}
}

// tileRows is the x rows of the largest register tile: the blocks of x
// rows are cut in multiples of it so that only a call's last block has
// leftover rows.
const tileRows = 6

// sweep6x8 computes the sums over the first 8·⌊k/8⌋ columns of x rows
// from b0 in 6×8 tiles against the packed panel at W row r (nr rows), and
// returns the first x row it left.
func (mm *matmul) sweep6x8(b0, b1, r, nr int, packed []float32) int {
	n := mm.n
	nt := (b1 - b0) / 6
	if nt == 0 {
		return b0
	}
	if nr == panel {
		mm.run6x8(b0, nt, packed, &mm.dst[b0*n+r], 4*n)
		return b0 + 6*nt
	}
	var tmp [6 * panel]float32
	for t := range nt {
		i := b0 + 6*t
		mm.run6x8(i, 1, packed, &tmp[0], 4*panel)
		for ii := range 6 {
			copy(mm.dst[(i+ii)*n+r:(i+ii)*n+r+nr], tmp[panel*ii:panel*ii+nr])
		}
	}
	return b0 + 6*nt
}

// kStep bounds the columns one dot6x8 call covers: 8 W rows and 6 x rows
// of 512 columns take 28 KiB, so that the panel's slice stays in L1 while
// the tiles of the block sweep it. Longer rows are cut into even ranges,
// the accumulators carried from one to the next, which changes no bit.
const kStep = 512

// run6x8 runs nt 6×8 tiles from x row i, range of columns by range of
// columns, and stores the sums at out (ostride bytes apart).
func (mm *matmul) run6x8(i, nt int, packed []float32, out *float32, ostride int) {
	k := mm.k
	k8 := k &^ 7
	ranges := ceilDiv(k8, kStep)
	kc := ceilDiv(k8/8, ranges) * 8
	var acc *float32
	if ranges > 1 {
		sc := mm.b.getScratch(nt * 384)
		defer mm.b.putScratch(sc)
		acc = &(*sc)[0]
	}
	for c0 := 0; c0 < k8; c0 += kc {
		mode := 0
		if c0 > 0 {
			mode |= 1
		}
		if c0+kc < k8 {
			mode |= 2
		}
		mm.b.k.dot6x8(&mm.x[i*k+c0], 4*k, nt, &packed[8*c0], min(kc, k8-c0)/8, out, ostride, acc, mode)
	}
}

// sweep3x4 computes the same sums for x rows [b0,b1) in 3×4 tiles, and
// the rows left over with the 1×8 kernel.
func (mm *matmul) sweep3x4(b0, b1, r, nr int, rowp *[panel]unsafe.Pointer) {
	k, n := mm.k, mm.n
	k8 := k &^ 7
	kern := mm.b.k
	nt := (b1 - b0) / 3
	var tmp [12]float32
	for h := 0; h < nr; h += 4 {
		w4 := (*[4]unsafe.Pointer)(rowp[h : h+4])
		if nr-h >= 4 {
			if nt > 0 {
				kern.dot3x4(&mm.x[b0*k], 4*k, nt, w4, k8/8, &mm.dst[b0*n+r+h], 4*n)
			}
			continue
		}
		for t := range nt {
			i := b0 + 3*t
			kern.dot3x4(&mm.x[i*k], 4*k, 1, w4, k8/8, &tmp[0], 16)
			for ii := range 3 {
				copy(mm.dst[(i+ii)*n+r+h:(i+ii)*n+r+nr], tmp[4*ii:4*ii+nr-h])
			}
		}
	}
	var out [panel]float32
	for i := b0 + 3*nt; i < b1; i++ {
		kern.dot1x8[kernels.F32](&mm.x[i*k], rowp, k8/8, &out)
		copy(mm.dst[i*n+r:i*n+r+nr], out[:nr])
	}
}

// q8Pairs runs the paired Q8_0 kernel on as many W rows from r0 as it
// takes whole groups of, for x rows [i0,i1) (one or two), and returns the
// first row it left to the 1×8 kernel. One x row: groups of 8 W rows,
// paired (r, r+4). Two x rows: groups of 4 W rows, each paired with itself
// against both x rows.
func (mm *matmul) q8Pairs(i0, i1, r0, r1 int) int {
	k, n, rb := mm.k, mm.n, mm.rb
	rows := 8 / (i1 - i0)
	ng := (r1 - r0) / rows
	if ng == 0 {
		return r0
	}
	sc := mm.b.getScratch(2 * k)
	defer mm.b.putScratch(sc)
	x0 := mm.x[i0*k : (i0+1)*k]
	x1 := mm.x[(i1-1)*k : i1*k]
	w := mm.w.Data[r0*rb : (r0+ng*rows)*rb]
	var ok bool
	if i1-i0 == 1 {
		ok = mm.b.k.q8Pairs(*sc, x0, x1, w, rb, rb, 4*rb, 8*rb, ng, mm.dst[i0*n+r0:i0*n+r0+8*ng], 32, 16)
	} else {
		ok = mm.b.k.q8Pairs(*sc, x0, x1, w, rb, rb, 0, 4*rb, ng, mm.dst[i0*n+r0:i1*n], 16, 4*n)
	}
	if !ok {
		// A sum that is not finite, perhaps from a scale that is not: all
		// again with the 1×8 kernel, which is exact for those too.
		return r0
	}
	return r0 + ng*rows
}
