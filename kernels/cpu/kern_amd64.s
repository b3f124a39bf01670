//go:build amd64

#include "textflag.h"
#include "avx2_amd64.h"
#include "dot_amd64.h"

// AVX2 + FMA + F16C kernels. The Go declarations and the contract every
// kernel keeps are in kern_amd64.go; the pure-Go twins are in kern_generic.go.
//
// The canonical dot product: one 8-lane accumulator per output, starting at
// +0, one VFMADD231PS per 8 elements in increasing k, then the horizontal sum
// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)). REDUCE4 computes exactly that tree
// for four accumulators at once: VHADDPS forms the pairs, a second VHADDPS the
// quads of each 128-bit half, and the final add joins the halves. REDUCE4,
// STORE8, ZERO8 and the other macros the AVX2 kernels share are in
// avx2_amd64.h; LOADW8, DOT1X8 and the other pieces of the 1×8 kernels in
// dot_amd64.h.

// attnPV's five column runs are written once, as PVRUN below and PVSLOTS
// (a run's three slot loops, avx2_amd64.h), with the pieces that depend on
// the run's size as PVFn, PVPn and ZEROn, STACCn (avx2_amd64.h).

// PVFn add p[j] (Y15) times the run's n·8 columns of slot j's row (AX)
// into Y0 up to Y(n-1).
#define PVF1 \
	VFMADD231PS 0(AX), Y15, Y0

#define PVF2 \
	PVF1; \
	VFMADD231PS 32(AX), Y15, Y1

#define PVF4 \
	PVF2; \
	VFMADD231PS 64(AX), Y15, Y2; \
	VFMADD231PS 96(AX), Y15, Y3

#define PVF6 \
	PVF4; \
	VFMADD231PS 128(AX), Y15, Y4; \
	VFMADD231PS 160(AX), Y15, Y5

#define PVF8 \
	PVF6; \
	VFMADD231PS 192(AX), Y15, Y6; \
	VFMADD231PS 224(AX), Y15, Y7

// PVPn prefetch the lines at 64-byte steps of a run of n·8 columns of the
// row at R11.
#define PVP1 \
	PREFETCHT0 (R11)

#define PVP2 \
	PVP1

#define PVP4 \
	PVP1; \
	PREFETCHT0 64(R11)

#define PVP6 \
	PVP4; \
	PREFETCHT0 128(R11)

#define PVP8 \
	PVP6; \
	PREFETCHT0 192(R11)

// func dot1x8F32(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)
TEXT ·dot1x8F32(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	DOT1X8(NONE, F32NEXT)
	MOVQ out+24(FP), DI
	STORE8(DI)
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
	DOT1X8(ZEROBX, STEP16(F16ROW, NONE, NONE))
	MOVQ out+24(FP), DI
	STORE8(DI)
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
	DOT1X8(ZEROBX, STEP16(BF16ROW, NONE, NONE))
	MOVQ out+24(FP), DI
	STORE8(DI)
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

// Q8BLOCK is dot1x8Q8's step: the 32 floats of x at SI+AX into Y8..Y11,
// Q8ROW of each row's block at BX, then AX and BX on by one block.
#define Q8BLOCK \
	VMOVUPS 0(SI)(AX*1), Y8; \
	VMOVUPS 32(SI)(AX*1), Y9; \
	VMOVUPS 64(SI)(AX*1), Y10; \
	VMOVUPS 96(SI)(AX*1), Y11; \
	Q8ROW(R8, Y0); \
	Q8ROW(R9, Y1); \
	Q8ROW(R10, Y2); \
	Q8ROW(R11, Y3); \
	Q8ROW(R12, Y4); \
	Q8ROW(R13, Y5); \
	Q8ROW(R14, Y6); \
	Q8ROW(DX, Y7); \
	ADDQ    $128, AX; \
	ADDQ    $34, BX

// func dot1x8Q8(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32)
// n8 must be a multiple of 4 (whole 32-element blocks).
TEXT ·dot1x8Q8(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	SHRQ $2, CX
	DOT1X8(ZEROBX, Q8BLOCK)
	MOVQ out+24(FP), DI
	STORE8(DI)
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

// F16WIDEN and BF16WIDEN widen the 8 halves at (SI) exactly into Y0.
#define F16WIDEN \
	VCVTPH2PS (SI), Y0

#define BF16WIDEN \
	VPMOVZXWD (SI), Y0; \
	VPSLLD    $16, Y0, Y0

// CVT16STEP stores the 8 halves at SI, widened by WIDEN, at DI and moves
// both on by 8 elements.
#define CVT16STEP(WIDEN) \
	WIDEN; \
	VMOVUPS Y0, (DI); \
	ADDQ    $16, SI; \
	ADDQ    $32, DI

// CVT16 is the body of cvtF16 and cvtBF16 once dst, src and n8 are in DI,
// SI and CX.
#define CVT16(WIDEN) \
	TESTQ CX, CX; \
	JZ    done; \
loop: \
	CVT16STEP(WIDEN); \
	DECQ  CX; \
	JNZ   loop; \
done: \
	VZEROUPPER; \
	RET

// func cvtF16(dst *float32, src unsafe.Pointer, n8 int)
TEXT ·cvtF16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n8+16(FP), CX
	CVT16(F16WIDEN)

// func cvtBF16(dst *float32, src unsafe.Pointer, n8 int)
TEXT ·cvtBF16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n8+16(FP), CX
	CVT16(BF16WIDEN)

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

// FP8CONST loads the e4m3 constants into Y10..Y12.
#define FP8CONST \
	VPBROADCASTD fp8c<>+0(SB), Y10; \
	VPBROADCASTD fp8c<>+4(SB), Y11; \
	VBROADCASTSS fp8c<>+8(SB), Y12

// FP8DEC decodes the 8 e4m3 codes at (SI), times the scale in Y13, into
// (DI). Uses Y0..Y3 and the constants in Y10..Y12.
#define FP8DEC \
	VPMOVZXBD (SI), Y0; \
	VPAND     Y10, Y0, Y1; \
	VPCMPEQD  Y10, Y1, Y3; \
	VPSLLD    $20, Y1, Y1; \
	VMULPS    Y12, Y1, Y1; \
	VPAND     Y11, Y0, Y2; \
	VPSLLD    $24, Y2, Y2; \
	VPOR      Y2, Y1, Y1; \
	VPOR      Y3, Y1, Y1; \
	VMULPS    Y13, Y1, Y1; \
	VMOVUPS   Y1, (DI)

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
	FP8CONST
	TESTQ        CX, CX
	JZ           done

loop:
	FP8DEC
	ADDQ $8, SI
	ADDQ $32, DI
	DECQ CX
	JNZ  loop

done:
	VZEROUPPER
	RET

// func decodeFP8Keys(dst *float32, codes *uint8, scales *float32, slots *int32, n, d8 int)
// Decodes the index keys of slots[0..n) (8·d8 codes each, times the slot's
// scale) into consecutive rows of dst.
TEXT ·decodeFP8Keys(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ codes+8(FP), R8
	MOVQ scales+16(FP), R9
	MOVQ slots+24(FP), R10
	MOVQ n+32(FP), R11
	MOVQ d8+40(FP), R12
	MOVQ R12, R13
	SHLQ $3, R13
	FP8CONST
	TESTQ R11, R11
	JZ    done

key:
	MOVLQSX      (R10), AX
	VBROADCASTSS (R9)(AX*4), Y13
	IMULQ        R13, AX
	LEAQ         (R8)(AX*1), SI
	MOVQ         R12, CX

vec:
	FP8DEC
	ADDQ $8, SI
	ADDQ $32, DI
	DECQ CX
	JNZ  vec
	ADDQ $4, R10
	DECQ R11
	JNZ  key

done:
	VZEROUPPER
	RET

// func decodeBF16Keys(dst *float32, src *uint16, slots *int32, n, d8 int)
TEXT ·decodeBF16Keys(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), R8
	MOVQ slots+16(FP), R10
	MOVQ n+24(FP), R11
	MOVQ d8+32(FP), R12
	MOVQ R12, R13
	SHLQ $4, R13
	TESTQ R11, R11
	JZ    done

key:
	MOVLQSX (R10), AX
	IMULQ   R13, AX
	LEAQ    (R8)(AX*1), SI
	MOVQ    R12, CX

vec:
	CVT16STEP(BF16WIDEN)
	DECQ      CX
	JNZ       vec
	ADDQ      $4, R10
	DECQ      R11
	JNZ       key

done:
	VZEROUPPER
	RET

// func indexScore8(out, q, w *float32, nh int, keys *float32, nblk, n8 int)
// For blocks b < nblk of 8 keys (float32 rows of 8·n8, consecutive from
// keys): out[8b+l] = Σ_h w[h]·max(dot(q_h, key_{8b+l}), 0), the dots in the
// canonical order, then per head in order one rounded product and one
// rounded sum from +0. q holds nh rows of 8·n8.
TEXT ·indexScore8(SB), NOSPLIT, $24-56
	MOVQ   n8+48(FP), BX
	SHLQ   $5, BX
	MOVQ   nh+24(FP), AX
	IMULQ  BX, AX
	ADDQ   q+8(FP), AX
	MOVQ   AX, 0(SP)
	MOVQ   nblk+40(FP), CX
	MOVQ   CX, 8(SP)
	MOVQ   keys+32(FP), R8
	MOVQ   out+0(FP), DI
	VXORPS Y15, Y15, Y15
	TESTQ  CX, CX
	JZ     done

block:
	LEAQ   (R8)(BX*1), R9
	LEAQ   (R9)(BX*1), R10
	LEAQ   (R10)(BX*1), R11
	LEAQ   (R11)(BX*1), R12
	LEAQ   (R12)(BX*1), R13
	LEAQ   (R13)(BX*1), R14
	LEAQ   (R14)(BX*1), DX
	VXORPS Y9, Y9, Y9
	MOVQ   q+8(FP), SI
	MOVQ   w+16(FP), AX
	MOVQ   AX, 16(SP)

head:
	ZERO8
	XORQ AX, AX
	MOVQ n8+48(FP), CX

step:
	F32STEP
	ADDQ        $32, AX
	DECQ        CX
	JNZ         step
	REDUCE4(Y0, Y1, Y2, Y3)
	REDUCE4(Y4, Y5, Y6, Y7)
	VPERM2F128   $0x20, Y4, Y0, Y8
	VPERM2F128   $0x31, Y4, Y0, Y10
	VADDPS       Y10, Y8, Y8
	VMAXPS       Y8, Y15, Y8
	MOVQ         16(SP), AX
	VBROADCASTSS (AX), Y10
	ADDQ         $4, AX
	MOVQ         AX, 16(SP)
	VMULPS       Y10, Y8, Y8
	VADDPS       Y8, Y9, Y9
	ADDQ         BX, SI
	CMPQ         SI, 0(SP)
	JNE          head
	VMOVUPS      Y9, (DI)
	ADDQ         $32, DI
	LEAQ         (DX)(BX*1), R8
	DECQ         8(SP)
	JNZ          block

done:
	VZEROUPPER
	RET

// Decode at long context waits on memory: a sequence's slots are scattered
// over the pool's pages, the hardware prefetchers cannot follow the slot
// list, and too few row loads are in flight. So attnQK and attnPV prefetch
// the rows of the slots attnAhead (ops.go, 32) ahead of the one they
// compute, as the 16-bit kernels of attn16_amd64.s do: attnQK all the cache
// lines of the K rows of the block of 8 slots attnAhead/8 blocks ahead,
// attnPV those of the current run of columns of the V row attnAhead slots
// ahead, when there are that many more slots. The slot indices read are
// inside slots; the prefetched lines are inside the rows they compute
// with. Prefetches change no result and never fault. attnAhead 0 turns
// them off (for the benchmarks that compare).

// func attnQK(scores, q, k *float32, slots *int32, nblk, stride, n8 int, scale float32)
// For blocks b < nblk of 8 slots: scores[8b+l] = dot(q, K row
// slots[8b+l])·scale, the dot exactly as dot1x8F32 computes it. stride is
// the K row stride in bytes, k points at the head's first element. 0(SP)
// counts the blocks left; R15 and 8(SP)..24(SP) are QKPFSET's, for QKPF8
// (avx2_amd64.h), which prefetches the K rows of the block attnAhead/8
// blocks ahead: their lines at 64-byte steps from each row's head, 8 rows
// to a loop step, and their last bytes unless every row's head starts a
// cache line (k and stride multiples of 64), when those lines are all of
// the rows' lines.
TEXT ·attnQK(SB), NOSPLIT, $32-60
	MOVQ         scores+0(FP), DI
	MOVQ         q+8(FP), SI
	MOVQ         slots+24(FP), BX
	MOVQ         nblk+32(FP), CX
	MOVQ         CX, 0(SP)
	VBROADCASTSS scale+56(FP), Y15
	QKPFSET(·attnAhead(SB), 5)
	TESTQ        CX, CX
	JZ           done

block:
	QKPF8(pfline, nopf)

nopf:
	QKROW(0, R8)
	QKROW(1, R9)
	QKROW(2, R10)
	QKROW(3, R11)
	QKROW(4, R12)
	QKROW(5, R13)
	QKROW(6, R14)
	QKROW(7, DX)
	ZERO8
	XORQ AX, AX
	MOVQ n8+48(FP), CX

step:
	F32STEP
	ADDQ        $32, AX
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

// func attnPV(out, p, v *float32, slots *int32, nslots, stride, n8 int)
// out[c] = Σ_j p[j]·v[slots[j]·stride/4 + c] for c < 8·n8, one FMA per
// slot in slot order, starting from +0. stride is in bytes. Each run of
// columns goes over the slots in two loops: the first, while more than R12
// slots are left (R12 is attnAhead, or 2^62 when that is 0; R14 counts
// them), also prefetches the run's columns of the V row of the slot R12
// ahead, R13 bytes of slots from the current one; the second computes the
// last R12 slots alone. The first prefetches the lines at 64-byte steps
// from the run's start and, unless DX is zero, its last byte: DX is zero
// when v and stride are multiples of 64, so that every run (its columns
// start at multiples of 64 bytes) starts a cache line.
TEXT ·attnPV(SB), NOSPLIT, $0-56
	MOVQ    out+0(FP), DI
	MOVQ    v+16(FP), R8
	MOVQ    stride+40(FP), R9
	MOVQ    n8+48(FP), R10
	PVPFSET(·attnAhead(SB))

	PVRUN(8, ZERO8, PVP8, 255, PVF8, STACC8, oct, hex, octpf, octpfa, octloop, octstore)
	PVRUN(6, ZERO6, PVP6, 191, PVF6, STACC6, hex, quad, hexpf, hexpfa, hexloop, hexstore)
	PVRUN(4, ZERO4, PVP4, 127, PVF4, STACC4, quad, pair, quadpf, quadpfa, quadloop, quadstore)
	PVRUN(2, ZERO2, PVP2, 63, PVF2, STACC2, pair, single, pairpf, pairpfa, pairloop, pairstore)

single:
	TESTQ R10, R10
	JZ    done
	PVSLOTS(ZERO1, PVP1, 31, PVF1, singlepf, singlepfa, singleloop, singlestore)

singlestore:
	STACC1

done:
	VZEROUPPER
	RET

// The vectorised exp used by softmaxF32 and swigluF32.
//
// exp(x) = 2^n · e^r with n = round(x·log2 e) and r = x − n·ln 2 (ln 2 in two
// parts, so r is nearly exact, |r| ≤ ln2/2), e^r by the degree-7 polynomial
// of the Cephes expf (1 + r + r²·P(r)), and 2^n applied as two exact powers
// of two 2^⌊n/2⌋·2^(n−⌊n/2⌋) so that results that overflow, or underflow
// into subnormals, round once and correctly. x is first clamped to
// [−110, 89], beyond which exp is 0 or +Inf in float32; NaN stays NaN.
// TestExpAccuracy measures the error against math.Exp (at most 2 ulps
// where the result is a normal float32).

// -110: exp rounds to +0 below
#define E_LO expc<>+0(SB)
// 89: exp overflows to +Inf above
#define E_HI expc<>+32(SB)
// log2(e)
#define E_LOG2E expc<>+64(SB)
// ln 2, high part (exact times n)
#define E_LN2HI expc<>+96(SB)
// ln 2, low part
#define E_LN2LO expc<>+128(SB)
#define E_C6 expc<>+160(SB)
#define E_C5 expc<>+192(SB)
#define E_C4 expc<>+224(SB)
#define E_C3 expc<>+256(SB)
#define E_C2 expc<>+288(SB)
#define E_C1 expc<>+320(SB)
// 1
#define E_ONE expc<>+352(SB)
// the float32 exponent bias
#define E_I127 expc<>+384(SB)
// -Inf
#define E_NEGINF expc<>+416(SB)
// the sign bit
#define E_SIGN expc<>+448(SB)

// Constants of the vectorised exp, one 32-byte vector each (AVX2 has no
// broadcast memory operands).
DATA expc<>+0(SB)/8, $0xc2dc0000c2dc0000
DATA expc<>+8(SB)/8, $0xc2dc0000c2dc0000
DATA expc<>+16(SB)/8, $0xc2dc0000c2dc0000
DATA expc<>+24(SB)/8, $0xc2dc0000c2dc0000
DATA expc<>+32(SB)/8, $0x42b2000042b20000
DATA expc<>+40(SB)/8, $0x42b2000042b20000
DATA expc<>+48(SB)/8, $0x42b2000042b20000
DATA expc<>+56(SB)/8, $0x42b2000042b20000
DATA expc<>+64(SB)/8, $0x3fb8aa3b3fb8aa3b
DATA expc<>+72(SB)/8, $0x3fb8aa3b3fb8aa3b
DATA expc<>+80(SB)/8, $0x3fb8aa3b3fb8aa3b
DATA expc<>+88(SB)/8, $0x3fb8aa3b3fb8aa3b
DATA expc<>+96(SB)/8, $0x3f3180003f318000
DATA expc<>+104(SB)/8, $0x3f3180003f318000
DATA expc<>+112(SB)/8, $0x3f3180003f318000
DATA expc<>+120(SB)/8, $0x3f3180003f318000
DATA expc<>+128(SB)/8, $0xb95e8083b95e8083
DATA expc<>+136(SB)/8, $0xb95e8083b95e8083
DATA expc<>+144(SB)/8, $0xb95e8083b95e8083
DATA expc<>+152(SB)/8, $0xb95e8083b95e8083
DATA expc<>+160(SB)/8, $0x3950696739506967
DATA expc<>+168(SB)/8, $0x3950696739506967
DATA expc<>+176(SB)/8, $0x3950696739506967
DATA expc<>+184(SB)/8, $0x3950696739506967
DATA expc<>+192(SB)/8, $0x3ab743ce3ab743ce
DATA expc<>+200(SB)/8, $0x3ab743ce3ab743ce
DATA expc<>+208(SB)/8, $0x3ab743ce3ab743ce
DATA expc<>+216(SB)/8, $0x3ab743ce3ab743ce
DATA expc<>+224(SB)/8, $0x3c0889083c088908
DATA expc<>+232(SB)/8, $0x3c0889083c088908
DATA expc<>+240(SB)/8, $0x3c0889083c088908
DATA expc<>+248(SB)/8, $0x3c0889083c088908
DATA expc<>+256(SB)/8, $0x3d2aa9c13d2aa9c1
DATA expc<>+264(SB)/8, $0x3d2aa9c13d2aa9c1
DATA expc<>+272(SB)/8, $0x3d2aa9c13d2aa9c1
DATA expc<>+280(SB)/8, $0x3d2aa9c13d2aa9c1
DATA expc<>+288(SB)/8, $0x3e2aaaaa3e2aaaaa
DATA expc<>+296(SB)/8, $0x3e2aaaaa3e2aaaaa
DATA expc<>+304(SB)/8, $0x3e2aaaaa3e2aaaaa
DATA expc<>+312(SB)/8, $0x3e2aaaaa3e2aaaaa
DATA expc<>+320(SB)/8, $0x3f0000003f000000
DATA expc<>+328(SB)/8, $0x3f0000003f000000
DATA expc<>+336(SB)/8, $0x3f0000003f000000
DATA expc<>+344(SB)/8, $0x3f0000003f000000
DATA expc<>+352(SB)/8, $0x3f8000003f800000
DATA expc<>+360(SB)/8, $0x3f8000003f800000
DATA expc<>+368(SB)/8, $0x3f8000003f800000
DATA expc<>+376(SB)/8, $0x3f8000003f800000
DATA expc<>+384(SB)/8, $0x0000007f0000007f
DATA expc<>+392(SB)/8, $0x0000007f0000007f
DATA expc<>+400(SB)/8, $0x0000007f0000007f
DATA expc<>+408(SB)/8, $0x0000007f0000007f
DATA expc<>+416(SB)/8, $0xff800000ff800000
DATA expc<>+424(SB)/8, $0xff800000ff800000
DATA expc<>+432(SB)/8, $0xff800000ff800000
DATA expc<>+440(SB)/8, $0xff800000ff800000
DATA expc<>+448(SB)/8, $0x8000000080000000
DATA expc<>+456(SB)/8, $0x8000000080000000
DATA expc<>+464(SB)/8, $0x8000000080000000
DATA expc<>+472(SB)/8, $0x8000000080000000
GLOBL expc<>(SB), RODATA|NOPTR, $480

// Lane masks for a tail of r < 8 elements: 32 bytes from masks<>+4·(8-r).
DATA masks<>+0(SB)/8, $0xffffffffffffffff
DATA masks<>+8(SB)/8, $0xffffffffffffffff
DATA masks<>+16(SB)/8, $0xffffffffffffffff
DATA masks<>+24(SB)/8, $0xffffffffffffffff
DATA masks<>+32(SB)/8, $0x0000000000000000
DATA masks<>+40(SB)/8, $0x0000000000000000
DATA masks<>+48(SB)/8, $0x0000000000000000
DATA masks<>+56(SB)/8, $0x0000000000000000
GLOBL masks<>(SB), RODATA|NOPTR, $64

// EXP sets Y0 = exp(Y0), using Y1..Y3.
#define EXP \
	VMOVUPS      E_LO, Y1; \
	VMAXPS       Y0, Y1, Y0; \
	VMOVUPS      E_HI, Y1; \
	VMINPS       Y0, Y1, Y0; \
	VMULPS       E_LOG2E, Y0, Y1; \
	VROUNDPS     $0, Y1, Y1; \
	VFNMADD231PS E_LN2HI, Y1, Y0; \
	VFNMADD231PS E_LN2LO, Y1, Y0; \
	VMOVUPS      E_C6, Y2; \
	VFMADD213PS  E_C5, Y0, Y2; \
	VFMADD213PS  E_C4, Y0, Y2; \
	VFMADD213PS  E_C3, Y0, Y2; \
	VFMADD213PS  E_C2, Y0, Y2; \
	VFMADD213PS  E_C1, Y0, Y2; \
	VMULPS       Y0, Y0, Y3; \
	VFMADD213PS  Y0, Y3, Y2; \
	VADDPS       E_ONE, Y2, Y2; \
	VCVTPS2DQ    Y1, Y1; \
	VPSRAD       $1, Y1, Y3; \
	VPSUBD       Y3, Y1, Y1; \
	VPADDD       E_I127, Y3, Y3; \
	VPSLLD       $23, Y3, Y3; \
	VPADDD       E_I127, Y1, Y1; \
	VPSLLD       $23, Y1, Y1; \
	VMULPS       Y3, Y2, Y2; \
	VMULPS       Y1, Y2, Y0

// TAILMASK sets Y15 to the lane mask of the CX (< 8) elements past the
// last full block. Clobbers AX, BX.
#define TAILMASK \
	LEAQ    masks<>+32(SB), AX; \
	MOVQ    CX, BX; \
	SHLQ    $2, BX; \
	SUBQ    BX, AX; \
	VMOVDQU (AX), Y15

// func expF32(dst, src *float32, n int)
// dst[i] = exp(src[i]) (for the accuracy test).
TEXT ·expF32(SB), NOSPLIT, $0-24
	MOVQ  dst+0(FP), DI
	MOVQ  src+8(FP), SI
	MOVQ  n+16(FP), CX
	MOVQ  CX, DX
	SHRQ  $3, DX
	ANDQ  $7, CX
	TAILMASK
	TESTQ DX, DX
	JZ    tail

loop:
	VMOVUPS (SI), Y0
	EXP
	VMOVUPS Y0, (DI)
	ADDQ    $32, SI
	ADDQ    $32, DI
	DECQ    DX
	JNZ     loop

tail:
	TESTQ      CX, CX
	JZ         done
	VMASKMOVPS (SI), Y15, Y0
	EXP
	VMASKMOVPS Y0, Y15, (DI)

done:
	VZEROUPPER
	RET

// func softmaxF32(x *float32, n int)
// x = exp(x − max x) / Σ, in place. The sum is the canonical 8-lane sum
// (lane l adds the elements ≡ l mod 8 in order; the tail block's unused
// lanes add +0), then each element is divided by it.
TEXT ·softmaxF32(SB), NOSPLIT, $0-16
	MOVQ    x+0(FP), DI
	MOVQ    n+8(FP), CX
	MOVQ    CX, DX
	SHRQ    $3, DX
	ANDQ    $7, CX
	TAILMASK
	VMOVUPS E_NEGINF, Y9

	// Pass 1: the maximum into every lane of Y8.
	VMOVUPS Y9, Y8
	MOVQ    DI, SI
	MOVQ    DX, R9
	TESTQ   R9, R9
	JZ      maxtail

maxloop:
	VMAXPS (SI), Y8, Y8
	ADDQ   $32, SI
	DECQ   R9
	JNZ    maxloop

maxtail:
	TESTQ      CX, CX
	JZ         maxreduce
	VMASKMOVPS (SI), Y15, Y0
	VBLENDVPS  Y15, Y0, Y9, Y0
	VMAXPS     Y0, Y8, Y8

maxreduce:
	VEXTRACTF128 $1, Y8, X0
	VMAXPS       X0, X8, X8
	VPERMILPS    $0x4E, X8, X0
	VMAXPS       X0, X8, X8
	VPERMILPS    $0xB1, X8, X0
	VMAXPS       X0, X8, X8
	VBROADCASTSS X8, Y8

	// Pass 2: exp(x − max) in place, summed in Y10.
	VXORPS Y10, Y10, Y10
	MOVQ   DI, SI
	MOVQ   DX, R9
	TESTQ  R9, R9
	JZ     exptail

exploop:
	VMOVUPS (SI), Y0
	VSUBPS  Y8, Y0, Y0
	EXP
	VMOVUPS Y0, (SI)
	VADDPS  Y0, Y10, Y10
	ADDQ    $32, SI
	DECQ    R9
	JNZ     exploop

exptail:
	TESTQ      CX, CX
	JZ         sumreduce
	VMASKMOVPS (SI), Y15, Y0
	VBLENDVPS  Y15, Y0, Y9, Y0
	VSUBPS     Y8, Y0, Y0
	EXP
	VMASKMOVPS Y0, Y15, (SI)
	VADDPS     Y0, Y10, Y10

sumreduce:
	VHADDPS      Y10, Y10, Y0
	VHADDPS      Y0, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VADDPS       X1, X0, X0
	VBROADCASTSS X0, Y11

	// Pass 3: divide by the sum.
	MOVQ  DI, SI
	MOVQ  DX, R9
	TESTQ R9, R9
	JZ    divtail

divloop:
	VMOVUPS (SI), Y0
	VDIVPS  Y11, Y0, Y0
	VMOVUPS Y0, (SI)
	ADDQ    $32, SI
	DECQ    R9
	JNZ     divloop

divtail:
	TESTQ      CX, CX
	JZ         done
	VMASKMOVPS (SI), Y15, Y0
	VDIVPS     Y11, Y0, Y0
	VMASKMOVPS Y0, Y15, (SI)

done:
	VZEROUPPER
	RET

// SILU8 sets Y0 = (Y4 / (1 + exp(−Y4))) · Y5, in the reference's order.
#define SILU8 \
	VXORPS E_SIGN, Y4, Y0; \
	EXP; \
	VADDPS E_ONE, Y0, Y0; \
	VDIVPS Y0, Y4, Y0; \
	VMULPS Y5, Y0, Y0

// func swigluF32(dst, gate, up *float32, n int)
TEXT ·swigluF32(SB), NOSPLIT, $0-32
	MOVQ  dst+0(FP), DI
	MOVQ  gate+8(FP), SI
	MOVQ  up+16(FP), R8
	MOVQ  n+24(FP), CX
	MOVQ  CX, DX
	SHRQ  $3, DX
	ANDQ  $7, CX
	TAILMASK
	TESTQ DX, DX
	JZ    tail

loop:
	VMOVUPS (SI), Y4
	VMOVUPS (R8), Y5
	SILU8
	VMOVUPS Y0, (DI)
	ADDQ    $32, SI
	ADDQ    $32, R8
	ADDQ    $32, DI
	DECQ    DX
	JNZ     loop

tail:
	TESTQ      CX, CX
	JZ         done
	VMASKMOVPS (SI), Y15, Y4
	VMASKMOVPS (R8), Y15, Y5
	SILU8
	VMASKMOVPS Y0, Y15, (DI)

done:
	VZEROUPPER
	RET

// The streaming 1×8 kernels: dot1x8F32, dot1x8F16 and dot1x8BF16 with the
// same FMAs in the same order, plus software prefetches of pf: each 8
// columns, the next bytes of W the eight rows take (256 for F32, 128 for
// halves), so that a call prefetches a region as long as the rows it reads.
// The caller points pf at the rows that follow the panel (the matrix is
// one sequential stream read 8 rows at a time); a prefetch changes no
// result and never faults.

// func dot1x8F32P(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)
TEXT ·dot1x8F32P(SB), NOSPLIT, $0-40
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	MOVQ pf+32(FP), BX
	DOT1X8(NONE, F32PFSTEP)
	MOVQ out+24(FP), DI
	STORE8(DI)
	VZEROUPPER
	RET

// func dot1x8F16P(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)
TEXT ·dot1x8F16P(SB), NOSPLIT, $0-40
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	MOVQ pf+32(FP), R15
	DOT1X8(ZEROBX, STEP16(F16ROW, PF16, PF16NEXT))
	MOVQ out+24(FP), DI
	STORE8(DI)
	VZEROUPPER
	RET

// func dot1x8BF16P(x *float32, w *[8]unsafe.Pointer, n8 int, out *[8]float32, pf unsafe.Pointer)
TEXT ·dot1x8BF16P(SB), NOSPLIT, $0-40
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ n8+16(FP), CX
	MOVQ pf+32(FP), R15
	DOT1X8(ZEROBX, STEP16(BF16ROW, PF16, PF16NEXT))
	MOVQ out+24(FP), DI
	STORE8(DI)
	VZEROUPPER
	RET
