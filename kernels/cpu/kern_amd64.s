//go:build amd64

#include "textflag.h"

// AVX2 + FMA + F16C kernels. The Go declarations and the contract every
// kernel keeps are in kern_amd64.go; the pure-Go twins are in kern_generic.go.
//
// The canonical dot product: one 8-lane accumulator per output, starting at
// +0, one VFMADD231PS per 8 elements in increasing k, then the horizontal sum
// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)). REDUCE4 computes exactly that tree
// for four accumulators at once: VHADDPS forms the pairs, a second VHADDPS the
// quads of each 128-bit half, and the final add joins the halves.

// REDUCE4 leaves in ya, per 128-bit half, the partial sums of ya, yb, yc, yd:
// low half [a0123, b0123, c0123, d0123], high half the same of lanes 4..7;
// adding the two halves finishes the tree. Clobbers yc.
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

// LOADW8 loads the eight row pointers of *w (in DI) into R8..R14, DX.
#define LOADW8 \
	MOVQ 0(DI), R8; \
	MOVQ 8(DI), R9; \
	MOVQ 16(DI), R10; \
	MOVQ 24(DI), R11; \
	MOVQ 32(DI), R12; \
	MOVQ 40(DI), R13; \
	MOVQ 48(DI), R14; \
	MOVQ 56(DI), DX

// STORE8 reduces Y0..Y7 and stores the eight sums at (DI).
#define STORE8 \
	REDUCE4(Y0, Y1, Y2, Y3); \
	REDUCE4(Y4, Y5, Y6, Y7); \
	VPERM2F128 $0x20, Y4, Y0, Y8; \
	VPERM2F128 $0x31, Y4, Y0, Y9; \
	VADDPS Y9, Y8, Y8; \
	VMOVUPS Y8, (DI)

// func dot1x8F32(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)
TEXT ·dot1x8F32(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	LOADW8
	ZERO8
	XORQ AX, AX
	TESTQ CX, CX
	JZ   reduce

loop:
	VMOVUPS     (SI)(AX*1), Y8
	VFMADD231PS (R8)(AX*1), Y8, Y0
	VFMADD231PS (R9)(AX*1), Y8, Y1
	VFMADD231PS (R10)(AX*1), Y8, Y2
	VFMADD231PS (R11)(AX*1), Y8, Y3
	VFMADD231PS (R12)(AX*1), Y8, Y4
	VFMADD231PS (R13)(AX*1), Y8, Y5
	VFMADD231PS (R14)(AX*1), Y8, Y6
	VFMADD231PS (DX)(AX*1), Y8, Y7
	ADDQ        $32, AX
	DECQ        CX
	JNZ         loop

reduce:
	MOVQ out+24(FP), DI
	STORE8
	VZEROUPPER
	RET

// F16ROW: acc += cvt(8 halves at r+BX) * Y8, through temporary t.
#define F16ROW(r, t, acc) \
	VCVTPH2PS   (r)(BX*1), t; \
	VFMADD231PS t, Y8, acc

// func dot1x8F16(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)
TEXT ·dot1x8F16(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	LOADW8
	ZERO8
	XORQ AX, AX
	XORQ BX, BX
	TESTQ CX, CX
	JZ   reduce

loop:
	VMOVUPS (SI)(AX*1), Y8
	F16ROW(R8, Y9, Y0)
	F16ROW(R9, Y10, Y1)
	F16ROW(R10, Y11, Y2)
	F16ROW(R11, Y12, Y3)
	F16ROW(R12, Y9, Y4)
	F16ROW(R13, Y10, Y5)
	F16ROW(R14, Y11, Y6)
	F16ROW(DX, Y12, Y7)
	ADDQ    $32, AX
	ADDQ    $16, BX
	DECQ    CX
	JNZ     loop

reduce:
	MOVQ out+24(FP), DI
	STORE8
	VZEROUPPER
	RET

// BF16ROW: acc += (8 bfloat16 at r+BX widened by a 16-bit shift) * Y8.
#define BF16ROW(r, t, acc) \
	VPMOVZXWD   (r)(BX*1), t; \
	VPSLLD      $16, t, t; \
	VFMADD231PS t, Y8, acc

// func dot1x8BF16(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)
TEXT ·dot1x8BF16(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	LOADW8
	ZERO8
	XORQ AX, AX
	XORQ BX, BX
	TESTQ CX, CX
	JZ   reduce

loop:
	VMOVUPS (SI)(AX*1), Y8
	BF16ROW(R8, Y9, Y0)
	BF16ROW(R9, Y10, Y1)
	BF16ROW(R10, Y11, Y2)
	BF16ROW(R11, Y12, Y3)
	BF16ROW(R12, Y9, Y4)
	BF16ROW(R13, Y10, Y5)
	BF16ROW(R14, Y11, Y6)
	BF16ROW(DX, Y12, Y7)
	ADDQ    $32, AX
	ADDQ    $16, BX
	DECQ    CX
	JNZ     loop

reduce:
	MOVQ out+24(FP), DI
	STORE8
	VZEROUPPER
	RET

// Q8STEP: acc += (int8 ×8 at off(r+BX) → float · scale Y12) * x.
#define Q8STEP(r, off, x, t, acc) \
	VPMOVSXBD   off(r)(BX*1), t; \
	VCVTDQ2PS   t, t; \
	VMULPS      Y12, t, t; \
	VFMADD231PS t, x, acc

// Q8ROW: one 34-byte block of row r: fp16 scale, then 32 int8, against the
// 32 x values in Y8..Y11.
#define Q8ROW(r, acc) \
	VPBROADCASTW (r)(BX*1), X12; \
	VCVTPH2PS    X12, Y12; \
	Q8STEP(r, 2, Y8, Y13, acc); \
	Q8STEP(r, 10, Y9, Y14, acc); \
	Q8STEP(r, 18, Y10, Y15, acc); \
	Q8STEP(r, 26, Y11, Y13, acc)

// func dot1x8Q8(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)
// n8 must be a multiple of 4 (whole 32-element blocks).
TEXT ·dot1x8Q8(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	SHRQ $2, CX
	LOADW8
	ZERO8
	XORQ AX, AX
	XORQ BX, BX
	TESTQ CX, CX
	JZ   reduce

loop:
	VMOVUPS 0(SI)(AX*1), Y8
	VMOVUPS 32(SI)(AX*1), Y9
	VMOVUPS 64(SI)(AX*1), Y10
	VMOVUPS 96(SI)(AX*1), Y11
	Q8ROW(R8, Y0)
	Q8ROW(R9, Y1)
	Q8ROW(R10, Y2)
	Q8ROW(R11, Y3)
	Q8ROW(R12, Y4)
	Q8ROW(R13, Y5)
	Q8ROW(R14, Y6)
	Q8ROW(DX, Y7)
	ADDQ    $128, AX
	ADDQ    $34, BX
	DECQ    CX
	JNZ     loop

reduce:
	MOVQ out+24(FP), DI
	STORE8
	VZEROUPPER
	RET

// func dot3x4F32(x *float32, xstride, ntiles int, w *[4]unsafe.Pointer, n8 int, out *float32, ostride int)
// Tile t covers x rows 3t..3t+2 (x + (3t+i)·xstride bytes) and writes
// out + (3t+i)·ostride bytes, four floats each.
TEXT ·dot3x4F32(SB), NOSPLIT, $0-56
	MOVQ x+0(FP), R12
	MOVQ xstride+8(FP), BX
	MOVQ ntiles+16(FP), DX
	MOVQ w+24(FP), DI
	MOVQ 0(DI), R8
	MOVQ 8(DI), R9
	MOVQ 16(DI), R10
	MOVQ 24(DI), R11
	MOVQ out+40(FP), DI
	MOVQ ostride+48(FP), SI
	TESTQ DX, DX
	JZ   done

tile:
	LEAQ   (R12)(BX*1), R13
	LEAQ   (R13)(BX*1), R14
	ZERO8
	VXORPS Y8, Y8, Y8
	VXORPS Y9, Y9, Y9
	VXORPS Y10, Y10, Y10
	VXORPS Y11, Y11, Y11
	MOVQ   n8+32(FP), CX
	XORQ   AX, AX
	TESTQ  CX, CX
	JZ     reduce

loop:
	VMOVUPS     (R12)(AX*1), Y12
	VMOVUPS     (R13)(AX*1), Y13
	VMOVUPS     (R14)(AX*1), Y14
	VMOVUPS     (R8)(AX*1), Y15
	VFMADD231PS Y15, Y12, Y0
	VFMADD231PS Y15, Y13, Y4
	VFMADD231PS Y15, Y14, Y8
	VMOVUPS     (R9)(AX*1), Y15
	VFMADD231PS Y15, Y12, Y1
	VFMADD231PS Y15, Y13, Y5
	VFMADD231PS Y15, Y14, Y9
	VMOVUPS     (R10)(AX*1), Y15
	VFMADD231PS Y15, Y12, Y2
	VFMADD231PS Y15, Y13, Y6
	VFMADD231PS Y15, Y14, Y10
	VMOVUPS     (R11)(AX*1), Y15
	VFMADD231PS Y15, Y12, Y3
	VFMADD231PS Y15, Y13, Y7
	VFMADD231PS Y15, Y14, Y11
	ADDQ        $32, AX
	DECQ        CX
	JNZ         loop

reduce:
	REDUCE4(Y0, Y1, Y2, Y3)
	VEXTRACTF128 $1, Y0, X1
	VADDPS       X1, X0, X0
	VMOVUPS      X0, (DI)
	REDUCE4(Y4, Y5, Y6, Y7)
	VEXTRACTF128 $1, Y4, X5
	VADDPS       X5, X4, X4
	VMOVUPS      X4, (DI)(SI*1)
	REDUCE4(Y8, Y9, Y10, Y11)
	VEXTRACTF128 $1, Y8, X9
	VADDPS       X9, X8, X8
	VMOVUPS      X8, (DI)(SI*2)
	LEAQ         (R14)(BX*1), R12
	LEAQ         (DI)(SI*2), DI
	ADDQ         SI, DI
	DECQ         DX
	JNZ          tile

done:
	VZEROUPPER
	RET

// func cvtF16(dst *float32, src unsafe.Pointer, n8 int)
TEXT ·cvtF16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n8+16(FP), CX
	TESTQ CX, CX
	JZ   done

loop:
	VCVTPH2PS (SI), Y0
	VMOVUPS   Y0, (DI)
	ADDQ      $16, SI
	ADDQ      $32, DI
	DECQ      CX
	JNZ       loop

done:
	VZEROUPPER
	RET

// func cvtBF16(dst *float32, src unsafe.Pointer, n8 int)
TEXT ·cvtBF16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n8+16(FP), CX
	TESTQ CX, CX
	JZ   done

loop:
	VPMOVZXWD (SI), Y0
	VPSLLD    $16, Y0, Y0
	VMOVUPS   Y0, (DI)
	ADDQ      $16, SI
	ADDQ      $32, DI
	DECQ      CX
	JNZ       loop

done:
	VZEROUPPER
	RET

// func cvtQ8(dst *float32, src unsafe.Pointer, n8 int)
// n8 must be a multiple of 4.
TEXT ·cvtQ8(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n8+16(FP), CX
	SHRQ $2, CX
	TESTQ CX, CX
	JZ   done

loop:
	VPBROADCASTW (SI), X4
	VCVTPH2PS    X4, Y4
	VPMOVSXBD    2(SI), Y0
	VPMOVSXBD    10(SI), Y1
	VPMOVSXBD    18(SI), Y2
	VPMOVSXBD    26(SI), Y3
	VCVTDQ2PS    Y0, Y0
	VCVTDQ2PS    Y1, Y1
	VCVTDQ2PS    Y2, Y2
	VCVTDQ2PS    Y3, Y3
	VMULPS       Y4, Y0, Y0
	VMULPS       Y4, Y1, Y1
	VMULPS       Y4, Y2, Y2
	VMULPS       Y4, Y3, Y3
	VMOVUPS      Y0, 0(DI)
	VMOVUPS      Y1, 32(DI)
	VMOVUPS      Y2, 64(DI)
	VMOVUPS      Y3, 96(DI)
	ADDQ         $34, SI
	ADDQ         $128, DI
	DECQ         CX
	JNZ          loop

done:
	VZEROUPPER
	RET

// e4m3 decoding constants: the magnitude mask (also the NaN code), the sign
// bit, and 2^120, which moves an e4m3 exponent (bias 7) placed in the low
// bits of an f32 exponent field (bias 127) to its value.
DATA fp8c<>+0(SB)/4, $0x0000007f
DATA fp8c<>+4(SB)/4, $0x00000080
DATA fp8c<>+8(SB)/4, $0x7b800000
GLOBL fp8c<>(SB), RODATA|NOPTR, $12

// func cvtFP8(dst *float32, src *uint8, n8 int, scale float32)
// dst[i] = FP8ToF32(src[i]) * scale, exactly: (c&0x7F)<<20 read as an f32
// and multiplied by 2^120 is the e4m3 magnitude (normal or subnormal), the
// sign is ORed in, the NaN code becomes all-ones (a NaN), then one rounding
// multiply by scale.
TEXT ·cvtFP8(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n8+16(FP), CX
	VBROADCASTSS scale+24(FP), Y13
	VPBROADCASTD fp8c<>+0(SB), Y10
	VPBROADCASTD fp8c<>+4(SB), Y11
	VBROADCASTSS fp8c<>+8(SB), Y12
	TESTQ        CX, CX
	JZ           done

loop:
	VPMOVZXBD (SI), Y0
	VPAND     Y10, Y0, Y1
	VPCMPEQD  Y10, Y1, Y3
	VPSLLD    $20, Y1, Y1
	VMULPS    Y12, Y1, Y1
	VPAND     Y11, Y0, Y2
	VPSLLD    $24, Y2, Y2
	VPOR      Y2, Y1, Y1
	VPOR      Y3, Y1, Y1
	VMULPS    Y13, Y1, Y1
	VMOVUPS   Y1, (DI)
	ADDQ      $8, SI
	ADDQ      $32, DI
	DECQ      CX
	JNZ       loop

done:
	VZEROUPPER
	RET

// PVSLOT loads slot j's row address into AX and p[j] broadcast into Y15.
#define PVSLOT \
	MOVLQSX      (BX), AX; \
	IMULQ        R9, AX; \
	ADDQ         R8, AX; \
	VBROADCASTSS (SI), Y15

// func attnPV(out, p, v *float32, slots *int32, nslots, stride, n8 int)
// out[c] = Σ_j p[j]·v[slots[j]·stride/4 + c] for c < 8·n8, one FMA per
// slot in slot order, starting from +0. stride is in bytes.
TEXT ·attnPV(SB), NOSPLIT, $0-56
	MOVQ out+0(FP), DI
	MOVQ v+16(FP), R8
	MOVQ stride+40(FP), R9
	MOVQ n8+48(FP), R10

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
	VFMADD231PS 0(AX), Y15, Y0
	VFMADD231PS 32(AX), Y15, Y1
	VFMADD231PS 64(AX), Y15, Y2
	VFMADD231PS 96(AX), Y15, Y3
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
	ADDQ    $128, R8
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
	VFMADD231PS 0(AX), Y15, Y0
	VFMADD231PS 32(AX), Y15, Y1
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         pairloop

pairstore:
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	ADDQ    $64, DI
	ADDQ    $64, R8
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
	VFMADD231PS 0(AX), Y15, Y0
	ADDQ        $4, BX
	ADDQ        $4, SI
	DECQ        CX
	JNZ         singleloop

singlestore:
	VMOVUPS Y0, 0(DI)

done:
	VZEROUPPER
	RET
