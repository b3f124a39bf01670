//go:build amd64

#include "textflag.h"
#include "avx2_amd64.h"

// Attention over a 16-bit KV pool (AVX2 + FMA + F16C): attnQK and attnPV of
// kern_amd64.s with each K or V element widened exactly before its FMA, the
// same FMAs in the same order, so that a 16-bit pool gives the bits of an
// F32 pool holding the widened values. F16 widens by VCVTPH2PS, BF16 by
// moving each 16-bit word into the high half of a zeroed 32-bit lane. The
// Go declarations are in kern_amd64.go, the pure-Go twins in
// kern_generic.go.

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

// Decode at long context waits on memory, so both kernels prefetch the
// rows of the slots attnAhead16 (ops.go, 64) ahead of the one they compute,
// as attnQK and attnPV of kern_amd64.s do with attnAhead (32 F32 rows, the
// bytes of 64 16-bit ones) and with the same macros (avx2_amd64.h): attnQK16
// all the cache lines of the K rows of the block of 8 slots attnAhead16/8
// blocks ahead, 8 rows to a loop step, attnPV16 those of the current run of
// columns of the V row attnAhead16 slots ahead, in a first loop over all
// but the last attnAhead16 slots, with no bound check per slot. The slot
// indices read are inside slots; the prefetched lines are inside the rows
// they compute with; a row's last byte is prefetched only when rows need
// not start cache lines. Prefetches change no result and never fault.
// attnAhead16 0 turns them off (for the benchmarks that compare).

// The kernels' bodies are written once, as the macros below; the F16 and
// BF16 kernels instantiate them with their widening macros. Labels are
// local to each TEXT, so a body's labels may stand in both.

// QKCOL widens the 8 elements of row r at AX into t (by W) and adds their
// products with q's 8 in Y8 into acc.
#define QKCOL(W, r, t, acc) \
	W((r)(AX*1), t); \
	VFMADD231PS t, Y8, acc

// NOSETUP is the empty SETUP of a kernel body.
#define NOSETUP

// QKSETBF16 loads WBF16S's shuffle control into Y13.
#define QKSETBF16 \
	VMOVDQU bf16shuf<>(SB), Y13

// ATTNQK16 is the body of attnQKF16 and attnQKBF16: W widens 8 elements
// (WF16, WBF16S), SETUP (NOSETUP, QKSETBF16) loads W's constants.
#define ATTNQK16(W, SETUP) \
	MOVQ         scores+0(FP), DI; \
	MOVQ         q+8(FP), SI; \
	MOVQ         slots+24(FP), BX; \
	MOVQ         nblk+32(FP), CX; \
	MOVQ         CX, 0(SP); \
	VBROADCASTSS scale+56(FP), Y15; \
	QKPFSET(·attnAhead16(SB), 4); \
	SETUP; \
	TESTQ        CX, CX; \
	JZ           done; \
block: \
	QKPF8(pfline, nopf); \
nopf: \
	QKROW(0, R8); \
	QKROW(1, R9); \
	QKROW(2, R10); \
	QKROW(3, R11); \
	QKROW(4, R12); \
	QKROW(5, R13); \
	QKROW(6, R14); \
	QKROW(7, DX); \
	ZERO8; \
	XORQ         AX, AX; \
	MOVQ         n8+48(FP), CX; \
step: \
	VMOVUPS      (SI)(AX*2), Y8; \
	QKCOL(W, R8, Y9, Y0); \
	QKCOL(W, R9, Y10, Y1); \
	QKCOL(W, R10, Y11, Y2); \
	QKCOL(W, R11, Y12, Y3); \
	QKCOL(W, R12, Y9, Y4); \
	QKCOL(W, R13, Y10, Y5); \
	QKCOL(W, R14, Y11, Y6); \
	QKCOL(W, DX, Y12, Y7); \
	ADDQ         $16, AX; \
	DECQ         CX; \
	JNZ          step; \
	REDUCE4(Y0, Y1, Y2, Y3); \
	REDUCE4(Y4, Y5, Y6, Y7); \
	VPERM2F128   $0x20, Y4, Y0, Y8; \
	VPERM2F128   $0x31, Y4, Y0, Y9; \
	VADDPS       Y9, Y8, Y8; \
	VMULPS       Y15, Y8, Y8; \
	VMOVUPS      Y8, (DI); \
	ADDQ         $32, DI; \
	ADDQ         $32, BX; \
	DECQ         0(SP); \
	JNZ          block; \
done: \
	VZEROUPPER; \
	RET

// PVL1 and PVL2 prefetch the lines at 64-byte steps of a run of columns
// of the row at R11, PVL1 those of a run of 32 columns or fewer (64
// bytes), PVL2 of 48 or 64; PVSLOTS adds the run's last byte unless rows
// start cache lines. When they do, every run starts at 0 or 32 bytes past
// a line (runs of 64 and 32 columns keep the line, one of 48 moves it by
// 32), and a run of 8 or 16 columns at 32 fits in its line.
#define PVL1 \
	PREFETCHT0 (R11)

#define PVL2 \
	PVL1; \
	PREFETCHT0 64(R11)

// ATTNPV16 is the body of attnPVF16 and attnPVBF16: SETUP loads the
// widening's constants, Sn adds p[j] times a run of n·8 columns into the
// run's accumulators, STn stores them at DI (ST1 is the same for both).
#define ATTNPV16(SETUP, S8, S6, S4, S2, S1, ST8, ST6, ST4, ST2) \
	MOVQ out+0(FP), DI; \
	MOVQ v+16(FP), R8; \
	MOVQ stride+40(FP), R9; \
	MOVQ n8+48(FP), R10; \
	SETUP; \
	PVPFSET(·attnAhead16(SB)); \
	PVRUN(8, ZERO8, PVL2, 127, S8, ST8, oct, hex, octpf, octpfa, octloop, octstore); \
	PVRUN(6, ZERO6, PVL2, 95, S6, ST6, hex, quad, hexpf, hexpfa, hexloop, hexstore); \
	PVRUN(4, ZERO4, PVL1, 63, S4, ST4, quad, pair, quadpf, quadpfa, quadloop, quadstore); \
	PVRUN(2, ZERO2, PVL1, 31, S2, ST2, pair, single, pairpf, pairpfa, pairloop, pairstore); \
single: \
	TESTQ R10, R10; \
	JZ    done; \
	PVSLOTS(ZERO1, PVL1, 15, S1, singlepf, singlepfa, singleloop, singlestore); \
singlestore: \
	STACC1; \
done: \
	VZEROUPPER; \
	RET

// PVCOL widens 8 elements at off(AX) into t (by W) and adds their products
// with p[j] in Y15 into acc.
#define PVCOL(W, off, t, acc) \
	W(off(AX), t); \
	VFMADD231PS t, Y15, acc

// PVF16Sn are attnPVF16's steps, one VCVTPH2PS and FMA per 8 columns.
#define PVF16S1 \
	PVCOL(WF16, 0, Y8, Y0)

#define PVF16S2 \
	PVF16S1; \
	PVCOL(WF16, 16, Y9, Y1)

#define PVF16S4 \
	PVF16S2; \
	PVCOL(WF16, 32, Y10, Y2); \
	PVCOL(WF16, 48, Y11, Y3)

#define PVF16S6 \
	PVF16S4; \
	PVCOL(WF16, 64, Y12, Y4); \
	PVCOL(WF16, 80, Y13, Y5)

#define PVF16S8 \
	PVF16S6; \
	PVCOL(WF16, 96, Y8, Y6); \
	PVCOL(WF16, 112, Y9, Y7)

// PVBF16SETUP loads the mask bf16hi into Y14.
#define PVBF16SETUP \
	VMOVDQU bf16hi<>(SB), Y14

// PVBF16COLS widens the 16 bfloat16s at off(AX) into their even columns
// (te, a 16-bit left shift) and odd ones (to, the high halves masked), and
// adds their products with p[j] into acce and acco.
#define PVBF16COLS(off, te, to, acce, acco) \
	VPSLLD      $16, off(AX), te; \
	VPAND       off(AX), Y14, to; \
	VFMADD231PS te, Y15, acce; \
	VFMADD231PS to, Y15, acco

// PVBF16Sn are attnPVBF16's steps: runs of 16 columns or more by
// PVBF16COLS, a run of 8 by WBF16.
#define PVBF16S1 \
	PVCOL(WBF16, 0, Y8, Y0)

#define PVBF16S2 \
	PVBF16COLS(0, Y8, Y9, Y0, Y1)

#define PVBF16S4 \
	PVBF16S2; \
	PVBF16COLS(32, Y10, Y11, Y2, Y3)

#define PVBF16S6 \
	PVBF16S4; \
	PVBF16COLS(64, Y12, Y13, Y4, Y5)

#define PVBF16S8 \
	PVBF16S6; \
	PVBF16COLS(96, Y8, Y9, Y6, Y7)

// PVBF16ST interleaves the even columns ye and odd ones yo of 16 again and
// stores them at off(DI). Clobbers Y8..Y11.
#define PVBF16ST(ye, yo, off) \
	VUNPCKLPS  yo, ye, Y8; \
	VUNPCKHPS  yo, ye, Y9; \
	VPERM2F128 $0x20, Y9, Y8, Y10; \
	VPERM2F128 $0x31, Y9, Y8, Y11; \
	VMOVUPS    Y10, off(DI); \
	VMOVUPS    Y11, (off+32)(DI)

#define PVBF16ST2 \
	PVBF16ST(Y0, Y1, 0)

#define PVBF16ST4 \
	PVBF16ST2; \
	PVBF16ST(Y2, Y3, 64)

#define PVBF16ST6 \
	PVBF16ST4; \
	PVBF16ST(Y4, Y5, 128)

#define PVBF16ST8 \
	PVBF16ST6; \
	PVBF16ST(Y6, Y7, 192)

// func attnQKF16(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)
// For blocks b < nblk of 8 slots: scores[8b+l] = dot(q, K row
// slots[8b+l])·scale, the dot exactly as dot1x8F16 (and attnQK on the
// widened rows) computes it. AX counts bytes of K; q is read at 2·AX; R15
// is the bytes of a row's 8·n8 elements.
TEXT ·attnQKF16(SB), NOSPLIT, $32-60
	ATTNQK16(WF16, NOSETUP)

// func attnPVF16(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)
// out[c] = Σ_j p[j]·v[slots[j]·stride/2 + c] for c < 8·n8, each element
// widened exactly, one FMA per slot in slot order, starting from +0: what
// attnPV computes on the widened rows. stride is in bytes. Columns go in
// runs of 64, 48, 32, 16 and 8 as in attnPV (the run does not change a
// column's sum).
TEXT ·attnPVF16(SB), NOSPLIT, $0-56
	ATTNPV16(NOSETUP, PVF16S8, PVF16S6, PVF16S4, PVF16S2, PVF16S1, STACC8, STACC6, STACC4, STACC2)

// func attnQKBF16(scores, q *float32, k unsafe.Pointer, slots *int32, nblk, stride, n8 int, scale float32)
// attnQKF16 with dot1x8BF16's widening (WBF16S).
TEXT ·attnQKBF16(SB), NOSPLIT, $32-60
	ATTNQK16(WBF16S, QKSETBF16)

// func attnPVBF16(out, p *float32, v unsafe.Pointer, slots *int32, nslots, stride, n8 int)
// attnPVF16 over bfloat16 rows. Runs of 16 columns or more widen 32 bytes
// at a time into their even columns (a 16-bit left shift) and odd ones (the
// high halves masked), two accumulators per 16 columns, interleaved again
// at the store.
TEXT ·attnPVBF16(SB), NOSPLIT, $0-56
	ATTNPV16(PVBF16SETUP, PVBF16S8, PVBF16S6, PVBF16S4, PVBF16S2, PVBF16S1, PVBF16ST8, PVBF16ST6, PVBF16ST4, PVBF16ST2)
