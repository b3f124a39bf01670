package gguf

import (
	"encoding/binary"
	"fmt"
	"math"
)

// maxArrayDepth bounds how deeply metadata arrays may nest. Real files never
// nest at all (llama.cpp cannot read nested arrays); the bound exists so a
// hostile file cannot drive the decoder's recursion arbitrarily deep.
const maxArrayDepth = 8

// decoder reads little-endian GGUF primitives from a byte slice. Every read
// checks the remaining length first, and every count read from the file is
// checked against the remaining bytes before anything is allocated for it,
// so memory use stays proportional to the input size whatever the input
// says.
type decoder struct {
	buf []byte
	off int
}

func (d *decoder) remaining() int { return len(d.buf) - d.off }

// short reports a fixed-size field that does not fit in what is left.
func (d *decoder) short(what string, n int) error {
	return formatErr("truncated: %s at offset %d needs %d bytes, %d remain", what, d.off, n, d.remaining())
}

func (d *decoder) u8(what string) (uint8, error) {
	if d.remaining() < 1 {
		return 0, d.short(what, 1)
	}
	v := d.buf[d.off]
	d.off++
	return v, nil
}

func (d *decoder) u16(what string) (uint16, error) {
	if d.remaining() < 2 {
		return 0, d.short(what, 2)
	}
	v := binary.LittleEndian.Uint16(d.buf[d.off:])
	d.off += 2
	return v, nil
}

func (d *decoder) u32(what string) (uint32, error) {
	if d.remaining() < 4 {
		return 0, d.short(what, 4)
	}
	v := binary.LittleEndian.Uint32(d.buf[d.off:])
	d.off += 4
	return v, nil
}

func (d *decoder) u64(what string) (uint64, error) {
	if d.remaining() < 8 {
		return 0, d.short(what, 8)
	}
	v := binary.LittleEndian.Uint64(d.buf[d.off:])
	d.off += 8
	return v, nil
}

// str reads a length-prefixed string. The bytes are copied, so strings stay
// valid after the mapping they came from is unmapped. Content is not checked
// for UTF-8: tokenizer vocabularies in real files sometimes hold raw bytes.
func (d *decoder) str() (string, error) {
	at := d.off
	n, err := d.u64("string length")
	if err != nil {
		return "", err
	}
	if n > uint64(d.remaining()) {
		return "", formatErr("string length %d at offset %d exceeds remaining %d bytes", n, at, d.remaining())
	}
	s := string(d.buf[d.off : d.off+int(n)])
	d.off += int(n)
	return s, nil
}

func (d *decoder) boolean() (bool, error) {
	b, err := d.u8("BOOL value")
	if err != nil {
		return false, err
	}
	return checkBool(b, d.off-1)
}

// checkBool refuses bytes other than 0 and 1, so that every accepted file
// re-encodes to the same bytes and corruption is not silently read as true.
func checkBool(b byte, at int) (bool, error) {
	switch b {
	case 0:
		return false, nil
	case 1:
		return true, nil
	}
	return false, formatErr("invalid BOOL value %d at offset %d (want 0 or 1)", b, at)
}

// value reads one value of type t. depth is the number of arrays already
// open around it.
func (d *decoder) value(t ValueType, depth int) (any, error) {
	switch t {
	case ValueUint8:
		return d.u8("UINT8 value")
	case ValueInt8:
		v, err := d.u8("INT8 value")
		return int8(v), err
	case ValueUint16:
		return d.u16("UINT16 value")
	case ValueInt16:
		v, err := d.u16("INT16 value")
		return int16(v), err
	case ValueUint32:
		return d.u32("UINT32 value")
	case ValueInt32:
		v, err := d.u32("INT32 value")
		return int32(v), err
	case ValueFloat32:
		v, err := d.u32("FLOAT32 value")
		return math.Float32frombits(v), err
	case ValueBool:
		return d.boolean()
	case ValueString:
		return d.str()
	case ValueArray:
		return d.array(depth + 1)
	case ValueUint64:
		return d.u64("UINT64 value")
	case ValueInt64:
		v, err := d.u64("INT64 value")
		return int64(v), err
	case ValueFloat64:
		v, err := d.u64("FLOAT64 value")
		return math.Float64frombits(v), err
	}
	return nil, formatErr("unknown value type %d at offset %d", uint32(t), d.off-4)
}

// array reads an array body (element type, count, elements) as a typed Go
// slice; see KV for the mapping. depth counts this array.
func (d *decoder) array(depth int) (any, error) {
	if depth > maxArrayDepth {
		return nil, formatErr("arrays nested more than %d deep at offset %d", maxArrayDepth, d.off)
	}
	at := d.off
	et32, err := d.u32("array element type")
	if err != nil {
		return nil, err
	}
	et := ValueType(et32)
	n, err := d.u64("array length")
	if err != nil {
		return nil, err
	}
	minSize := et.minSize()
	if minSize == 0 {
		return nil, formatErr("unknown array element type %d at offset %d", et32, at)
	}
	if n > uint64(d.remaining()/minSize) {
		return nil, formatErr("array of %d %s at offset %d exceeds remaining %d bytes", n, et, at, d.remaining())
	}
	count := int(n)

	if size := et.fixedSize(); size != 0 {
		// Fixed-size elements: the whole body is in range, checked above.
		start := d.off
		d.off += count * size
		return fixedArray(et, d.buf[start:d.off], count, start)
	}

	switch et {
	case ValueString:
		out := make([]string, count)
		for i := range out {
			if out[i], err = d.str(); err != nil {
				return nil, withContext(err, "element %d", i)
			}
		}
		return out, nil
	default: // ValueArray
		out := make([]any, count)
		for i := range out {
			if out[i], err = d.array(depth + 1); err != nil {
				return nil, withContext(err, "element %d", i)
			}
		}
		return out, nil
	}
}

// fixedArray decodes count elements of the fixed-size type et from b, which
// starts at file offset at.
func fixedArray(et ValueType, b []byte, count, at int) (any, error) {
	le := binary.LittleEndian
	switch et {
	case ValueUint8:
		out := make([]uint8, count)
		copy(out, b)
		return out, nil
	case ValueInt8:
		out := make([]int8, count)
		for i := range out {
			out[i] = int8(b[i])
		}
		return out, nil
	case ValueBool:
		out := make([]bool, count)
		for i := range out {
			v, err := checkBool(b[i], at+i)
			if err != nil {
				return nil, withContext(err, "element %d", i)
			}
			out[i] = v
		}
		return out, nil
	case ValueUint16:
		out := make([]uint16, count)
		for i := range out {
			out[i] = le.Uint16(b[2*i:])
		}
		return out, nil
	case ValueInt16:
		out := make([]int16, count)
		for i := range out {
			out[i] = int16(le.Uint16(b[2*i:]))
		}
		return out, nil
	case ValueUint32:
		out := make([]uint32, count)
		for i := range out {
			out[i] = le.Uint32(b[4*i:])
		}
		return out, nil
	case ValueInt32:
		out := make([]int32, count)
		for i := range out {
			out[i] = int32(le.Uint32(b[4*i:]))
		}
		return out, nil
	case ValueFloat32:
		out := make([]float32, count)
		for i := range out {
			out[i] = math.Float32frombits(le.Uint32(b[4*i:]))
		}
		return out, nil
	case ValueUint64:
		out := make([]uint64, count)
		for i := range out {
			out[i] = le.Uint64(b[8*i:])
		}
		return out, nil
	case ValueInt64:
		out := make([]int64, count)
		for i := range out {
			out[i] = int64(le.Uint64(b[8*i:]))
		}
		return out, nil
	case ValueFloat64:
		out := make([]float64, count)
		for i := range out {
			out[i] = math.Float64frombits(le.Uint64(b[8*i:]))
		}
		return out, nil
	}
	// Unreachable: every fixed-size type is handled above.
	return nil, fmt.Errorf("gguf: internal error: no decoder for %v", et)
}
