package gguf

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
)

// Writer builds a GGUF v3 file. Metadata and tensors are written in the
// order they were added. The zero value is not usable; call NewWriter.
// A Writer is not safe for concurrent use.
type Writer struct {
	kvs         []KV
	kvIndex     map[string]int
	tensors     []writerTensor
	tensorIndex map[string]struct{}
	align       uint64
	err         error // first invalid alignment setting, reported by WriteTo
}

type writerTensor struct {
	info TensorInfo
	data []byte
}

// NewWriter returns an empty Writer with the default alignment.
func NewWriter() *Writer {
	return &Writer{
		kvIndex:     make(map[string]int),
		tensorIndex: make(map[string]struct{}),
		align:       DefaultAlignment,
	}
}

// SetAlignment sets the data alignment. A value other than DefaultAlignment
// is recorded as the general.alignment key (at its current place if already
// set, else appended); setting DefaultAlignment removes the key so default
// files carry no redundant metadata. n must be a power of two that fits in
// a uint32; otherwise WriteTo reports an error.
func (w *Writer) SetAlignment(n int) {
	if n <= 0 || uint64(n) > math.MaxUint32 || n&(n-1) != 0 {
		w.setErr(fmt.Errorf("gguf: alignment %d is not a power of two in 1..2^31", n))
		return
	}
	w.align = uint64(n)
	if n != DefaultAlignment {
		w.set(KeyAlignment, ValueUint32, uint32(n))
		return
	}
	if i, ok := w.kvIndex[KeyAlignment]; ok {
		w.kvs = append(w.kvs[:i], w.kvs[i+1:]...)
		delete(w.kvIndex, KeyAlignment)
		for j := i; j < len(w.kvs); j++ {
			w.kvIndex[w.kvs[j].Key] = j
		}
	}
}

func (w *Writer) setErr(err error) {
	if w.err == nil {
		w.err = err
	}
}

// Add sets metadata key to value, replacing (in place) any earlier value of
// the key. The GGUF type is inferred from the Go type: string, bool, uint8,
// int8, uint16, int16, uint32, int32, uint64, int64, float32, float64, a
// slice of any of those, or an []any of such slices for a nested array (see
// KV). Slices are copied. Plain int is refused because its GGUF width would
// be a guess; convert to the width the key is specified with.
//
// Adding general.alignment is the same as SetAlignment, except that the key
// is kept even for the default; its value must be a uint32.
//
// Add panics if value has an unsupported Go type (or an []any nested more
// than 8 deep): that is a programming error, not a data error.
func (w *Writer) Add(key string, value any) {
	v, vt, err := normalize(value, 0)
	if err != nil {
		panic(fmt.Sprintf("gguf: Writer.Add(%q): %v", key, err))
	}
	if key == KeyAlignment {
		a, ok := v.(uint32)
		if !ok || a == 0 || a&(a-1) != 0 {
			w.setErr(fmt.Errorf("gguf: %s must be a uint32 power of two, got %T %v", KeyAlignment, value, value))
			return
		}
		w.align = uint64(a)
	}
	w.set(key, vt, v)
}

func (w *Writer) set(key string, vt ValueType, v any) {
	if i, ok := w.kvIndex[key]; ok {
		w.kvs[i] = KV{Key: key, Type: vt, Value: v}
		return
	}
	w.kvIndex[key] = len(w.kvs)
	w.kvs = append(w.kvs, KV{Key: key, Type: vt, Value: v})
}

// typeOf classifies a metadata value: its type tag and, for arrays, the
// element type. It does not look inside []any.
func typeOf(v any) (vt, elem ValueType, ok bool) {
	switch v.(type) {
	case uint8:
		return ValueUint8, 0, true
	case int8:
		return ValueInt8, 0, true
	case uint16:
		return ValueUint16, 0, true
	case int16:
		return ValueInt16, 0, true
	case uint32:
		return ValueUint32, 0, true
	case int32:
		return ValueInt32, 0, true
	case float32:
		return ValueFloat32, 0, true
	case bool:
		return ValueBool, 0, true
	case string:
		return ValueString, 0, true
	case uint64:
		return ValueUint64, 0, true
	case int64:
		return ValueInt64, 0, true
	case float64:
		return ValueFloat64, 0, true
	case []uint8:
		return ValueArray, ValueUint8, true
	case []int8:
		return ValueArray, ValueInt8, true
	case []uint16:
		return ValueArray, ValueUint16, true
	case []int16:
		return ValueArray, ValueInt16, true
	case []uint32:
		return ValueArray, ValueUint32, true
	case []int32:
		return ValueArray, ValueInt32, true
	case []float32:
		return ValueArray, ValueFloat32, true
	case []bool:
		return ValueArray, ValueBool, true
	case []string:
		return ValueArray, ValueString, true
	case []uint64:
		return ValueArray, ValueUint64, true
	case []int64:
		return ValueArray, ValueInt64, true
	case []float64:
		return ValueArray, ValueFloat64, true
	case []any:
		return ValueArray, ValueArray, true
	}
	return 0, 0, false
}

// normalize checks that v is encodable and returns a private copy of it
// (so later changes to the caller's slices do not change the file) with its
// type tag. depth is the number of arrays around v.
func normalize(v any, depth int) (any, ValueType, error) {
	vt, et, ok := typeOf(v)
	if !ok {
		return nil, 0, fmt.Errorf("unsupported value type %T", v)
	}
	if vt != ValueArray {
		return v, vt, nil
	}
	if depth+1 > maxArrayDepth {
		return nil, 0, fmt.Errorf("arrays nested more than %d deep", maxArrayDepth)
	}
	if et == ValueArray {
		in := v.([]any)
		out := make([]any, len(in))
		for i, e := range in {
			c, t, err := normalize(e, depth+1)
			if err != nil {
				return nil, 0, fmt.Errorf("element %d: %w", i, err)
			}
			if t != ValueArray {
				return nil, 0, fmt.Errorf("element %d: nested array element must be a slice, got %T", i, e)
			}
			out[i] = c
		}
		return out, ValueArray, nil
	}
	return cloneSlice(v), ValueArray, nil
}

func cloneSlice(v any) any {
	switch x := v.(type) {
	case []uint8:
		return append([]uint8{}, x...)
	case []int8:
		return append([]int8{}, x...)
	case []uint16:
		return append([]uint16{}, x...)
	case []int16:
		return append([]int16{}, x...)
	case []uint32:
		return append([]uint32{}, x...)
	case []int32:
		return append([]int32{}, x...)
	case []float32:
		return append([]float32{}, x...)
	case []bool:
		return append([]bool{}, x...)
	case []string:
		return append([]string{}, x...)
	case []uint64:
		return append([]uint64{}, x...)
	case []int64:
		return append([]int64{}, x...)
	case []float64:
		return append([]float64{}, x...)
	}
	return v
}

// AddTensor appends a tensor. shape is fastest-varying first; data must be
// exactly the size the type and shape call for. data is not copied: the
// Writer holds it until WriteTo, so generators need not keep two copies of
// the weights, and the caller must not change it meanwhile. A duplicate name
// or an invalid type, shape or size is an error and adds nothing.
func (w *Writer) AddTensor(name string, typ Type, shape []uint64, data []byte) error {
	if _, dup := w.tensorIndex[name]; dup {
		return fmt.Errorf("gguf: duplicate tensor %q", name)
	}
	size, problem := tensorBytes(typ, shape)
	if problem != "" {
		return fmt.Errorf("gguf: tensor %q: %s", name, problem)
	}
	if uint64(len(data)) != size {
		return fmt.Errorf("gguf: tensor %q: data is %d bytes, %s %v needs %d", name, len(data), typ, shape, size)
	}
	w.tensorIndex[name] = struct{}{}
	w.tensors = append(w.tensors, writerTensor{
		info: TensorInfo{Name: name, Type: typ, Shape: append([]uint64{}, shape...), Size: size},
		data: data,
	})
	return nil
}

// WriteTo writes the file to out and returns the number of bytes out
// accepted. Tensor offsets are assigned in insertion order, each aligned,
// and every tensor's data is followed by padding to the alignment, the
// layout llama.cpp writes.
func (w *Writer) WriteTo(out io.Writer) (int64, error) {
	if w.err != nil {
		return 0, w.err
	}
	cw := &countingWriter{w: out}
	e := &encoder{w: bufio.NewWriterSize(cw, 1<<20)}

	e.raw([]byte(Magic))
	e.u32(Version)
	e.u64(uint64(len(w.tensors)))
	e.u64(uint64(len(w.kvs)))
	for _, kv := range w.kvs {
		e.str(kv.Key)
		e.u32(uint32(kv.Type))
		e.value(kv.Value)
	}
	var off uint64
	for i := range w.tensors {
		t := &w.tensors[i].info
		t.Offset = off
		e.str(t.Name)
		e.u32(uint32(len(t.Shape)))
		for _, ne := range t.Shape {
			e.u64(ne)
		}
		e.u32(uint32(t.Type))
		e.u64(off)
		off += alignUp(t.Size, w.align)
	}
	e.pad(w.align)
	for _, t := range w.tensors {
		e.raw(t.data)
		e.pad(w.align)
	}
	if e.err == nil {
		e.err = e.w.Flush()
	}
	if e.err != nil {
		return cw.n, fmt.Errorf("gguf: write: %w", e.err)
	}
	return cw.n, nil
}

func alignUp(n, align uint64) uint64 { return (n + align - 1) &^ (align - 1) }

// WriteFile writes the file to path atomically: it writes path+".tmp",
// syncs it and renames it over path, so a reader (or a crash) never sees a
// partial file and an mmap of the old file is never rewritten under it.
func (w *Writer) WriteFile(path string) (err error) {
	tmp := path + ".tmp"
	fh, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("gguf: %w", err)
	}
	defer func() {
		if err != nil {
			_ = fh.Close()
			_ = os.Remove(tmp)
		}
	}()
	if _, err = w.WriteTo(fh); err != nil {
		return err
	}
	if err = fh.Sync(); err != nil {
		return fmt.Errorf("gguf: %w", err)
	}
	if err = fh.Close(); err != nil {
		return fmt.Errorf("gguf: %w", err)
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("gguf: %w", err)
	}
	// Make the rename itself durable. Not every platform can sync a
	// directory, and the file is complete either way, so failure here is
	// not reported.
	if dir, derr := os.Open(filepath.Dir(path)); derr == nil {
		_ = dir.Sync()
		_ = dir.Close()
	}
	return nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// encoder writes little-endian GGUF primitives. The first error sticks and
// later writes are skipped, so the layout code needs no error plumbing.
type encoder struct {
	w       *bufio.Writer
	n       uint64 // bytes emitted, for padding
	err     error
	scratch [8]byte
}

func (e *encoder) raw(b []byte) {
	if e.err != nil {
		return
	}
	m, err := e.w.Write(b)
	e.n += uint64(m)
	e.err = err
}

func (e *encoder) u8(v uint8) {
	e.scratch[0] = v
	e.raw(e.scratch[:1])
}

func (e *encoder) u16(v uint16) {
	e.scratch[0], e.scratch[1] = byte(v), byte(v>>8)
	e.raw(e.scratch[:2])
}

func (e *encoder) u32(v uint32) {
	for i := range 4 {
		e.scratch[i] = byte(v >> (8 * i))
	}
	e.raw(e.scratch[:4])
}

func (e *encoder) u64(v uint64) {
	for i := range 8 {
		e.scratch[i] = byte(v >> (8 * i))
	}
	e.raw(e.scratch[:8])
}

func (e *encoder) str(s string) {
	e.u64(uint64(len(s)))
	if e.err != nil {
		return
	}
	m, err := e.w.WriteString(s)
	e.n += uint64(m)
	e.err = err
}

func (e *encoder) boolean(b bool) {
	if b {
		e.u8(1)
	} else {
		e.u8(0)
	}
}

var zeros [4096]byte

func (e *encoder) pad(align uint64) {
	for p := alignUp(e.n, align) - e.n; p > 0 && e.err == nil; {
		k := min(p, uint64(len(zeros)))
		e.raw(zeros[:k])
		p -= k
	}
}

// value writes v, which normalize has accepted. Arrays are written as
// element type, count, elements.
func (e *encoder) value(v any) {
	switch x := v.(type) {
	case uint8:
		e.u8(x)
	case int8:
		e.u8(uint8(x))
	case uint16:
		e.u16(x)
	case int16:
		e.u16(uint16(x))
	case uint32:
		e.u32(x)
	case int32:
		e.u32(uint32(x))
	case float32:
		e.u32(math.Float32bits(x))
	case bool:
		e.boolean(x)
	case string:
		e.str(x)
	case uint64:
		e.u64(x)
	case int64:
		e.u64(uint64(x))
	case float64:
		e.u64(math.Float64bits(x))
	default:
		e.array(v)
	}
}

func (e *encoder) array(v any) {
	_, et, ok := typeOf(v)
	if !ok {
		// normalize admits only encodable values; reaching this is a bug.
		e.err = errors.New("internal error: unencodable metadata value")
		return
	}
	e.u32(uint32(et))
	switch x := v.(type) {
	case []uint8:
		e.u64(uint64(len(x)))
		e.raw(x)
	case []int8:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u8(uint8(el))
		}
	case []uint16:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u16(el)
		}
	case []int16:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u16(uint16(el))
		}
	case []uint32:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u32(el)
		}
	case []int32:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u32(uint32(el))
		}
	case []float32:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u32(math.Float32bits(el))
		}
	case []bool:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.boolean(el)
		}
	case []string:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.str(el)
		}
	case []uint64:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u64(el)
		}
	case []int64:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u64(uint64(el))
		}
	case []float64:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.u64(math.Float64bits(el))
		}
	case []any:
		e.u64(uint64(len(x)))
		for _, el := range x {
			e.array(el)
		}
	}
}
