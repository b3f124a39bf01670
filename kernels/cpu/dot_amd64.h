// Macros of the 1×8 decode kernels of kern_amd64.s (dot1x8F32, dot1x8F16,
// dot1x8BF16, dot1x8Q8 and the P twins that prefetch), of their streaming
// twins (stream_amd64.s) and of pack8Z (gemm_avx512_amd64.s). Each kernel
// loads its own arguments; the macros take registers. A twin and its P
// version differ only in the arguments they pass: the P kernels' prefetch
// (F32PFSTEP, PF16 and PF16NEXT) where the others pass NONE.

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

// NONE is the empty argument: what a kernel that does not prefetch, or
// keeps no offset in BX, passes where the others do.
#define NONE

// ZEROBX clears BX, the weights' offset of the kernels that keep one apart
// from x's offset in AX.
#define ZEROBX \
	XORQ BX, BX

// DOT1X8 is the body of the 1×8 kernels once x, w and the step count are
// in SI, DI and CX (and pf, in the P kernels, in BX or R15): the rows into
// R8..R14, DX, the accumulators Y0..Y7 cleared, AX and, by ZX (ZEROBX or
// NONE), BX zeroed, then CX times STEP, which moves AX, BX and pf on.
// It ends at reduce, where the kernel stores the eight sums.
#define DOT1X8(ZX, STEP) \
	LOADW8; \
	ZERO8; \
	XORQ  AX, AX; \
	ZX; \
	TESTQ CX, CX; \
	JZ    reduce; \
loop: \
	STEP; \
	DECQ  CX; \
	JNZ   loop; \
reduce:

// F32NEXT is the step of dot1x8F32: F32STEP, then AX on to the next 8
// floats. dot1x8F32P's is F32PFSTEP, the same with the prefetches.
#define F32NEXT \
	F32STEP; \
	ADDQ $32, AX

// ROWS8 adds, by ROW (F16ROW, BF16ROW and the streaming SF16ROW,
// SBF16ROW), the products of x's 8 floats in Y8 with the 8 elements of
// each row R8..R14, DX into Y0..Y7, through the temporaries Y9..Y12.
#define ROWS8(ROW) \
	ROW(R8, Y9, Y0); \
	ROW(R9, Y10, Y1); \
	ROW(R10, Y11, Y2); \
	ROW(R11, Y12, Y3); \
	ROW(R12, Y9, Y4); \
	ROW(R13, Y10, Y5); \
	ROW(R14, Y11, Y6); \
	ROW(DX, Y12, Y7)

// STEP16 is the step of the 16-bit 1×8 kernels: the 8 floats of x at
// SI+AX into Y8, ROW (F16ROW, BF16ROW) of each row at BX, then AX and BX
// on by 8 elements. PF and PFNEXT are the P kernels' prefetch of the two
// lines at R15 and R15's move to the next 128 bytes (PF16, PF16NEXT), NONE
// in the others.
#define STEP16(ROW, PF, PFNEXT) \
	PF; \
	VMOVUPS (SI)(AX*1), Y8; \
	ROWS8(ROW); \
	PFNEXT; \
	ADDQ    $32, AX; \
	ADDQ    $16, BX

#define PF16 \
	PREFETCHT0 (R15); \
	PREFETCHT0 64(R15)

#define PF16NEXT \
	ADDQ $128, R15
