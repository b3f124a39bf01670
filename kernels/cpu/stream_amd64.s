//go:build amd64

#include "textflag.h"
#include "avx2_amd64.h"
#include "dot_amd64.h"

// The decode kernels that stream a part of a matrix in one call (see
// stream_amd64.go): the 1×8 kernels dot1x8F32P, dot1x8F16P and dot1x8BF16P
// (kern_amd64.s), the same FMAs in the same order, looped over consecutive
// panels in assembly, so that no Go code runs between two panels while
// DRAM streams.

// SENTRY loads the arguments every streaming kernel keeps in registers:
// x in SI, the first panel in DI, the row bytes in R15 and the address
// pfoff ahead of DI, which the loop prefetches, in BX.
#define SENTRY \
	MOVQ x+0(FP), SI; \
	MOVQ w+8(FP), DI; \
	MOVQ rb+16(FP), R15; \
	MOVQ DI, BX; \
	ADDQ pfoff+48(FP), BX

// SPANEL points R8..R14, DX at the panel's eight rows and DI past them,
// clears the accumulators and sets AX to 0 and CX to n8 for the loop.
#define SPANEL \
	MOVQ DI, R8; \
	LEAQ (R8)(R15*1), R9; \
	LEAQ (R9)(R15*1), R10; \
	LEAQ (R10)(R15*1), R11; \
	LEAQ (R11)(R15*1), R12; \
	LEAQ (R12)(R15*1), R13; \
	LEAQ (R13)(R15*1), R14; \
	LEAQ (R14)(R15*1), DX; \
	LEAQ (DX)(R15*1), DI; \
	ZERO8; \
	XORQ AX, AX; \
	MOVQ n8+24(FP), CX

// SNEXT stores the panel's eight sums at out, moves out past them and goes
// back to panel while panels are left; then it returns.
#define SNEXT(panel) \
	MOVQ out+40(FP), AX; \
	STORE8(AX); \
	ADDQ $32, AX; \
	MOVQ AX, out+40(FP); \
	DECQ np+32(FP); \
	JNZ  panel; \
	VZEROUPPER; \
	RET

// func dot1x8F32S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)
TEXT ·dot1x8F32S(SB), NOSPLIT, $0-56
	SENTRY

panel:
	SPANEL

loop:
	F32PFSTEP
	DECQ CX
	JNZ  loop
	SNEXT(panel)

// SF16ROW and SBF16ROW are F16ROW and BF16ROW of kern_amd64.s with the
// weights' offset in AX (x is read at twice it): the eight halves of row
// r widened exactly into t, then the FMA into acc.
#define SF16ROW(r, t, acc) \
	VCVTPH2PS   (r)(AX*1), t; \
	VFMADD231PS t, Y8, acc

#define SBF16ROW(r, t, acc) \
	VPMOVZXWD   (r)(AX*1), t; \
	VPSLLD      $16, t, t; \
	VFMADD231PS t, Y8, acc

// DOT1X8S16 is the body of dot1x8F16S and dot1x8BF16S, ROW (SF16ROW,
// SBF16ROW) widening a row's 8 elements and adding their products (ROWS8,
// dot_amd64.h).
#define DOT1X8S16(ROW) \
	SENTRY; \
panel: \
	SPANEL; \
loop: \
	PREFETCHT0 (BX); \
	PREFETCHT0 64(BX); \
	VMOVUPS    (SI)(AX*2), Y8; \
	ROWS8(ROW); \
	ADDQ       $128, BX; \
	ADDQ       $16, AX; \
	DECQ       CX; \
	JNZ        loop; \
	SNEXT(panel)

// func dot1x8F16S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)
TEXT ·dot1x8F16S(SB), NOSPLIT, $0-56
	DOT1X8S16(SF16ROW)

// func dot1x8BF16S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)
TEXT ·dot1x8BF16S(SB), NOSPLIT, $0-56
	DOT1X8S16(SBF16ROW)
