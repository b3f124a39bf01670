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

// The attention kernels' row prefetch (attnQK and attnPV of kern_amd64.s,
// their 16-bit twins of attn16_amd64.s; kern_amd64.s describes it).

// QKPFSET sets up attnQK's prefetch (frame of 32 bytes, CX kept): R15 the
// bytes of a row's 8·n8 elements (n8 shifted left by shift), 8(SP) the
// fewest blocks left (the current one included) with which the block ahead/8
// blocks ahead exists (2^62 when ahead < 8: off), 16(SP) the bytes of slots
// from a block to it, 24(SP) zero when every row's head starts a cache line
// (k and stride multiples of 64). ahead is the distance in slots, rounded
// down to whole blocks. Clobbers AX, DX, R8.
#define QKPFSET(ahead, shift) \
	MOVQ    n8+48(FP), R15; \
	SHLQ    $shift, R15; \
	MOVQ    ahead, AX; \
	ANDQ    $-8, AX; \
	MOVQ    $0x4000000000000000, DX; \
	LEAQ    (AX*4), R8; \
	SHRQ    $3, AX; \
	INCQ    AX; \
	CMPQ    AX, $1; \
	CMOVQEQ DX, AX; \
	MOVQ    AX, 8(SP); \
	MOVQ    R8, 16(SP); \
	MOVQ    k+16(FP), AX; \
	ORQ     stride+40(FP), AX; \
	ANDQ    $63, AX; \
	MOVQ    AX, 24(SP)

// PFROW loads into r the address of the K row of the slot at i*4(CX), for
// attnQK's prefetch.
#define PFROW(i, r) \
	MOVLQSX i*4(CX), r; \
	IMULQ   stride+40(FP), r; \
	ADDQ    k+16(FP), r

// QKPF8 prefetches, when the block ahead exists (0(SP) blocks left, BX at
// the current block's slots), the cache lines of its 8 K rows: the rows
// into R8..R14, DX (free until QKROW), then their lines one offset at a
// time, 8 rows to a loop step (pfline), and their last bytes unless 24(SP)
// is zero; then (or at once) it goes on at nopf. Clobbers AX, CX.
#define QKPF8(pfline, nopf) \
	MOVQ       0(SP), AX; \
	CMPQ       AX, 8(SP); \
	JLT        nopf; \
	MOVQ       16(SP), CX; \
	ADDQ       BX, CX; \
	PFROW(0, R8); \
	PFROW(1, R9); \
	PFROW(2, R10); \
	PFROW(3, R11); \
	PFROW(4, R12); \
	PFROW(5, R13); \
	PFROW(6, R14); \
	PFROW(7, DX); \
	XORQ       AX, AX; \
pfline: \
	PREFETCHT0 (R8)(AX*1); \
	PREFETCHT0 (R9)(AX*1); \
	PREFETCHT0 (R10)(AX*1); \
	PREFETCHT0 (R11)(AX*1); \
	PREFETCHT0 (R12)(AX*1); \
	PREFETCHT0 (R13)(AX*1); \
	PREFETCHT0 (R14)(AX*1); \
	PREFETCHT0 (DX)(AX*1); \
	ADDQ       $64, AX; \
	CMPQ       AX, R15; \
	JLT        pfline; \
	CMPQ       24(SP), $0; \
	JEQ        nopf; \
	PREFETCHT0 -1(R8)(R15*1); \
	PREFETCHT0 -1(R9)(R15*1); \
	PREFETCHT0 -1(R10)(R15*1); \
	PREFETCHT0 -1(R11)(R15*1); \
	PREFETCHT0 -1(R12)(R15*1); \
	PREFETCHT0 -1(R13)(R15*1); \
	PREFETCHT0 -1(R14)(R15*1); \
	PREFETCHT0 -1(DX)(R15*1)

// PVPFSET sets up attnPV's prefetch (R8 v, R9 stride loaded): R12 ahead,
// the distance in slots (2^62 when it is 0: off), R13 its bytes of slots,
// DX zero when v and stride are multiples of 64. Clobbers AX.
#define PVPFSET(ahead) \
	MOVQ    ahead, R12; \
	LEAQ    (R12*4), R13; \
	MOVQ    $0x4000000000000000, AX; \
	TESTQ   R12, R12; \
	CMOVQLE AX, R12; \
	MOVQ    R8, DX; \
	ORQ     R9, DX; \
	ANDQ    $63, DX

// PVAHEAD loads the row address of the slot R13 bytes of slots ahead into
// R11.
#define PVAHEAD \
	MOVLQSX (BX)(R13*1), R11; \
	IMULQ   R9, R11; \
	ADDQ    R8, R11

// PVNEXT moves SI and BX on to the next slot.
#define PVNEXT \
	ADDQ $4, BX; \
	ADDQ $4, SI

// PVSLOTS clears a run's accumulators (ZERO) and goes over the slots in
// the three loops that attnPV's comment describes: pf prefetching the lines
// PF and the byte last, pfa the lines PF alone, loop none; STEP adds a
// slot's products. With no slots it goes to store.
#define PVSLOTS(ZERO, PF, last, STEP, pf, pfa, loop, store) \
	PVBEGIN(ZERO, store); \
	MOVQ       CX, R14; \
	SUBQ       R12, R14; \
	JLE        loop; \
	MOVQ       R12, CX; \
	TESTQ      DX, DX; \
	JZ         pfa; \
pf: \
	PVSLOT; \
	PVAHEAD; \
	PF; \
	PREFETCHT0 last(R11); \
	STEP; \
	PVNEXT; \
	DECQ       R14; \
	JNZ        pf; \
	JMP        loop; \
pfa: \
	PVSLOT; \
	PVAHEAD; \
	PF; \
	STEP; \
	PVNEXT; \
	DECQ       R14; \
	JNZ        pfa; \
loop: \
	PVSLOT; \
	STEP; \
	PVNEXT; \
	DECQ       CX; \
	JNZ        loop

// PVRUN does the runs of n·8 columns while at least n are left (R10, in
// 8s), STORE storing a run's sums at DI and R8, the run's byte offset in
// a row, moving by its row bytes (last+1: 32n for F32 rows, 16n for 16-bit
// ones); then it goes to next.
#define PVRUN(n, ZERO, PF, last, STEP, STORE, run, next, pf, pfa, loop, store) \
run: \
	CMPQ       R10, $n; \
	JLT        next; \
	PVSLOTS(ZERO, PF, last, STEP, pf, pfa, loop, store); \
store: \
	STORE; \
	ADDQ       $(32*n), DI; \
	ADDQ       $(last+1), R8; \
	SUBQ       $n, R10; \
	JMP        run
