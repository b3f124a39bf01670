// Package kernels is the narrow set of numeric operations the engine runs a
// model with. A backend implements Backend: the plain-Go reference in
// kernels/ref and the fast CPU path in kernels/cpu, both checked against the
// reference by one conformance suite (kernels/kerneltest, run by their
// tests). kernels/cuda is only the seam of a CUDA backend: it has no kernels
// yet, its New always reports kernels.ErrUnavailable, and the conformance
// suite does not run it; a CUDA backend must pass kerneltest.Run on a GPU
// machine before it is used.
//
// The interface is deliberately small: a wide tensor interface is expensive to
// keep correct on several backends, and the model needs only these ops.
//
// Batch invariance: a backend must compute every output row with the same
// arithmetic, in the same order, whatever the other rows of the call are
// (how many, which values). Greedy decoding of one prompt then gives the same
// tokens alone and inside any batch, which is what makes corruption by a
// neighbour detectable.
package kernels

import (
	"errors"
	"fmt"
	"unsafe"
)

// ErrUnavailable is returned when a backend cannot run on this build or machine.
var ErrUnavailable = errors.New("kernels: backend unavailable")

// DType is the storage type of a weight matrix (the GGUF tensor types the
// engine accepts).
type DType uint8

const (
	F32  DType = iota // little-endian float32
	F16               // IEEE half
	BF16              // bfloat16
	Q8_0              // blocks of 32: fp16 scale, then 32 int8
)

func (d DType) String() string {
	switch d {
	case F32:
		return "F32"
	case F16:
		return "F16"
	case BF16:
		return "BF16"
	case Q8_0:
		return "Q8_0"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Q8Block is the number of weights that share one scale in Q8_0.
const Q8Block = 32

// q8BlockBytes is the size of one Q8_0 block: fp16 scale then 32 int8.
const q8BlockBytes = 2 + Q8Block

// RowBytes is the number of bytes one row of cols elements takes in dtype d.
func RowBytes(d DType, cols int) (int, error) {
	switch d {
	case F32:
		return 4 * cols, nil
	case F16, BF16:
		return 2 * cols, nil
	case Q8_0:
		if cols%Q8Block != 0 {
			return 0, fmt.Errorf("kernels: Q8_0 row length %d is not a multiple of %d", cols, Q8Block)
		}
		return cols / Q8Block * q8BlockBytes, nil
	}
	return 0, fmt.Errorf("kernels: unsupported dtype %v", d)
}

// Matrix is a weight matrix of Rows output rows, each a vector of Cols inputs,
// stored row-major in its on-disk encoding (GGUF ne0 = Cols, ne1 = Rows). Data
// usually points into a memory-mapped file and must not be written.
type Matrix struct {
	DType      DType
	Rows, Cols int
	Data       []byte
	rowBytes   int
}

// NewMatrix checks that data holds exactly rows×cols elements of dtype d.
func NewMatrix(d DType, rows, cols int, data []byte) (*Matrix, error) {
	if rows <= 0 || cols <= 0 {
		return nil, fmt.Errorf("kernels: matrix shape %dx%d", rows, cols)
	}
	rb, err := RowBytes(d, cols)
	if err != nil {
		return nil, err
	}
	if len(data) != rb*rows {
		return nil, fmt.Errorf("kernels: %v matrix %dx%d needs %d bytes, have %d", d, rows, cols, rb*rows, len(data))
	}
	if d == F32 && uintptr(unsafe.Pointer(unsafe.SliceData(data)))%4 != 0 {
		return nil, fmt.Errorf("kernels: F32 matrix data is not 4-byte aligned")
	}
	return &Matrix{DType: d, Rows: rows, Cols: cols, Data: data, rowBytes: rb}, nil
}

// RowBytes is the size in bytes of one row.
func (m *Matrix) RowBytes() int { return m.rowBytes }

// Row returns the raw bytes of row r.
func (m *Matrix) Row(r int) []byte { return m.Data[r*m.rowBytes : (r+1)*m.rowBytes] }

// F32 views the data of an F32 matrix as float32s (no copy).
func (m *Matrix) F32() []float32 {
	if m.DType != F32 {
		panic("kernels: F32 view of a " + m.DType.String() + " matrix")
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(m.Data))), len(m.Data)/4)
}

// F32Bytes views float32s as bytes (no copy), e.g. to build an F32 Matrix.
func F32Bytes(f []float32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 4*len(f))
}

// IndexKDType is the storage precision of the sparse indexer's keys.
type IndexKDType uint8

const (
	IndexFP8  IndexKDType = iota // e4m3 bytes + one fp32 scale per token
	IndexBF16                    // bfloat16
)

func (d IndexKDType) String() string {
	switch d {
	case IndexFP8:
		return "fp8"
	case IndexBF16:
		return "bf16"
	}
	return fmt.Sprintf("IndexKDType(%d)", uint8(d))
}

// ParseIndexKDType reads "fp8" or "bf16".
func ParseIndexKDType(s string) (IndexKDType, error) {
	switch s {
	case "fp8":
		return IndexFP8, nil
	case "bf16":
		return IndexBF16, nil
	}
	return 0, fmt.Errorf("index-K dtype %q: want fp8 or bf16", s)
}

// KVTypes are the element types a KV pool may store, by their flag names.
var KVTypes = map[string]DType{"f32": F32, "bf16": BF16, "f16": F16}

// ParseKVType reads a KV element type by its flag name (f32, bf16, f16).
func ParseKVType(s string) (DType, error) {
	if d, ok := KVTypes[s]; ok {
		return d, nil
	}
	return 0, fmt.Errorf("kernels: unknown KV dtype %q (want f32, bf16 or f16)", s)
}

// KVName is the flag name of a KV element type: f32, bf16 or f16.
func KVName(d DType) string {
	for n, t := range KVTypes {
		if t == d {
			return n
		}
	}
	return d.String()
}

// KVElemBytes is the size of one stored KV element of type d: 4 for F32, 2
// for F16 and BF16, 0 for a type a pool cannot store.
func KVElemBytes(d DType) int {
	switch d {
	case F32:
		return 4
	case F16, BF16:
		return 2
	}
	return 0
}

// EncodeKV rounds src to nearest even in the 16-bit type d (F16 or BF16)
// into dst, as a 16-bit pool stores a K or V row.
func EncodeKV(dst []uint16, src []float32, d DType) {
	dst = dst[:len(src)]
	switch d {
	case BF16:
		for i, v := range src {
			dst[i] = F32ToBF16(v)
		}
	case F16:
		for i, v := range src {
			dst[i] = F32ToF16(v)
		}
	default:
		panic(fmt.Sprintf("kernels: EncodeKV to %v", d))
	}
}

// DecodeKV widens the 16-bit elements of src (type d) into dst, exactly.
func DecodeKV(dst []float32, src []uint16, d DType) {
	dst = dst[:len(src)]
	switch d {
	case BF16:
		for i, h := range src {
			dst[i] = BF16ToF32(h)
		}
	case F16:
		for i, h := range src {
			dst[i] = F16ToF32(h)
		}
	default:
		panic(fmt.Sprintf("kernels: DecodeKV from %v", d))
	}
}

// IndexKeys is one layer's index-K buffer: one key of Dim elements per KV
// slot, stored in FP8 (with Scales) or BF16, as the indexer reads it.
type IndexKeys struct {
	DType  IndexKDType
	Dim    int
	FP8    []uint8   // [slot*Dim], e4m3, when DType == IndexFP8
	Scales []float32 // [slot], when DType == IndexFP8
	BF16   []uint16  // [slot*Dim], when DType == IndexBF16
}

// AttentionArgs describes attention of a batch of query tokens over KV rows
// gathered from a paged pool.
type AttentionArgs struct {
	Out  []float32 // [token][NHeads*HeadDim]
	Q    []float32 // [token][NHeads*HeadDim]
	K, V []float32 // one layer of an F32 pool: [slot][NKVHeads*HeadDim]
	// K16 and V16 are one layer of a 16-bit pool, laid out as K and V, when
	// KVType is F16 or BF16; K and V are then unused.
	K16, V16 []uint16
	KVType   DType     // the pool's element type: F32 (the zero value), F16 or BF16
	Slots    [][]int32 // Slots[t]: the slots token t attends to, in position order
	// NHeads must be a multiple of NKVHeads (grouped-query attention).
	NHeads, NKVHeads, HeadDim int
	Scale                     float32 // usually 1/sqrt(HeadDim)
}

// IndexScoreArgs describes the sparse indexer's scoring of candidate tokens:
// score(t, s) = Σ_h W[t][h] · ReLU(Q[t][h] · key(s)).
type IndexScoreArgs struct {
	Out    [][]float32 // Out[t][i]: score of Slots[t][i]; len(Out[t]) == len(Slots[t])
	Q      []float32   // [token][NHeads*Keys.Dim]
	W      []float32   // [token][NHeads], per-head weights
	Keys   *IndexKeys
	Slots  [][]int32
	NHeads int
}

// Backend is the set of operations a model forward pass needs. Slices are
// row-major; dst never aliases an input unless the method says so.
type Backend interface {
	Name() string
	// MatMul computes dst[i][r] = Σ_c x[i][c]·W[r][c] for i < m: dst is
	// m×w.Rows, x is m×w.Cols.
	MatMul(dst, x []float32, w *Matrix, m int)
	// RMSNorm normalises each of rows rows of x: dst = x / rms(x) · weight.
	RMSNorm(dst, x, weight []float32, rows int, eps float32)
	// RoPE rotates, in place, the first ropeDim elements of every head of
	// every token in x ([token][nHeads*headDim]) by its position, pairing
	// adjacent elements (2i, 2i+1) with frequency theta^(-2i/ropeDim) (the
	// GGUF/ggml "normal" layout used by llama).
	RoPE(x []float32, pos []int32, nHeads, headDim, ropeDim int, theta float32)
	// SwiGLU computes dst = silu(gate) · up elementwise.
	SwiGLU(dst, gate, up []float32)
	// Softmax normalises each of rows rows of cols in place.
	Softmax(x []float32, rows, cols int)
	Attention(a *AttentionArgs)
	IndexScore(a *IndexScoreArgs)
	// TopK writes into dst[:k] the indices of the k largest scores, in
	// ascending index order, and returns dst[:k]. Ties go to the lower index;
	// NaN ranks below every number. k > len(scores) selects all.
	TopK(dst []int32, scores []float32, k int) []int32
	// QuantizeFP8 stores src as e4m3 with one scale (amax/448) and returns it.
	QuantizeFP8(dst []uint8, src []float32) (scale float32)
	DequantizeFP8(dst []float32, src []uint8, scale float32)
	ToBF16(dst []uint16, src []float32)
	FromBF16(dst []float32, src []uint16)
}
