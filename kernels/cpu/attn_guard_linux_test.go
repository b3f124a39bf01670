//go:build amd64

package cpu

import (
	"fmt"
	"math/rand/v2"
	"syscall"
	"testing"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// TestAttnPrefetchInsideSlots runs the assembly attention kernels, F32 and
// 16-bit, with the slot list ending at the end of a page that an
// unreadable page follows: a kernel that read a slot index past the list
// (to prefetch its row) would fault. The results must be those of the
// same slots in an ordinary slice.
func TestAttnPrefetchInsideSlots(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	page := syscall.Getpagesize()
	mem, err := syscall.Mmap(-1, 0, 2*page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Skip("mmap:", err)
	}
	defer syscall.Munmap(mem)
	if err := syscall.Mprotect(mem[page:], syscall.PROT_NONE); err != nil {
		t.Skip("mprotect:", err)
	}
	defer func(old int) { attnAhead = old }(attnAhead)
	defer func(old int) { attnAhead16 = old }(attnAhead16)
	asm := avx2Kernels()
	r := rand.New(rand.NewPCG(34, 34))
	for _, d := range []kernels.DType{kernels.F32, kernels.F16, kernels.BF16} {
		for _, n8 := range []int{1, 6, 8, 16} {
			for i, ns := range []int{1, 8, 33, 40, 65, 72, 73, 136, 300} {
				c := &attn16Case{d: d, pool: 50, n8: n8, rowLen: 8*n8 + 8, off: 8}
				if i%2 == 1 {
					c.rowLen, c.off = (8*n8+15)&^15, 0
				}
				if d == kernels.F32 {
					c.kw, c.vw = lineAligned(wideVec(r, c.pool*c.rowLen)), lineAligned(wideVec(r, c.pool*c.rowLen))
				} else {
					if i%2 == 1 {
						c.rowLen = (8*n8 + 31) &^ 31
					}
					c.k16, c.v16 = lineAligned(rand16(r, c.pool*c.rowLen, d)), lineAligned(rand16(r, c.pool*c.rowLen, d))
				}
				c.q = randVec(r, 8*n8, 2)
				c.p = make([]float32, ns)
				for j := range c.p {
					c.p[j] = r.Float32()
				}
				slots := make([]int32, ns)
				for j := range slots {
					slots[j] = int32(r.IntN(c.pool))
				}
				// The list ends at the page's end; for the QK kernels, which
				// take whole blocks of 8, the blocks' part of it does.
				guarded := unsafe.Slice((*int32)(unsafe.Pointer(&mem[page-4*ns])), ns)
				guardedQK := unsafe.Slice((*int32)(unsafe.Pointer(&mem[page-4*(ns&^7)])), ns&^7)
				qk, pv := c.qk32, c.pv32
				if d != kernels.F32 {
					qk, pv = c.qk16, c.pv16
				}
				aheads := attnAheads
				if d != kernels.F32 {
					aheads = attn16Aheads
				}
				for _, ahead := range aheads {
					attnAhead, attnAhead16 = ahead, ahead
					c.slots = slots
					what := fmt.Sprintf("%v ahead=%d", c, ahead)
					wantQK, wantPV := qk(asm), pv(asm)
					copy(guardedQK, slots)
					c.slots = guardedQK
					sameBits(t, "QK, slots at a page's end, "+what, qk(asm), wantQK)
					copy(guarded, slots)
					c.slots = guarded
					sameBits(t, "PV, slots at a page's end, "+what, pv(asm), wantPV)
				}
			}
		}
	}
}
