package gguf

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
)

// Type is a ggml tensor storage type, as recorded in a GGUF tensor info.
type Type uint32

// The ggml tensor types. Numbers are fixed by the format; gaps are types
// that ggml has removed and that no current file contains.
const (
	TypeF32     Type = 0
	TypeF16     Type = 1
	TypeQ4_0    Type = 2
	TypeQ4_1    Type = 3
	TypeQ5_0    Type = 6
	TypeQ5_1    Type = 7
	TypeQ8_0    Type = 8
	TypeQ8_1    Type = 9
	TypeQ2_K    Type = 10
	TypeQ3_K    Type = 11
	TypeQ4_K    Type = 12
	TypeQ5_K    Type = 13
	TypeQ6_K    Type = 14
	TypeQ8_K    Type = 15
	TypeIQ2_XXS Type = 16
	TypeIQ2_XS  Type = 17
	TypeIQ3_XXS Type = 18
	TypeIQ1_S   Type = 19
	TypeIQ4_NL  Type = 20
	TypeIQ3_S   Type = 21
	TypeIQ2_S   Type = 22
	TypeIQ4_XS  Type = 23
	TypeI8      Type = 24
	TypeI16     Type = 25
	TypeI32     Type = 26
	TypeI64     Type = 27
	TypeF64     Type = 28
	TypeIQ1_M   Type = 29
	TypeBF16    Type = 30
	TypeTQ1_0   Type = 34
	TypeTQ2_0   Type = 35
	TypeMXFP4   Type = 39
)

// typeTraits is the name and block geometry of one tensor type.
type typeTraits struct {
	name      string
	blockSize int // elements per block
	typeSize  int // bytes per block
}

// typeTable lists every type this package can size. The i-quant, ternary
// and MXFP4 types are beyond what the engine runs, but knowing their sizes
// lets a tool open (and report on) any current llama.cpp file instead of
// refusing it as corrupt.
var typeTable = map[Type]typeTraits{
	TypeF32:     {"F32", 1, 4},
	TypeF16:     {"F16", 1, 2},
	TypeQ4_0:    {"Q4_0", 32, 18},
	TypeQ4_1:    {"Q4_1", 32, 20},
	TypeQ5_0:    {"Q5_0", 32, 22},
	TypeQ5_1:    {"Q5_1", 32, 24},
	TypeQ8_0:    {"Q8_0", 32, 34},
	TypeQ8_1:    {"Q8_1", 32, 36},
	TypeQ2_K:    {"Q2_K", 256, 84},
	TypeQ3_K:    {"Q3_K", 256, 110},
	TypeQ4_K:    {"Q4_K", 256, 144},
	TypeQ5_K:    {"Q5_K", 256, 176},
	TypeQ6_K:    {"Q6_K", 256, 210},
	TypeQ8_K:    {"Q8_K", 256, 292},
	TypeIQ2_XXS: {"IQ2_XXS", 256, 66},
	TypeIQ2_XS:  {"IQ2_XS", 256, 74},
	TypeIQ3_XXS: {"IQ3_XXS", 256, 98},
	TypeIQ1_S:   {"IQ1_S", 256, 50},
	TypeIQ4_NL:  {"IQ4_NL", 32, 18},
	TypeIQ3_S:   {"IQ3_S", 256, 110},
	TypeIQ2_S:   {"IQ2_S", 256, 82},
	TypeIQ4_XS:  {"IQ4_XS", 256, 136},
	TypeI8:      {"I8", 1, 1},
	TypeI16:     {"I16", 1, 2},
	TypeI32:     {"I32", 1, 4},
	TypeI64:     {"I64", 1, 8},
	TypeF64:     {"F64", 1, 8},
	TypeIQ1_M:   {"IQ1_M", 256, 56},
	TypeBF16:    {"BF16", 1, 2},
	TypeTQ1_0:   {"TQ1_0", 256, 54},
	TypeTQ2_0:   {"TQ2_0", 256, 66},
	TypeMXFP4:   {"MXFP4", 32, 17},
}

// String returns the ggml name of t ("F32", "Q8_0", ...), or "type(N)" for a
// type this package does not know, so error messages stay readable.
func (t Type) String() string {
	if tr, ok := typeTable[t]; ok {
		return tr.name
	}
	return fmt.Sprintf("type(%d)", uint32(t))
}

// BlockSize returns the number of elements per block, or 0 if t is unknown.
func (t Type) BlockSize() int { return typeTable[t].blockSize }

// TypeSize returns the number of bytes per block, or 0 if t is unknown.
func (t Type) TypeSize() int { return typeTable[t].typeSize }

// Known reports whether this package knows the block geometry of t.
func (t Type) Known() bool {
	_, ok := typeTable[t]
	return ok
}

// RowBytes returns the number of bytes one row of ne0 elements of type t
// takes. ne0 must be a non-negative multiple of the block size, because ggml
// never splits a block across rows.
func RowBytes(t Type, ne0 int) (int, error) {
	tr, ok := typeTable[t]
	if !ok {
		return 0, fmt.Errorf("gguf: unknown tensor type %v", t)
	}
	if ne0 < 0 {
		return 0, fmt.Errorf("gguf: negative row length %d", ne0)
	}
	if ne0%tr.blockSize != 0 {
		return 0, fmt.Errorf("gguf: row length %d is not a multiple of the %s block size %d", ne0, tr.name, tr.blockSize)
	}
	blocks := ne0 / tr.blockSize
	if blocks > math.MaxInt/tr.typeSize {
		return 0, fmt.Errorf("gguf: row of %d %s elements overflows int", ne0, tr.name)
	}
	return blocks * tr.typeSize, nil
}

// MaxDims is the largest number of dimensions a GGUF tensor may have.
const MaxDims = 4

// TensorBytes returns the byte size of a tensor of type t and the given shape
// (fastest-varying dimension first), checking everything a file or a caller
// could get wrong: a known type, 1..MaxDims non-zero dimensions, a row length
// that is a multiple of the block size, and no overflow. Element counts and
// byte sizes are limited to math.MaxInt64, the limit ggml itself uses.
func TensorBytes(t Type, shape []uint64) (uint64, error) {
	size, problem := tensorBytes(t, shape)
	if problem != "" {
		return 0, errors.New("gguf: " + problem)
	}
	return size, nil
}

// tensorBytes is TensorBytes with the problem returned as a bare phrase, so
// the reader and the writer can put their own context in front of it.
func tensorBytes(t Type, shape []uint64) (uint64, string) {
	tr, ok := typeTable[t]
	if !ok {
		return 0, fmt.Sprintf("unknown ggml type %d", uint32(t))
	}
	if len(shape) == 0 || len(shape) > MaxDims {
		return 0, fmt.Sprintf("%d dimensions (want 1..%d)", len(shape), MaxDims)
	}
	// Zero-sized dimensions are refused: no real model has one, and allowing
	// them would make every consumer guard against division by zero.
	elems := uint64(1)
	for i, ne := range shape {
		if ne == 0 {
			return 0, fmt.Sprintf("dimension %d is zero (shape %v)", i, shape)
		}
		hi, lo := bits.Mul64(elems, ne)
		if hi != 0 || lo > math.MaxInt64 {
			return 0, fmt.Sprintf("shape %v has more than 2^63-1 elements", shape)
		}
		elems = lo
	}
	bs := uint64(tr.blockSize)
	if shape[0]%bs != 0 {
		return 0, fmt.Sprintf("row length %d is not a multiple of the %s block size %d", shape[0], tr.name, bs)
	}
	// elems/bs blocks of typeSize bytes; elems is a multiple of bs because
	// shape[0] is.
	hi, size := bits.Mul64(elems/bs, uint64(tr.typeSize))
	if hi != 0 || size > math.MaxInt64 {
		return 0, fmt.Sprintf("shape %v of type %s is more than 2^63-1 bytes", shape, tr.name)
	}
	return size, ""
}

// ValueType is the type tag of a metadata value.
type ValueType uint32

// The metadata value types. Numbers are fixed by the format.
const (
	ValueUint8   ValueType = 0
	ValueInt8    ValueType = 1
	ValueUint16  ValueType = 2
	ValueInt16   ValueType = 3
	ValueUint32  ValueType = 4
	ValueInt32   ValueType = 5
	ValueFloat32 ValueType = 6
	ValueBool    ValueType = 7
	ValueString  ValueType = 8
	ValueArray   ValueType = 9
	ValueUint64  ValueType = 10
	ValueInt64   ValueType = 11
	ValueFloat64 ValueType = 12
)

var valueTypeNames = [...]string{
	ValueUint8:   "UINT8",
	ValueInt8:    "INT8",
	ValueUint16:  "UINT16",
	ValueInt16:   "INT16",
	ValueUint32:  "UINT32",
	ValueInt32:   "INT32",
	ValueFloat32: "FLOAT32",
	ValueBool:    "BOOL",
	ValueString:  "STRING",
	ValueArray:   "ARRAY",
	ValueUint64:  "UINT64",
	ValueInt64:   "INT64",
	ValueFloat64: "FLOAT64",
}

// String returns the GGUF name of v ("UINT32", "STRING", ...), or
// "valuetype(N)" for an unknown tag.
func (v ValueType) String() string {
	if int(v) < len(valueTypeNames) {
		return valueTypeNames[v]
	}
	return fmt.Sprintf("valuetype(%d)", uint32(v))
}

// fixedSize is the encoded size of a scalar of type v, or 0 for the
// variable-length STRING and ARRAY and for unknown tags.
func (v ValueType) fixedSize() int {
	switch v {
	case ValueUint8, ValueInt8, ValueBool:
		return 1
	case ValueUint16, ValueInt16:
		return 2
	case ValueUint32, ValueInt32, ValueFloat32:
		return 4
	case ValueUint64, ValueInt64, ValueFloat64:
		return 8
	}
	return 0
}

// minSize is the fewest bytes one encoded value of type v can take; the
// reader bounds element counts with it before allocating.
func (v ValueType) minSize() int {
	switch v {
	case ValueString:
		return 8 // length only
	case ValueArray:
		return 4 + 8 // element type and count
	}
	return v.fixedSize()
}
