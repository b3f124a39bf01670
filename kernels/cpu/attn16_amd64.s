//go:build amd64

#include "textflag.h"

// Attention over a 16-bit KV pool (AVX2 + FMA + F16C): attnQK and attnPV of
// kern_amd64.s with each K or V element widened exactly before its FMA, the
// same FMAs in the same order, so that a 16-bit pool gives the bits of an
// F32 pool holding the widened values. F16 widens by VCVTPH2PS, BF16 by
// moving each 16-bit word into the high half of a zeroed 32-bit lane. The
// Go declarations are in kern_amd64.go, the pure-Go twins in
// kern_generic.go.

// REDUCE4, as in kern_amd64.s: the canonical horizontal sum tree of four
// accumulators, per 128-bit half. Clobbers yc.
#define REDUCE4(ya, yb, yc, yd) \
	VHADDPS yb, ya, ya; \
	VHADDPS yd, yc, yc; \
	VHADDPS yc, ya, ya

// ZERO8 clears Y0..Y7.
#define ZERO8 \
	VXORPS Y0, Y0, Y0; \
	VXORPS Y1, Y1, Y1; \
	VXORPS Y2, Y2, Y2; \
	VXORPS Y3, Y3, Y3; \
	VXORPS Y4, Y4, Y4; \
	VXORPS Y5, Y5, Y5; \
	VXORPS Y6, Y6, Y6; \
	VXORPS Y7, Y7, Y7

// QKROW loads into r the address of K row slots[i] (stride and base from
// the arguments).
#define QKROW(i, r) \
	MOVLQSX i*4(BX), r; \
	IMULQ   stride+40(FP), r; \
	ADDQ    k+16(FP), r

// WF16 widens the 8 halves at m into t.
#define WF16(m, t) \
	VCVTPH2PS m, t

// WBF16 widens the 8 bfloat16s at m into t: zero extension, 16-bit shift.
#define WBF16(m, t) \
	VPMOVZXWD m, t; \
	VPSLLD    $16, t, t

// WBF16S is WBF16 in one load and one shuffle, with the VPSHUFB control
// bf16shuf in Y13: the 16 bytes broadcast to both 128-bit halves, then
// words 0..3 (low half) and 4..7 (high half) moved into the high 16 bits of
// the dwords, the low 16 bits zeroed.
#define WBF16S(m, t) \
	VBROADCASTI128 m, t; \
	VPSHUFB        Y13, t, t

DATA bf16shuf<>+0(SB)/8, $0x0302808001008080
DATA bf16shuf<>+8(SB)/8, $0x0706808005048080
DATA bf16shuf<>+16(SB)/8, $0x0b0a808009088080
DATA bf16shuf<>+24(SB)/8, $0x0f0e80800d0c8080
GLOBL bf16shuf<>(SB), RODATA|NOPTR, $32

// bf16hi keeps the high 16 bits of each dword.
DATA bf16hi<>+0(SB)/8, $0xffff0000ffff0000
DATA bf16hi<>+8(SB)/8, $0xffff0000ffff0000
DATA bf16hi<>+16(SB)/8, $0xffff0000ffff0000
DATA bf16hi<>+24(SB)/8, $0xffff0000ffff0000
GLOBL bf16hi<>(SB), RODATA|NOPTR, $32

// Decode at long context waits on memory: the slots' rows are scattered
// over the pool (pages), too few loads are in flight to fill the memory
// bandwidth, and a 16-bit pool, reading half the bytes of an F32 one, would
// save little. So both kernels prefetch the rows of the slots 64 ahead of
// the one they compute (when there are that many more): attnQK16 all the
// cache lines of the K rows of the block of 8 slots QKPFD blocks ahead,
// attnPV16 those of the columns of the current run of the V row PVPFD
// slots ahead. Prefetches change no result and never fault; the slot
// indices read are inside slots.
//
// QKPFD is how many blocks of 8 slots ahead attnQK16 prefetches K rows.
#define QKPFD 8

// PVPFD is how many slots ahead attnPV16 prefetches V rows.
#define PVPFD 64

// PVSLOT loads slot j's row address into AX and p[j] broadcast into Y15.
#define PVSLOT \
	MOVLQSX      (BX), AX; \
	IMULQ        R9, AX; \
	ADDQ         R8, AX; \
	VBROADCASTSS (SI), Y15


// func attnQKF16(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)
// For blocks b < nblk of 8 slots: scores[8b+l] = dot(q, K row
// slots[8b+l])·scale, the dot exactly as dot1x8F16 (and attnQK on the
// widened rows) computes it. AX counts bytes of K; q is read at 2·AX; R15
// is the bytes of a row's 8·n8 elements.
TEXT ·attnQKF16(SB), NOSPLIT, $8-60
	MOVQ         scores+0(FP), DI
	MOVQ         q+8(FP), SI
	MOVQ         slots+24(FP), BX
	MOVQ         nblk+32(FP), CX
	MOVQ         CX, 0(SP)
	VBROADCASTSS scale+56(FP), Y15
	MOVQ         n8+48(FP), R15
	SHLQ         $4, R15
	TESTQ        CX, CX
	JZ           done

block:
	QKROW(0, R8)
	QKROW(1, R9)
	QKROW(2, R10)
	QKROW(3, R11)
	QKROW(4, R12)
	QKROW(5, R13)
	QKROW(6, R14)
	QKROW(7, DX)
	CMPQ    0(SP), $QKPFD+1
	JLT     nopf
	MOVLQSX (32*QKPFD+0)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf0:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf0
	MOVLQSX (32*QKPFD+4)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf1:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf1
	MOVLQSX (32*QKPFD+8)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf2:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf2
	MOVLQSX (32*QKPFD+12)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf3:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf3
	MOVLQSX (32*QKPFD+16)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf4:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf4
	MOVLQSX (32*QKPFD+20)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf5:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf5
	MOVLQSX (32*QKPFD+24)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf6:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf6
	MOVLQSX (32*QKPFD+28)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf7:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf7

nopf:
	ZERO8
	XORQ AX, AX
	MOVQ n8+48(FP), CX

step:
	VMOVUPS (SI)(AX*2), Y8
	WF16((R8)(AX*1), Y9)
	VFMADD231PS Y9, Y8, Y0
	WF16((R9)(AX*1), Y10)
	VFMADD231PS Y10, Y8, Y1
	WF16((R10)(AX*1), Y11)
	VFMADD231PS Y11, Y8, Y2
	WF16((R11)(AX*1), Y12)
	VFMADD231PS Y12, Y8, Y3
	WF16((R12)(AX*1), Y9)
	VFMADD231PS Y9, Y8, Y4
	WF16((R13)(AX*1), Y10)
	VFMADD231PS Y10, Y8, Y5
	WF16((R14)(AX*1), Y11)
	VFMADD231PS Y11, Y8, Y6
	WF16((DX)(AX*1), Y12)
	VFMADD231PS Y12, Y8, Y7
	ADDQ        $16, AX
	DECQ        CX
	JNZ         step
	REDUCE4(Y0, Y1, Y2, Y3)
	REDUCE4(Y4, Y5, Y6, Y7)
	VPERM2F128  $0x20, Y4, Y0, Y8
	VPERM2F128  $0x31, Y4, Y0, Y9
	VADDPS      Y9, Y8, Y8
	VMULPS      Y15, Y8, Y8
	VMOVUPS     Y8, (DI)
	ADDQ        $32, DI
	ADDQ        $32, BX
	DECQ        0(SP)
	JNZ         block

done:
	VZEROUPPER
	RET

// func attnPVF16(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)
// out[c] = Σ_j p[j]·v[slots[j]·stride/2 + c] for c < 8·n8, each element
// widened exactly, one FMA per slot in slot order, starting from +0: what
// attnPV computes on the widened rows. stride is in bytes. Columns go in
// runs of 64, 48, 32, 16 and 8 as in attnPV (the run does not change a
// column's sum).
TEXT ·attnPVF16(SB), NOSPLIT, $0-56
	MOVQ out+0(FP), DI
	MOVQ v+16(FP), R8
	MOVQ stride+40(FP), R9
	MOVQ n8+48(FP), R10

oct:
	CMPQ   R10, $8
	JLT    hex
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     octstore

octloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        octnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 64(R11)
	PREFETCHT0 127(R11)

octnopf:
	WF16(0(AX), Y8)
	VFMADD231PS Y8, Y15, Y0
	WF16(16(AX), Y9)
	VFMADD231PS Y9, Y15, Y1
	WF16(32(AX), Y10)
	VFMADD231PS Y10, Y15, Y2
	WF16(48(AX), Y11)
	VFMADD231PS Y11, Y15, Y3
	WF16(64(AX), Y12)
	VFMADD231PS Y12, Y15, Y4
	WF16(80(AX), Y13)
	VFMADD231PS Y13, Y15, Y5
	WF16(96(AX), Y8)
	VFMADD231PS Y8, Y15, Y6
	WF16(112(AX), Y9)
	VFMADD231PS Y9, Y15, Y7
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         octloop

octstore:
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	VMOVUPS Y4, 128(DI)
	VMOVUPS Y5, 160(DI)
	VMOVUPS Y6, 192(DI)
	VMOVUPS Y7, 224(DI)
	ADDQ    $256, DI
	ADDQ    $128, R8
	SUBQ    $8, R10
	JMP     oct

hex:
	CMPQ   R10, $6
	JLT    quad
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     hexstore

hexloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        hexnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 64(R11)
	PREFETCHT0 95(R11)

hexnopf:
	WF16(0(AX), Y8)
	VFMADD231PS Y8, Y15, Y0
	WF16(16(AX), Y9)
	VFMADD231PS Y9, Y15, Y1
	WF16(32(AX), Y10)
	VFMADD231PS Y10, Y15, Y2
	WF16(48(AX), Y11)
	VFMADD231PS Y11, Y15, Y3
	WF16(64(AX), Y12)
	VFMADD231PS Y12, Y15, Y4
	WF16(80(AX), Y13)
	VFMADD231PS Y13, Y15, Y5
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         hexloop

hexstore:
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	VMOVUPS Y4, 128(DI)
	VMOVUPS Y5, 160(DI)
	ADDQ    $192, DI
	ADDQ    $96, R8
	SUBQ    $6, R10
	JMP     hex

quad:
	CMPQ   R10, $4
	JLT    pair
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     quadstore

quadloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        quadnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 63(R11)

quadnopf:
	WF16(0(AX), Y8)
	VFMADD231PS Y8, Y15, Y0
	WF16(16(AX), Y9)
	VFMADD231PS Y9, Y15, Y1
	WF16(32(AX), Y10)
	VFMADD231PS Y10, Y15, Y2
	WF16(48(AX), Y11)
	VFMADD231PS Y11, Y15, Y3
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         quadloop

quadstore:
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $64, R8
	SUBQ    $4, R10
	JMP     quad

pair:
	CMPQ   R10, $2
	JLT    single
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     pairstore

pairloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        pairnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 31(R11)

pairnopf:
	WF16(0(AX), Y8)
	VFMADD231PS Y8, Y15, Y0
	WF16(16(AX), Y9)
	VFMADD231PS Y9, Y15, Y1
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         pairloop

pairstore:
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	ADDQ    $64, DI
	ADDQ    $32, R8
	SUBQ    $2, R10
	JMP     pair

single:
	TESTQ  R10, R10
	JZ     done
	VXORPS Y0, Y0, Y0
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     singlestore

singleloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        singlenopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 15(R11)

singlenopf:
	WF16(0(AX), Y8)
	VFMADD231PS Y8, Y15, Y0
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         singleloop

singlestore:
	VMOVUPS Y0, 0(DI)

done:
	VZEROUPPER
	RET

// func attnQKBF16(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)
// For blocks b < nblk of 8 slots: scores[8b+l] = dot(q, K row
// slots[8b+l])·scale, the dot exactly as dot1x8BF16 (and attnQK on the
// widened rows) computes it. AX counts bytes of K; q is read at 2·AX; R15
// is the bytes of a row's 8·n8 elements.
TEXT ·attnQKBF16(SB), NOSPLIT, $8-60
	MOVQ         scores+0(FP), DI
	MOVQ         q+8(FP), SI
	MOVQ         slots+24(FP), BX
	MOVQ         nblk+32(FP), CX
	MOVQ         CX, 0(SP)
	VBROADCASTSS scale+56(FP), Y15
	MOVQ         n8+48(FP), R15
	SHLQ         $4, R15
	VMOVDQU      bf16shuf<>(SB), Y13
	TESTQ        CX, CX
	JZ           done

block:
	QKROW(0, R8)
	QKROW(1, R9)
	QKROW(2, R10)
	QKROW(3, R11)
	QKROW(4, R12)
	QKROW(5, R13)
	QKROW(6, R14)
	QKROW(7, DX)
	CMPQ    0(SP), $QKPFD+1
	JLT     nopf
	MOVLQSX (32*QKPFD+0)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf0:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf0
	MOVLQSX (32*QKPFD+4)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf1:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf1
	MOVLQSX (32*QKPFD+8)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf2:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf2
	MOVLQSX (32*QKPFD+12)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf3:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf3
	MOVLQSX (32*QKPFD+16)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf4:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf4
	MOVLQSX (32*QKPFD+20)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf5:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf5
	MOVLQSX (32*QKPFD+24)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf6:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf6
	MOVLQSX (32*QKPFD+28)(BX), AX
	IMULQ   stride+40(FP), AX
	ADDQ    k+16(FP), AX
	LEAQ    -1(AX)(R15*1), CX
	PREFETCHT0 (CX)
pf7:
	PREFETCHT0 (AX)
	ADDQ    $64, AX
	CMPQ    AX, CX
	JLT     pf7

nopf:
	ZERO8
	XORQ AX, AX
	MOVQ n8+48(FP), CX

step:
	VMOVUPS (SI)(AX*2), Y8
	WBF16S((R8)(AX*1), Y9)
	VFMADD231PS Y9, Y8, Y0
	WBF16S((R9)(AX*1), Y10)
	VFMADD231PS Y10, Y8, Y1
	WBF16S((R10)(AX*1), Y11)
	VFMADD231PS Y11, Y8, Y2
	WBF16S((R11)(AX*1), Y12)
	VFMADD231PS Y12, Y8, Y3
	WBF16S((R12)(AX*1), Y9)
	VFMADD231PS Y9, Y8, Y4
	WBF16S((R13)(AX*1), Y10)
	VFMADD231PS Y10, Y8, Y5
	WBF16S((R14)(AX*1), Y11)
	VFMADD231PS Y11, Y8, Y6
	WBF16S((DX)(AX*1), Y12)
	VFMADD231PS Y12, Y8, Y7
	ADDQ        $16, AX
	DECQ        CX
	JNZ         step
	REDUCE4(Y0, Y1, Y2, Y3)
	REDUCE4(Y4, Y5, Y6, Y7)
	VPERM2F128  $0x20, Y4, Y0, Y8
	VPERM2F128  $0x31, Y4, Y0, Y9
	VADDPS      Y9, Y8, Y8
	VMULPS      Y15, Y8, Y8
	VMOVUPS     Y8, (DI)
	ADDQ        $32, DI
	ADDQ        $32, BX
	DECQ        0(SP)
	JNZ         block

done:
	VZEROUPPER
	RET

// func attnPVBF16(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)
// out[c] = Σ_j p[j]·v[slots[j]·stride/2 + c] for c < 8·n8, each element
// widened exactly, one FMA per slot in slot order, starting from +0: what
// attnPV computes on the widened rows. stride is in bytes. Columns go in
// runs of 64, 48, 32, 16 and 8 as in attnPV (the run does not change a
// column's sum).
// Runs of 16 columns or more widen 32 bytes at a time into their even
// columns (a 16-bit left shift) and odd ones (the high halves masked), two
// accumulators per 16 columns, interleaved again at the store.
TEXT ·attnPVBF16(SB), NOSPLIT, $0-56
	MOVQ out+0(FP), DI
	MOVQ v+16(FP), R8
	MOVQ stride+40(FP), R9
	MOVQ n8+48(FP), R10
	VMOVDQU bf16hi<>(SB), Y14

oct:
	CMPQ   R10, $8
	JLT    hex
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     octstore

octloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        octnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 64(R11)
	PREFETCHT0 127(R11)

octnopf:
	VPSLLD      $16, 0(AX), Y8
	VPAND       0(AX), Y14, Y9
	VFMADD231PS Y8, Y15, Y0
	VFMADD231PS Y9, Y15, Y1
	VPSLLD      $16, 32(AX), Y10
	VPAND       32(AX), Y14, Y11
	VFMADD231PS Y10, Y15, Y2
	VFMADD231PS Y11, Y15, Y3
	VPSLLD      $16, 64(AX), Y12
	VPAND       64(AX), Y14, Y13
	VFMADD231PS Y12, Y15, Y4
	VFMADD231PS Y13, Y15, Y5
	VPSLLD      $16, 96(AX), Y8
	VPAND       96(AX), Y14, Y9
	VFMADD231PS Y8, Y15, Y6
	VFMADD231PS Y9, Y15, Y7
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         octloop

octstore:
	VUNPCKLPS   Y1, Y0, Y8
	VUNPCKHPS   Y1, Y0, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 0(DI)
	VMOVUPS     Y11, 32(DI)
	VUNPCKLPS   Y3, Y2, Y8
	VUNPCKHPS   Y3, Y2, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 64(DI)
	VMOVUPS     Y11, 96(DI)
	VUNPCKLPS   Y5, Y4, Y8
	VUNPCKHPS   Y5, Y4, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 128(DI)
	VMOVUPS     Y11, 160(DI)
	VUNPCKLPS   Y7, Y6, Y8
	VUNPCKHPS   Y7, Y6, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 192(DI)
	VMOVUPS     Y11, 224(DI)
	ADDQ    $256, DI
	ADDQ    $128, R8
	SUBQ    $8, R10
	JMP     oct

hex:
	CMPQ   R10, $6
	JLT    quad
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     hexstore

hexloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        hexnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 64(R11)
	PREFETCHT0 95(R11)

hexnopf:
	VPSLLD      $16, 0(AX), Y8
	VPAND       0(AX), Y14, Y9
	VFMADD231PS Y8, Y15, Y0
	VFMADD231PS Y9, Y15, Y1
	VPSLLD      $16, 32(AX), Y10
	VPAND       32(AX), Y14, Y11
	VFMADD231PS Y10, Y15, Y2
	VFMADD231PS Y11, Y15, Y3
	VPSLLD      $16, 64(AX), Y12
	VPAND       64(AX), Y14, Y13
	VFMADD231PS Y12, Y15, Y4
	VFMADD231PS Y13, Y15, Y5
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         hexloop

hexstore:
	VUNPCKLPS   Y1, Y0, Y8
	VUNPCKHPS   Y1, Y0, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 0(DI)
	VMOVUPS     Y11, 32(DI)
	VUNPCKLPS   Y3, Y2, Y8
	VUNPCKHPS   Y3, Y2, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 64(DI)
	VMOVUPS     Y11, 96(DI)
	VUNPCKLPS   Y5, Y4, Y8
	VUNPCKHPS   Y5, Y4, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 128(DI)
	VMOVUPS     Y11, 160(DI)
	ADDQ    $192, DI
	ADDQ    $96, R8
	SUBQ    $6, R10
	JMP     hex

quad:
	CMPQ   R10, $4
	JLT    pair
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     quadstore

quadloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        quadnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 63(R11)

quadnopf:
	VPSLLD      $16, 0(AX), Y8
	VPAND       0(AX), Y14, Y9
	VFMADD231PS Y8, Y15, Y0
	VFMADD231PS Y9, Y15, Y1
	VPSLLD      $16, 32(AX), Y10
	VPAND       32(AX), Y14, Y11
	VFMADD231PS Y10, Y15, Y2
	VFMADD231PS Y11, Y15, Y3
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         quadloop

quadstore:
	VUNPCKLPS   Y1, Y0, Y8
	VUNPCKHPS   Y1, Y0, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 0(DI)
	VMOVUPS     Y11, 32(DI)
	VUNPCKLPS   Y3, Y2, Y8
	VUNPCKHPS   Y3, Y2, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 64(DI)
	VMOVUPS     Y11, 96(DI)
	ADDQ    $128, DI
	ADDQ    $64, R8
	SUBQ    $4, R10
	JMP     quad

pair:
	CMPQ   R10, $2
	JLT    single
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     pairstore

pairloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        pairnopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 31(R11)

pairnopf:
	VPSLLD      $16, 0(AX), Y8
	VPAND       0(AX), Y14, Y9
	VFMADD231PS Y8, Y15, Y0
	VFMADD231PS Y9, Y15, Y1
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         pairloop

pairstore:
	VUNPCKLPS   Y1, Y0, Y8
	VUNPCKHPS   Y1, Y0, Y9
	VPERM2F128  $0x20, Y9, Y8, Y10
	VPERM2F128  $0x31, Y9, Y8, Y11
	VMOVUPS     Y10, 0(DI)
	VMOVUPS     Y11, 32(DI)
	ADDQ    $64, DI
	ADDQ    $32, R8
	SUBQ    $2, R10
	JMP     pair

single:
	TESTQ  R10, R10
	JZ     done
	VXORPS Y0, Y0, Y0
	MOVQ   p+8(FP), SI
	MOVQ   slots+24(FP), BX
	MOVQ   nslots+32(FP), CX
	TESTQ  CX, CX
	JZ     singlestore

singleloop:
	PVSLOT
	CMPQ       CX, $PVPFD+1
	JLT        singlenopf
	MOVLQSX    PVPFD*4(BX), R11
	IMULQ      R9, R11
	ADDQ       R8, R11
	PREFETCHT0 (R11)
	PREFETCHT0 15(R11)

singlenopf:
	WBF16(0(AX), Y8)
	VFMADD231PS Y8, Y15, Y0
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         singleloop

singlestore:
	VMOVUPS Y0, 0(DI)

done:
	VZEROUPPER
	RET
