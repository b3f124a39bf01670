#include "textflag.h"

// func maxF32x32(x *float32, n32 int) float32
// The largest non-NaN value of x[0:32·n32] (−Inf if there is none): four
// accumulators, each VMAXPS keeping the accumulator when x is NaN (MAXPS
// returns its second source when either is NaN).
TEXT ·maxF32x32(SB), NOSPLIT, $0-20
	MOVQ         x+0(FP), SI
	MOVQ         n32+8(FP), CX
	MOVL         $0xff800000, AX
	MOVL         AX, X0
	VBROADCASTSS X0, Y0
	VMOVAPS      Y0, Y1
	VMOVAPS      Y0, Y2
	VMOVAPS      Y0, Y3

loop:
	VMOVUPS (SI), Y4
	VMOVUPS 32(SI), Y5
	VMOVUPS 64(SI), Y6
	VMOVUPS 96(SI), Y7
	VMAXPS  Y0, Y4, Y0
	VMAXPS  Y1, Y5, Y1
	VMAXPS  Y2, Y6, Y2
	VMAXPS  Y3, Y7, Y3
	ADDQ    $128, SI
	DECQ    CX
	JNZ     loop

	VMAXPS       Y1, Y0, Y0
	VMAXPS       Y3, Y2, Y2
	VMAXPS       Y2, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VMAXPS       X1, X0, X0
	VPERMILPS    $0x4E, X0, X1
	VMAXPS       X1, X0, X0
	VPERMILPS    $0xB1, X0, X1
	VMAXPS       X1, X0, X0
	VZEROUPPER
	MOVSS        X0, ret+16(FP)
	RET

// func firstEqF32x8(x *float32, n8 int, m float32) int
// The index of the first element of x[0:8·n8] equal to m, or −1.
TEXT ·firstEqF32x8(SB), NOSPLIT, $0-32
	MOVQ         x+0(FP), SI
	MOVQ         n8+8(FP), CX
	VBROADCASTSS m+16(FP), Y0
	XORQ         DX, DX

scan:
	VCMPPS    $0, (SI), Y0, Y1
	VMOVMSKPS Y1, AX
	TESTL     AX, AX
	JNZ       found
	ADDQ      $32, SI
	ADDQ      $8, DX
	DECQ      CX
	JNZ       scan
	VZEROUPPER
	MOVQ      $-1, ret+24(FP)
	RET

found:
	BSFL       AX, AX
	ADDQ       AX, DX
	VZEROUPPER
	MOVQ       DX, ret+24(FP)
	RET
