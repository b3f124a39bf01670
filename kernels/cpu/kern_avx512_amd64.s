//go:build amd64

#include "textflag.h"

// AVX-512 decode kernel for Q8_0 weights (F + BW + VL + VBMI), chosen at run
// time (kern_amd64.go). Every dot product is computed exactly as the AVX2
// kernels compute it (see kern_amd64.s): one 8-lane accumulator from +0,
// element c in lane c%8 in increasing c, one fused multiply-add per element
// by the dequantized weight d·q (exact in float32), then the canonical
// horizontal sum ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
//
// What changes is the packing: one 512-bit register carries two dot
// products, "lo" in the even lanes and "hi" in the odd lanes (lanes 2l and
// 2l+1 are lane l of each): two W rows against one x row (one token), or
// one W row against two x rows (two tokens). Per 16 weights that is one
// VPERMB, one VFMSUB213PS and one VFMADD231PS (plus, per 64 weights, one
// VINSERTI64X4 and one VPXORD), where the AVX2 kernel needs two
// VPMOVSXBD, two VCVTDQ2PS, two VMULPS and two VFMADD231PS:
//
//   - the 32 int8 of a block of each row sit in one register, lo row
//     first, with their sign bits flipped: u = q+128, in [0, 255];
//   - VPERMB, merging into a copy of 0x4b000000 in every dword, puts u
//     into byte 1 of its dword: the float32 f = 2^23 + 256·u, exactly;
//   - VFMSUB213PS gives f·d' − K with d' = d·2^-8 and K = d'·(2^23+2^15)
//     (a table over all 65536 halves, d widened by VCVTPH2PS as in the
//     AVX2 kernels): the exact value is d'·256·(u−128) = d·q, which has at
//     most 19 significant bits, and K has at most 20 (d has 11), so both
//     are exact whenever d is finite, and the one rounding changes nothing;
//   - VFMADD231PS adds x·(d·q) into the lane, x duplicated or interleaved
//     to match (the xd buffer, built at entry).
//
// A zero weight may come out +0 where the AVX2 kernel has −0; that cannot
// change a sum (an accumulator starting at +0 never becomes −0). An
// infinite or NaN scale makes every weight of its block NaN here, so the
// row's sum is NaN: the kernel reports any non-finite sum and the caller
// then recomputes those rows with the AVX2 kernel.

// q8zidx: the VPERMB indices of the four 8-element steps of a block: byte 1
// of dword lane j of step c takes byte 8c + j/2 of the lo row (j even) or
// of the hi row (j odd, +32); the other bytes are masked off.
DATA q8zidx<>+0(SB)/8, $0x0000200000000000
DATA q8zidx<>+8(SB)/8, $0x0000210000000100
DATA q8zidx<>+16(SB)/8, $0x0000220000000200
DATA q8zidx<>+24(SB)/8, $0x0000230000000300
DATA q8zidx<>+32(SB)/8, $0x0000240000000400
DATA q8zidx<>+40(SB)/8, $0x0000250000000500
DATA q8zidx<>+48(SB)/8, $0x0000260000000600
DATA q8zidx<>+56(SB)/8, $0x0000270000000700
DATA q8zidx<>+64(SB)/8, $0x0000280000000800
DATA q8zidx<>+72(SB)/8, $0x0000290000000900
DATA q8zidx<>+80(SB)/8, $0x00002a0000000a00
DATA q8zidx<>+88(SB)/8, $0x00002b0000000b00
DATA q8zidx<>+96(SB)/8, $0x00002c0000000c00
DATA q8zidx<>+104(SB)/8, $0x00002d0000000d00
DATA q8zidx<>+112(SB)/8, $0x00002e0000000e00
DATA q8zidx<>+120(SB)/8, $0x00002f0000000f00
DATA q8zidx<>+128(SB)/8, $0x0000300000001000
DATA q8zidx<>+136(SB)/8, $0x0000310000001100
DATA q8zidx<>+144(SB)/8, $0x0000320000001200
DATA q8zidx<>+152(SB)/8, $0x0000330000001300
DATA q8zidx<>+160(SB)/8, $0x0000340000001400
DATA q8zidx<>+168(SB)/8, $0x0000350000001500
DATA q8zidx<>+176(SB)/8, $0x0000360000001600
DATA q8zidx<>+184(SB)/8, $0x0000370000001700
DATA q8zidx<>+192(SB)/8, $0x0000380000001800
DATA q8zidx<>+200(SB)/8, $0x0000390000001900
DATA q8zidx<>+208(SB)/8, $0x00003a0000001a00
DATA q8zidx<>+216(SB)/8, $0x00003b0000001b00
DATA q8zidx<>+224(SB)/8, $0x00003c0000001c00
DATA q8zidx<>+232(SB)/8, $0x00003d0000001d00
DATA q8zidx<>+240(SB)/8, $0x00003e0000001e00
DATA q8zidx<>+248(SB)/8, $0x00003f0000001f00
GLOBL q8zidx<>(SB), RODATA|NOPTR, $256

// q8zx: VPERMT2PS indices interleaving 8 floats of x0 (table 1) and x1
// (table 2): x0[0], x1[0], x0[1], x1[1], ...
DATA q8zx<>+0(SB)/8, $0x0000001000000000
DATA q8zx<>+8(SB)/8, $0x0000001100000001
DATA q8zx<>+16(SB)/8, $0x0000001200000002
DATA q8zx<>+24(SB)/8, $0x0000001300000003
DATA q8zx<>+32(SB)/8, $0x0000001400000004
DATA q8zx<>+40(SB)/8, $0x0000001500000005
DATA q8zx<>+48(SB)/8, $0x0000001600000006
DATA q8zx<>+56(SB)/8, $0x0000001700000007
GLOBL q8zx<>(SB), RODATA|NOPTR, $64

// q8zdeint: VPERMPS indices moving the even lanes (lo) to the low half and
// the odd lanes (hi) to the high half.
DATA q8zdeint<>+0(SB)/8, $0x0000000200000000
DATA q8zdeint<>+8(SB)/8, $0x0000000600000004
DATA q8zdeint<>+16(SB)/8, $0x0000000a00000008
DATA q8zdeint<>+24(SB)/8, $0x0000000e0000000c
DATA q8zdeint<>+32(SB)/8, $0x0000000300000001
DATA q8zdeint<>+40(SB)/8, $0x0000000700000005
DATA q8zdeint<>+48(SB)/8, $0x0000000b00000009
DATA q8zdeint<>+56(SB)/8, $0x0000000f0000000d
GLOBL q8zdeint<>(SB), RODATA|NOPTR, $64

// q8zmagic: 0x4b000000 (2^23), and the sign bit of a byte.
DATA q8zmagic<>+0(SB)/4, $0x4b000000
DATA q8zmagic<>+4(SB)/4, $0x00000080
GLOBL q8zmagic<>(SB), RODATA|NOPTR, $8

// ZREDUCE4 is REDUCE4 of kern_amd64.s: ya gets, per 128-bit half, the
// partial sums of ya, yb, yc, yd. Clobbers yc.
#define ZREDUCE4(ya, yb, yc, yd) \
	VHADDPS yb, ya, ya; \
	VHADDPS yd, yc, yc; \
	VHADDPS yc, ya, ya

// ZSTEP: one 8-element step c of a pair: f from the bytes in Z14 by the
// indices idx into a copy of the magic in Z29, dequantized with the scales
// in Z15 (d') and Z9 (K), then multiplied by the x chunk xc into acc.
#define ZSTEP(idx, xc, t, acc) \
	VMOVDQA64   Z29, t; \
	VPERMB      Z14, idx, K1, t; \
	VFMSUB213PS Z9, Z15, t; \
	VFMADD231PS xc, t, acc

// ZPAIR adds one block (offset BX) of the rows at lo and hi into acc,
// against the x chunks in Z20..Z23: the two scales through the tables at
// R15 (d', and K 256 KiB further) into slot(SP) and slot+32(SP), each
// pair broadcast to every lane pair; the two rows' int8 into Z14.
// Clobbers AX, CX, SI, DI.
#define ZPAIR(lo, hi, acc, slot) \
	MOVWLZX      (lo)(BX*1), AX; \
	MOVWLZX      (hi)(BX*1), DI; \
	MOVL         (R15)(DI*4), CX; \
	SHLQ         $32, CX; \
	MOVL         (R15)(AX*4), SI; \
	ORQ          SI, CX; \
	MOVQ         CX, slot(SP); \
	MOVL         262144(R15)(DI*4), CX; \
	SHLQ         $32, CX; \
	MOVL         262144(R15)(AX*4), SI; \
	ORQ          SI, CX; \
	MOVQ         CX, slot+32(SP); \
	VBROADCASTSD slot(SP), Z15; \
	VBROADCASTSD slot+32(SP), Z9; \
	VMOVDQU      2(lo)(BX*1), Y14; \
	VINSERTI64X4 $1, 2(hi)(BX*1), Z14, Z14; \
	VPXORD       Z30, Z14, Z14; \
	ZSTEP(Z16, Z20, Z10, acc); \
	ZSTEP(Z17, Z21, Z11, acc); \
	ZSTEP(Z18, Z22, Z12, acc); \
	ZSTEP(Z19, Z23, Z13, acc)

// func dotQ8PairsZ(xd, x0, x1 *float32, nb int, w unsafe.Pointer, pstride, hoff, gstride, ngroups int, out *float32, ostep, ohi int, tab *float32, pfstep int) (bad int)
//
// First interleaves x0 and x1 (32·nb floats each) into xd (64·nb floats).
// Then, for each of ngroups groups (group g starts at w + g·gstride), four
// pairs p = 0..3: lo row at w + g·gstride + p·pstride, hi row hoff bytes
// further (Q8_0 rows of nb blocks). lo is dotted with x0 and hi with x1;
// the four lo sums are stored at out + g·ostep, the four hi sums ohi bytes
// further. bad is nonzero if any sum is not finite. nb ≥ 1, ngroups ≥ 1.
//
// Frame: 0..24 d' pairs, 32..56 K pairs, 64 groups left, 72 group base,
// 80 out, 88 xd position, 96 blocks left, 104 non-finite flags, 112
// prefetch position. Each block prefetches the next pfstep bytes of the
// group after next (pfstep = 34 × its rows: all of it over the nb blocks).
TEXT ·dotQ8PairsZ(SB), NOSPLIT, $120-120
	MOVQ      xd+0(FP), DI
	MOVQ      x0+8(FP), SI
	MOVQ      x1+16(FP), DX
	MOVQ      nb+24(FP), CX
	SHLQ      $2, CX
	VMOVDQU64 q8zx<>(SB), Z31

interleave:
	VMOVUPS   (SI), Y10
	VMOVUPS   (DX), Y11
	VPERMT2PS Z11, Z31, Z10
	VMOVUPS   Z10, (DI)
	ADDQ      $32, SI
	ADDQ      $32, DX
	ADDQ      $64, DI
	DECQ      CX
	JNZ       interleave

	MOVQ         $0x2222222222222222, AX
	KMOVQ        AX, K1
	VMOVDQU64    q8zidx<>+0(SB), Z16
	VMOVDQU64    q8zidx<>+64(SB), Z17
	VMOVDQU64    q8zidx<>+128(SB), Z18
	VMOVDQU64    q8zidx<>+192(SB), Z19
	VMOVDQU64    q8zdeint<>(SB), Z28
	VPBROADCASTD q8zmagic<>+0(SB), Z29
	VPBROADCASTB q8zmagic<>+4(SB), Z30
	MOVQ         ngroups+64(FP), AX
	MOVQ         AX, 64(SP)
	MOVQ         w+32(FP), AX
	MOVQ         AX, 72(SP)
	MOVQ         out+72(FP), AX
	MOVQ         AX, 80(SP)
	MOVQ         $0, 104(SP)
	MOVQ         tab+96(FP), R15

group:
	MOVQ   72(SP), R8
	MOVQ   pstride+40(FP), AX
	LEAQ   (R8)(AX*1), R9
	LEAQ   (R9)(AX*1), R10
	LEAQ   (R10)(AX*1), R11
	MOVQ   hoff+48(FP), AX
	LEAQ   (R8)(AX*1), R12
	LEAQ   (R9)(AX*1), R13
	LEAQ   (R10)(AX*1), R14
	LEAQ   (R11)(AX*1), DX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	MOVQ   xd+0(FP), AX
	MOVQ   AX, 88(SP)
	MOVQ   nb+24(FP), AX
	MOVQ   AX, 96(SP)
	MOVQ   72(SP), AX
	ADDQ   gstride+56(FP), AX
	ADDQ   gstride+56(FP), AX
	MOVQ   AX, 112(SP)
	XORQ   BX, BX

block:
	MOVQ       88(SP), SI
	VMOVUPS    0(SI), Z20
	VMOVUPS    64(SI), Z21
	VMOVUPS    128(SI), Z22
	VMOVUPS    192(SI), Z23
	MOVQ       112(SP), SI
	PREFETCHT0 (SI)
	PREFETCHT0 64(SI)
	PREFETCHT0 128(SI)
	PREFETCHT0 192(SI)
	PREFETCHT0 256(SI)
	ADDQ       pfstep+104(FP), SI
	MOVQ       SI, 112(SP)
	ZPAIR(R8, R12, Z0, 0)
	ZPAIR(R9, R13, Z1, 8)
	ZPAIR(R10, R14, Z2, 16)
	ZPAIR(R11, DX, Z3, 24)
	ADDQ    $34, BX
	ADDQ    $256, 88(SP)
	DECQ    96(SP)
	JNZ     block

	// Lo lanes to Y0..Y3, hi lanes to Y4..Y7, then the canonical sums:
	// Y8 = [lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3].
	VPERMPS       Z0, Z28, Z0
	VPERMPS       Z1, Z28, Z1
	VPERMPS       Z2, Z28, Z2
	VPERMPS       Z3, Z28, Z3
	VEXTRACTF64X4 $1, Z0, Y4
	VEXTRACTF64X4 $1, Z1, Y5
	VEXTRACTF64X4 $1, Z2, Y6
	VEXTRACTF64X4 $1, Z3, Y7
	ZREDUCE4(Y0, Y1, Y2, Y3)
	ZREDUCE4(Y4, Y5, Y6, Y7)
	VPERM2F128    $0x20, Y4, Y0, Y8
	VPERM2F128    $0x31, Y4, Y0, Y9
	VADDPS        Y9, Y8, Y8
	MOVQ          80(SP), DI
	MOVQ          ohi+88(FP), AX
	VMOVUPS       X8, (DI)
	VEXTRACTF128  $1, Y8, (DI)(AX*1)
	ADDQ          ostep+80(FP), DI
	MOVQ          DI, 80(SP)

	// s − s is NaN exactly where s is not finite.
	VSUBPS    Y8, Y8, Y9
	VCMPPS    $3, Y9, Y9, Y9
	VMOVMSKPS Y9, AX
	ORQ       AX, 104(SP)

	MOVQ gstride+56(FP), AX
	ADDQ AX, 72(SP)
	DECQ 64(SP)
	JNZ  group

	MOVQ 104(SP), AX
	MOVQ AX, bad+112(FP)
	VZEROUPPER
	RET
