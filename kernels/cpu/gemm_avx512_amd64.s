//go:build amd64

#include "textflag.h"
#include "dot_amd64.h"

// AVX-512 prefill micro-kernel (F + DQ + VL), chosen at run time
// (kern_amd64.go). Each dot product is the canonical one of kern_amd64.s:
// an 8-lane accumulator from +0, one VFMADD231PS per 8 elements in
// increasing k, then ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), each add with
// the same operands in the same order as REDUCE4 and STORE8, so the bits
// are those of dot3x4F32 and dot1x8F32.
//
// What changes is the packing: one zmm holds the accumulators of two W
// rows, p in the low 256 bits and p+4 in the high, against one x row. The
// panel of 8 W rows is packed (pack8Z) so that the four zmm of an
// 8-column step are 256 consecutive bytes, and x's 8 floats are broadcast
// to both halves by VBROADCASTF32X8. A tile of 6 x rows × 8 W rows holds
// 24 accumulators; per step it makes 4 loads of W, 6 broadcasts of x and
// 24 FMAs.

// ZERO24 clears the accumulators Z0..Z23.
#define ZERO24 \
	VXORPS Z0, Z0, Z0; VXORPS Z1, Z1, Z1; VXORPS Z2, Z2, Z2; VXORPS Z3, Z3, Z3; \
	VXORPS Z4, Z4, Z4; VXORPS Z5, Z5, Z5; VXORPS Z6, Z6, Z6; VXORPS Z7, Z7, Z7; \
	VXORPS Z8, Z8, Z8; VXORPS Z9, Z9, Z9; VXORPS Z10, Z10, Z10; VXORPS Z11, Z11, Z11; \
	VXORPS Z12, Z12, Z12; VXORPS Z13, Z13, Z13; VXORPS Z14, Z14, Z14; VXORPS Z15, Z15, Z15; \
	VXORPS Z16, Z16, Z16; VXORPS Z17, Z17, Z17; VXORPS Z18, Z18, Z18; VXORPS Z19, Z19, Z19; \
	VXORPS Z20, Z20, Z20; VXORPS Z21, Z21, Z21; VXORPS Z22, Z22, Z22; VXORPS Z23, Z23, Z23

// ROW8 adds x's 8 floats at mem, broadcast into xb, times the packed W step
// in Z24..Z27 into the accumulators a0..a3 of one x row.
#define ROW8(mem, xb, a0, a1, a2, a3) \
	VBROADCASTF32X8 mem, xb; \
	VFMADD231PS     Z24, xb, a0; \
	VFMADD231PS     Z25, xb, a1; \
	VFMADD231PS     Z26, xb, a2; \
	VFMADD231PS     Z27, xb, a3

// STORE8Z reduces the accumulators a0..a3 of one x row and stores its 8
// sums at (AX): the per-128-bit shuffles and adds are VHADDPS's (even
// elements first), the last add joins lanes 0-3 and 4-7 of each row, low
// first, as STORE8 does. Clobbers Z24..Z29.
#define STORE8Z(a0, a1, a2, a3) \
	VSHUFPS   $0x88, a1, a0, Z24; \
	VSHUFPS   $0xDD, a1, a0, Z25; \
	VADDPS    Z25, Z24, Z24; \
	VSHUFPS   $0x88, a3, a2, Z26; \
	VSHUFPS   $0xDD, a3, a2, Z27; \
	VADDPS    Z27, Z26, Z26; \
	VSHUFPS   $0x88, Z26, Z24, Z27; \
	VSHUFPS   $0xDD, Z26, Z24, Z28; \
	VADDPS    Z28, Z27, Z27; \
	VSHUFF32X4 $0x08, Z27, Z27, Z28; \
	VSHUFF32X4 $0x0D, Z27, Z27, Z29; \
	VADDPS    Y29, Y28, Y28; \
	VMOVUPS   Y28, (AX)

// ACC24(op) applies op(offset, Zi) to the 24 accumulators and their
// slots at (R13).
#define ACC24(op) \
	op(0, Z0); op(64, Z1); op(128, Z2); op(192, Z3); op(256, Z4); op(320, Z5); \
	op(384, Z6); op(448, Z7); op(512, Z8); op(576, Z9); op(640, Z10); op(704, Z11); \
	op(768, Z12); op(832, Z13); op(896, Z14); op(960, Z15); op(1024, Z16); op(1088, Z17); \
	op(1152, Z18); op(1216, Z19); op(1280, Z20); op(1344, Z21); op(1408, Z22); op(1472, Z23)

#define LOADACC(off, z) VMOVUPS off(R13), z
#define SAVEACC(off, z) VMOVUPS z, off(R13)

// func dot6x8Z(x *float32, xstride, ntiles int, wp *float32, n8 int, out *float32, ostride int, acc *float32, mode int)
// Tile t covers x rows 6t..6t+5 (x + (6t+i)·xstride bytes) and writes 8
// sums at out + (6t+i)·ostride bytes. Its 24 accumulators start from +0,
// or from acc + 1536t bytes if mode&1; if mode&2 they are saved there
// instead of reduced, so that a dot product can run over consecutive
// column ranges in several calls with the bits of one.
TEXT ·dot6x8Z(SB), NOSPLIT, $0-72
	MOVQ x+0(FP), R9
	MOVQ xstride+8(FP), BX
	MOVQ ntiles+16(FP), DX
	MOVQ wp+24(FP), R12
	MOVQ out+40(FP), R10
	MOVQ ostride+48(FP), R11
	MOVQ acc+56(FP), R13
	TESTQ DX, DX
	JZ   done

tile:
	MOVQ  R9, SI
	LEAQ  (R9)(BX*2), R8
	ADDQ  BX, R8
	MOVQ  R12, DI
	TESTQ $1, mode+64(FP)
	JNZ   resume
	ZERO24
	JMP   start

resume:
	ACC24(LOADACC)

start:
	MOVQ  n8+32(FP), CX
	TESTQ CX, CX
	JZ    reduce

loop:
	VMOVUPS 0(DI), Z24
	VMOVUPS 64(DI), Z25
	VMOVUPS 128(DI), Z26
	VMOVUPS 192(DI), Z27
	ROW8((SI), Z28, Z0, Z1, Z2, Z3)
	ROW8((SI)(BX*1), Z29, Z4, Z5, Z6, Z7)
	ROW8((SI)(BX*2), Z30, Z8, Z9, Z10, Z11)
	ROW8((R8), Z31, Z12, Z13, Z14, Z15)
	ROW8((R8)(BX*1), Z28, Z16, Z17, Z18, Z19)
	ROW8((R8)(BX*2), Z29, Z20, Z21, Z22, Z23)
	ADDQ    $32, SI
	ADDQ    $32, R8
	ADDQ    $256, DI
	DECQ    CX
	JNZ     loop

reduce:
	TESTQ $2, mode+64(FP)
	JZ    sums
	ACC24(SAVEACC)
	JMP   next

sums:
	MOVQ R10, AX
	STORE8Z(Z0, Z1, Z2, Z3)
	ADDQ R11, AX
	STORE8Z(Z4, Z5, Z6, Z7)
	ADDQ R11, AX
	STORE8Z(Z8, Z9, Z10, Z11)
	ADDQ R11, AX
	STORE8Z(Z12, Z13, Z14, Z15)
	ADDQ R11, AX
	STORE8Z(Z16, Z17, Z18, Z19)
	ADDQ R11, AX
	STORE8Z(Z20, Z21, Z22, Z23)
	ADDQ R11, AX
	MOVQ AX, R10

next:
	ADDQ $1536, R13
	LEAQ (R9)(BX*4), R9
	LEAQ (R9)(BX*2), R9
	DECQ DX
	JNZ  tile

done:
	VZEROUPPER
	RET

// FMAS12 issues one FMA on each of 12 independent accumulators.
#define FMAS12(r, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11) \
	VFMADD231PS r, r, a0; VFMADD231PS r, r, a1; VFMADD231PS r, r, a2; \
	VFMADD231PS r, r, a3; VFMADD231PS r, r, a4; VFMADD231PS r, r, a5; \
	VFMADD231PS r, r, a6; VFMADD231PS r, r, a7; VFMADD231PS r, r, a8; \
	VFMADD231PS r, r, a9; VFMADD231PS r, r, a10; VFMADD231PS r, r, a11

// FMAPEAK is the body of fmaPeakZ and fmaPeakY, which differ only in the
// registers' width: r cleared, then CX (n) iterations of FMAS12 twice on
// the accumulators a0..a11.
#define FMAPEAK(r, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11) \
	VXORPS r, r, r; \
	TESTQ  CX, CX; \
	JZ     done; \
loop: \
	FMAS12(r, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11); \
	FMAS12(r, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11); \
	DECQ   CX; \
	JNZ    loop; \
done: \
	VZEROUPPER; \
	RET

// func fmaPeakZ(n int)
// n iterations of 24 independent 512-bit FMAs (12 chains, twice).
TEXT ·fmaPeakZ(SB), NOSPLIT, $0-8
	MOVQ n+0(FP), CX
	FMAPEAK(Z12, Z0, Z1, Z2, Z3, Z4, Z5, Z6, Z7, Z8, Z9, Z10, Z11)

// func fmaPeakY(n int)
// n iterations of 24 independent 256-bit FMAs (12 chains, twice).
TEXT ·fmaPeakY(SB), NOSPLIT, $0-8
	MOVQ n+0(FP), CX
	FMAPEAK(Y12, Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11)

// func pack8Z(dst *float32, w *[8]unsafe.Pointer, n8 int)
// Per 8 columns: rows 0 and 4, 1 and 5, 2 and 6, 3 and 7, 8 floats each.
TEXT ·pack8Z(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	LOADW8
	XORQ AX, AX
	TESTQ CX, CX
	JZ   done

loop:
	VMOVUPS (R8)(AX*1), Y0
	VMOVUPS (R12)(AX*1), Y1
	VMOVUPS (R9)(AX*1), Y2
	VMOVUPS (R13)(AX*1), Y3
	VMOVUPS (R10)(AX*1), Y4
	VMOVUPS (R14)(AX*1), Y5
	VMOVUPS (R11)(AX*1), Y6
	VMOVUPS (DX)(AX*1), Y7
	VMOVUPS Y0, 0(SI)
	VMOVUPS Y1, 32(SI)
	VMOVUPS Y2, 64(SI)
	VMOVUPS Y3, 96(SI)
	VMOVUPS Y4, 128(SI)
	VMOVUPS Y5, 160(SI)
	VMOVUPS Y6, 192(SI)
	VMOVUPS Y7, 224(SI)
	ADDQ    $32, AX
	ADDQ    $256, SI
	DECQ    CX
	JNZ     loop

done:
	VZEROUPPER
	RET
