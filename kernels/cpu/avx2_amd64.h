// Macros shared by the AVX2 + FMA kernels of kern_amd64.s, attn16_amd64.s
// and stream_amd64.s. kern_amd64.s describes the canonical dot product they
// keep.

// REDUCE4 leaves in ya, per 128-bit half, the partial sums of ya, yb, yc, yd:
// low half [a0123, b0123, c0123, d0123], high half the same of lanes 4..7;
// adding the two halves finishes the tree. Clobbers yc.
#define REDUCE4(ya, yb, yc, yd) \
	VHADDPS yb, ya, ya; \
	VHADDPS yd, yc, yc; \
	VHADDPS yc, ya, ya

// STORE8 reduces Y0..Y7 and stores the eight sums at (r).
#define STORE8(r) \
	REDUCE4(Y0, Y1, Y2, Y3); \
	REDUCE4(Y4, Y5, Y6, Y7); \
	VPERM2F128 $0x20, Y4, Y0, Y8; \
	VPERM2F128 $0x31, Y4, Y0, Y9; \
	VADDPS Y9, Y8, Y8; \
	VMOVUPS Y8, (r)

// ZEROn clears the n accumulators Y0 up to Y(n-1).
#define ZERO1 \
	VXORPS Y0, Y0, Y0

#define ZERO2 \
	ZERO1; \
	VXORPS Y1, Y1, Y1

#define ZERO4 \
	ZERO2; \
	VXORPS Y2, Y2, Y2; \
	VXORPS Y3, Y3, Y3

#define ZERO6 \
	ZERO4; \
	VXORPS Y4, Y4, Y4; \
	VXORPS Y5, Y5, Y5

#define ZERO8 \
	ZERO6; \
	VXORPS Y6, Y6, Y6; \
	VXORPS Y7, Y7, Y7

// STACCn stores the n accumulators Y0 up to Y(n-1) at DI, 32 bytes each.
#define STACC1 \
	VMOVUPS Y0, 0(DI)

#define STACC2 \
	STACC1; \
	VMOVUPS Y1, 32(DI)

#define STACC4 \
	STACC2; \
	VMOVUPS Y2, 64(DI); \
	VMOVUPS Y3, 96(DI)

#define STACC6 \
	STACC4; \
	VMOVUPS Y4, 128(DI); \
	VMOVUPS Y5, 160(DI)

#define STACC8 \
	STACC6; \
	VMOVUPS Y6, 192(DI); \
	VMOVUPS Y7, 224(DI)

// F32STEP loads the 8 floats of x at SI+AX into Y8 and adds their products
// with the 8 of each row R8..R14, DX at AX into Y0..Y7.
#define F32STEP \
	VMOVUPS     (SI)(AX*1), Y8; \
	VFMADD231PS (R8)(AX*1), Y8, Y0; \
	VFMADD231PS (R9)(AX*1), Y8, Y1; \
	VFMADD231PS (R10)(AX*1), Y8, Y2; \
	VFMADD231PS (R11)(AX*1), Y8, Y3; \
	VFMADD231PS (R12)(AX*1), Y8, Y4; \
	VFMADD231PS (R13)(AX*1), Y8, Y5; \
	VFMADD231PS (R14)(AX*1), Y8, Y6; \
	VFMADD231PS (DX)(AX*1), Y8, Y7

// F32PFSTEP is F32STEP with the four cache lines at BX prefetched first,
// then moves AX to the next 8 floats and BX 256 bytes on: the loop step of
// the F32 kernels that prefetch the weights (dot1x8F32P, dot1x8F32S).
#define F32PFSTEP \
	PREFETCHT0  (BX); \
	PREFETCHT0  64(BX); \
	PREFETCHT0  128(BX); \
	PREFETCHT0  192(BX); \
	F32STEP; \
	ADDQ        $256, BX; \
	ADDQ        $32, AX

// QKROW loads into r the address of K row slots[i] (stride and base from
// the arguments).
#define QKROW(i, r) \
	MOVLQSX i*4(BX), r; \
	IMULQ   stride+40(FP), r; \
	ADDQ    k+16(FP), r

// PVSLOT loads slot j's row address into AX and p[j] broadcast into Y15.
#define PVSLOT \
	MOVLQSX      (BX), AX; \
	IMULQ        R9, AX; \
	ADDQ         R8, AX; \
	VBROADCASTSS (SI), Y15

// PVBEGIN clears a run's accumulators (ZERO) and sets SI, BX and CX to p,
// slots and nslots for the loop over the slots of attnPV (and its 16-bit
// twins); with no slots it goes to store.
#define PVBEGIN(ZERO, store) \
	ZERO; \
	MOVQ  p+8(FP), SI; \
	MOVQ  slots+24(FP), BX; \
	MOVQ  nslots+32(FP), CX; \
	TESTQ CX, CX; \
	JZ    store
