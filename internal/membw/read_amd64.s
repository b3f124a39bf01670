#include "textflag.h"

// func readBlocksAVX2(p *byte, n int) uint64
// XORs n blocks of 256 bytes into four accumulators: eight 32-byte loads
// per iteration, no dependency between the loads, the XORs spread over
// four chains.
TEXT ·readBlocksAVX2(SB), NOSPLIT, $0-24
	MOVQ  p+0(FP), SI
	MOVQ  n+8(FP), CX
	VPXOR Y0, Y0, Y0
	VPXOR Y1, Y1, Y1
	VPXOR Y2, Y2, Y2
	VPXOR Y3, Y3, Y3

loop:
	VPXOR (SI), Y0, Y0
	VPXOR 32(SI), Y1, Y1
	VPXOR 64(SI), Y2, Y2
	VPXOR 96(SI), Y3, Y3
	VPXOR 128(SI), Y0, Y0
	VPXOR 160(SI), Y1, Y1
	VPXOR 192(SI), Y2, Y2
	VPXOR 224(SI), Y3, Y3
	ADDQ  $256, SI
	DECQ  CX
	JNZ   loop

	VPXOR        Y1, Y0, Y0
	VPXOR        Y3, Y2, Y2
	VPXOR        Y2, Y0, Y0
	VEXTRACTI128 $1, Y0, X1
	VPXOR        X1, X0, X0
	VPSHUFD      $0x4E, X0, X1
	VPXOR        X1, X0, X0
	VZEROUPPER
	MOVQ         X0, AX
	MOVQ         AX, ret+16(FP)
	RET
