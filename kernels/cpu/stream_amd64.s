//go:build amd64

#include "textflag.h"

// The decode kernel that streams a part of a float32 matrix in one call
// (see stream_amd64.go): the 1×8 kernel dot1x8F32P (kern_amd64.s), the same
// FMAs in the same order, looped over consecutive panels in assembly, so
// that no Go code runs between two panels while DRAM streams.

// SZERO8 clears Y0..Y7.
#define SZERO8 \
	VXORPS Y0, Y0, Y0; \
	VXORPS Y1, Y1, Y1; \
	VXORPS Y2, Y2, Y2; \
	VXORPS Y3, Y3, Y3; \
	VXORPS Y4, Y4, Y4; \
	VXORPS Y5, Y5, Y5; \
	VXORPS Y6, Y6, Y6; \
	VXORPS Y7, Y7, Y7

// SREDUCE4 and SSTORE8 are REDUCE4 and STORE8 of kern_amd64.s (the
// canonical horizontal sum), storing at (r).
#define SREDUCE4(ya, yb, yc, yd) \
	VHADDPS yb, ya, ya; \
	VHADDPS yd, yc, yc; \
	VHADDPS yc, ya, ya

#define SSTORE8(r) \
	SREDUCE4(Y0, Y1, Y2, Y3); \
	SREDUCE4(Y4, Y5, Y6, Y7); \
	VPERM2F128 $0x20, Y4, Y0, Y8; \
	VPERM2F128 $0x31, Y4, Y0, Y9; \
	VADDPS Y9, Y8, Y8; \
	VMOVUPS Y8, (r)

// func dot1x8F32S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)
TEXT ·dot1x8F32S(SB), NOSPLIT, $0-56
	MOVQ x+0(FP), SI
	MOVQ w+8(FP), DI
	MOVQ rb+16(FP), R15
	MOVQ DI, BX
	ADDQ pfoff+48(FP), BX

panel:
	// The panel's eight rows, and DI past them.
	MOVQ DI, R8
	LEAQ (R8)(R15*1), R9
	LEAQ (R9)(R15*1), R10
	LEAQ (R10)(R15*1), R11
	LEAQ (R11)(R15*1), R12
	LEAQ (R12)(R15*1), R13
	LEAQ (R13)(R15*1), R14
	LEAQ (R14)(R15*1), DX
	LEAQ (DX)(R15*1), DI
	SZERO8
	XORQ AX, AX
	MOVQ n8+24(FP), CX

loop:
	PREFETCHT0  (BX)
	PREFETCHT0  64(BX)
	PREFETCHT0  128(BX)
	PREFETCHT0  192(BX)
	VMOVUPS     (SI)(AX*1), Y8
	VFMADD231PS (R8)(AX*1), Y8, Y0
	VFMADD231PS (R9)(AX*1), Y8, Y1
	VFMADD231PS (R10)(AX*1), Y8, Y2
	VFMADD231PS (R11)(AX*1), Y8, Y3
	VFMADD231PS (R12)(AX*1), Y8, Y4
	VFMADD231PS (R13)(AX*1), Y8, Y5
	VFMADD231PS (R14)(AX*1), Y8, Y6
	VFMADD231PS (DX)(AX*1), Y8, Y7
	ADDQ        $256, BX
	ADDQ        $32, AX
	DECQ        CX
	JNZ         loop

	MOVQ out+40(FP), AX
	SSTORE8(AX)
	ADDQ $32, AX
	MOVQ AX, out+40(FP)
	DECQ np+32(FP)
	JNZ  panel
	VZEROUPPER
	RET
