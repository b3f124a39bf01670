package gguf

import (
	"fmt"
	"math"
	"math/bits"
	"os"
	"sync"
)

// KV is one metadata key/value pair.
//
// Value holds scalars as the natural Go type: uint8, int8, uint16, int16,
// uint32, int32, float32, bool, string, uint64, int64 or float64. Arrays are
// slices of those types ([]uint8 ... []float64, []bool, []string). A nested
// array (an ARRAY of ARRAYs) is an []any whose elements are themselves array
// values of the same kinds; each inner array carries its own element type,
// so they may differ. Type is the GGUF type tag (ValueArray for any array).
//
// Values returned by a File are shared with it and must not be modified.
type KV struct {
	Key   string
	Type  ValueType
	Value any
}

// ElemType returns the element type of an array value (ValueArray for a
// nested array). ok is false if kv is not an array.
func (kv KV) ElemType() (t ValueType, ok bool) {
	vt, et, ok := typeOf(kv.Value)
	if !ok || vt != ValueArray {
		return 0, false
	}
	return et, true
}

// TensorInfo describes one tensor of a file.
type TensorInfo struct {
	Name   string
	Type   Type
	Shape  []uint64 // ne, fastest-varying (row length) first, len 1..MaxDims
	Offset uint64   // relative to the data section; a multiple of the alignment
	Size   uint64   // bytes
}

// Elements returns the number of elements (the product of Shape). For a
// TensorInfo from a File it is known not to overflow.
func (t *TensorInfo) Elements() uint64 {
	n := uint64(1)
	for _, ne := range t.Shape {
		n *= ne
	}
	return n
}

// File is a parsed GGUF file. Metadata and tensor infos are plain Go values
// that stay valid after Close; tensor data is borrowed from the underlying
// bytes (the read-only mapping made by Open, or the slice given to Parse).
//
// A File is safe for concurrent use.
type File struct {
	Version    uint32
	KVs        []KV         // in file order
	Tensors    []TensorInfo // in file order
	Alignment  uint64
	DataOffset uint64 // absolute offset of the data section

	kvIndex     map[string]int
	tensorIndex map[string]int

	mu     sync.RWMutex
	data   []byte // the whole file; nil after Close
	mapped bool   // data is an mmap to release on Close
}

// Open maps the file at path read-only and parses it; see Parse for what is
// validated. The file must be closed with Close to release the mapping.
//
// The mapping reflects the file on disk: truncating or rewriting the file
// while it is open can crash the process when tensor data is touched, as
// with any mmap. Replace model files by renaming a new file into place
// (as Writer.WriteFile does), never by rewriting them.
func Open(path string) (*File, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("gguf: %w", err)
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return nil, fmt.Errorf("gguf: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("gguf: %s: not a regular file", path)
	}
	size := st.Size()
	if size == 0 {
		// mmap refuses empty mappings; report the file as too short instead.
		_, err := parse(nil)
		return nil, withPath(err, path)
	}
	if size > math.MaxInt {
		return nil, fmt.Errorf("gguf: %s: file of %d bytes is too large for this platform", path, size)
	}
	data, mapped, err := mapFile(fh, int(size))
	if err != nil {
		return nil, fmt.Errorf("gguf: %s: %w", path, err)
	}
	f, err := parse(data)
	if err != nil {
		if mapped {
			_ = unmapFile(data)
		}
		return nil, withPath(err, path)
	}
	f.mapped = mapped
	return f, nil
}

// withPath names the file in a format error from Open.
func withPath(err error, path string) error {
	if fe, ok := err.(*formatError); ok {
		fe.path = path
	}
	return err
}

// Parse parses a GGUF file held in memory. It validates the whole structure:
// magic and version, every metadata value, unique keys and tensor names,
// general.alignment, tensor shapes and types, aligned offsets, and that all
// tensor data lies inside data. Any problem is reported as an error wrapping
// ErrFormat.
//
// The File borrows data for TensorData: data must not be modified while the
// File is in use.
func Parse(data []byte) (*File, error) {
	return parse(data)
}

// Minimum encoded sizes, used to bound counts before allocating.
const (
	minKVSize     = 8 + 4 + 1         // key length, type, smallest value
	minTensorSize = 8 + 4 + 8 + 4 + 8 // name length, n_dims, one ne, type, offset
)

func parse(data []byte) (*File, error) {
	d := &decoder{buf: data}
	if len(data) < 4 {
		return nil, formatErr("truncated: file is %d bytes, too short for the GGUF magic", len(data))
	}
	if string(data[:4]) != Magic {
		return nil, formatErr("not a GGUF file (magic %q)", data[:4])
	}
	d.off = 4
	version, err := d.u32("version")
	if err != nil {
		return nil, err
	}
	switch version {
	case 2, 3:
	default:
		if v := bits.ReverseBytes32(version); v == 2 || v == 3 {
			return nil, formatErr("unsupported version %d (a big-endian GGUF v%d file; only little-endian files are supported)", version, v)
		}
		return nil, formatErr("unsupported version %d (want 2 or 3)", version)
	}
	tensorCount, err := d.u64("tensor count")
	if err != nil {
		return nil, err
	}
	kvCount, err := d.u64("metadata key count")
	if err != nil {
		return nil, err
	}
	if kvCount > uint64(d.remaining()/minKVSize) {
		return nil, formatErr("metadata key count %d exceeds what the remaining %d bytes can hold", kvCount, d.remaining())
	}
	if tensorCount > uint64(d.remaining()/minTensorSize) {
		return nil, formatErr("tensor count %d exceeds what the remaining %d bytes can hold", tensorCount, d.remaining())
	}

	f := &File{
		Version:     version,
		KVs:         make([]KV, 0, int(kvCount)),
		Alignment:   DefaultAlignment,
		kvIndex:     make(map[string]int, int(kvCount)),
		tensorIndex: make(map[string]int, int(tensorCount)),
		data:        data,
	}
	for i := range int(kvCount) {
		if err := f.readKV(d, i); err != nil {
			return nil, err
		}
	}

	// The tensor count was checked before the metadata consumed part of the
	// remainder; check again against what is left so the allocation below
	// is bounded by it.
	if tensorCount > uint64(d.remaining()/minTensorSize) {
		return nil, formatErr("tensor count %d exceeds what the remaining %d bytes (from offset %d) can hold", tensorCount, d.remaining(), d.off)
	}
	f.Tensors = make([]TensorInfo, 0, int(tensorCount))
	for i := range int(tensorCount) {
		if err := f.readTensorInfo(d, i); err != nil {
			return nil, err
		}
	}

	// The data section starts at the end of the header rounded up to the
	// alignment. Alignment is at most 2^31 and the header end at most
	// len(data), so this cannot overflow uint64.
	headerEnd := uint64(d.off)
	f.DataOffset = (headerEnd + f.Alignment - 1) &^ (f.Alignment - 1)
	fileSize := uint64(len(data))
	for i := range f.Tensors {
		if err := f.checkRange(&f.Tensors[i], fileSize); err != nil {
			return nil, err
		}
	}
	return f, nil
}

func (f *File) readKV(d *decoder, i int) error {
	key, err := d.str()
	if err != nil {
		return withContext(err, "metadata key %d", i)
	}
	if _, dup := f.kvIndex[key]; dup {
		return formatErr("metadata key %d: duplicate key %q", i, key)
	}
	typ, err := d.u32("value type")
	if err != nil {
		return withContext(err, "metadata key %d %q", i, key)
	}
	v, err := d.value(ValueType(typ), 0)
	if err != nil {
		return withContext(err, "metadata key %d %q", i, key)
	}
	if key == KeyAlignment {
		a, ok := v.(uint32)
		if !ok {
			return formatErr("metadata key %d %q: type %v, want UINT32", i, key, ValueType(typ))
		}
		if a == 0 || a&(a-1) != 0 {
			return formatErr("metadata key %d %q: alignment %d is not a power of two", i, key, a)
		}
		f.Alignment = uint64(a)
	}
	f.kvIndex[key] = len(f.KVs)
	f.KVs = append(f.KVs, KV{Key: key, Type: ValueType(typ), Value: v})
	return nil
}

func (f *File) readTensorInfo(d *decoder, i int) error {
	name, err := d.str()
	if err != nil {
		return withContext(err, "tensor %d name", i)
	}
	if _, dup := f.tensorIndex[name]; dup {
		return formatErr("tensor %d: duplicate tensor name %q", i, name)
	}
	at := d.off
	nDims, err := d.u32("n_dims")
	if err != nil {
		return withContext(err, "tensor %d %q", i, name)
	}
	if nDims == 0 || nDims > MaxDims {
		return formatErr("tensor %d %q: n_dims %d at offset %d (want 1..%d)", i, name, nDims, at, MaxDims)
	}
	shape := make([]uint64, nDims)
	for j := range shape {
		if shape[j], err = d.u64("dimension"); err != nil {
			return withContext(err, "tensor %d %q", i, name)
		}
	}
	typ, err := d.u32("tensor type")
	if err != nil {
		return withContext(err, "tensor %d %q", i, name)
	}
	off, err := d.u64("tensor offset")
	if err != nil {
		return withContext(err, "tensor %d %q", i, name)
	}
	size, problem := tensorBytes(Type(typ), shape)
	if problem != "" {
		return formatErr("tensor %d %q: %s", i, name, problem)
	}
	if off%f.Alignment != 0 {
		return formatErr("tensor %d %q: offset %d is not a multiple of the alignment %d", i, name, off, f.Alignment)
	}
	f.tensorIndex[name] = len(f.Tensors)
	f.Tensors = append(f.Tensors, TensorInfo{Name: name, Type: Type(typ), Shape: shape, Offset: off, Size: size})
	return nil
}

// checkRange verifies that t's bytes lie inside the file, so TensorData can
// slice without further checks. Overlapping tensors are not looked for: they
// are odd but cannot make a slice go out of bounds.
func (f *File) checkRange(t *TensorInfo, fileSize uint64) error {
	start, carry := bits.Add64(f.DataOffset, t.Offset, 0)
	if carry != 0 {
		return formatErr("tensor %q: data offset %d overflows", t.Name, t.Offset)
	}
	end, carry := bits.Add64(start, t.Size, 0)
	if carry != 0 || end > fileSize {
		return formatErr("tensor %q: data [offset %d, %d bytes] extends past end of file (%d bytes)", t.Name, start, t.Size, fileSize)
	}
	return nil
}

// Close releases the mapping made by Open. It is idempotent. Slices from
// TensorData must not be used after Close: for an opened file the memory
// behind them is gone. Metadata and tensor infos stay usable.
func (f *File) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	data := f.data
	if data == nil {
		return nil
	}
	f.data = nil
	if f.mapped {
		f.mapped = false
		if err := unmapFile(data); err != nil {
			return fmt.Errorf("gguf: unmap: %w", err)
		}
	}
	return nil
}

// Tensor returns the info of the named tensor.
func (f *File) Tensor(name string) (*TensorInfo, bool) {
	i, ok := f.tensorIndex[name]
	if !ok {
		return nil, false
	}
	return &f.Tensors[i], true
}

// TensorData returns the bytes of the named tensor, without copying. The
// slice is read-only (writing to an opened file's mapping faults) and valid
// until Close. Its capacity is clipped to the tensor, so an append cannot
// reach a neighbouring tensor.
func (f *File) TensorData(name string) ([]byte, error) {
	i, ok := f.tensorIndex[name]
	if !ok {
		return nil, fmt.Errorf("gguf: tensor %q: %w", name, ErrNotFound)
	}
	t := &f.Tensors[i]
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.data == nil {
		return nil, fmt.Errorf("gguf: tensor %q: %w", name, ErrClosed)
	}
	start := f.DataOffset + t.Offset // range checked by parse
	end := start + t.Size
	return f.data[start:end:end], nil
}

// Lookup returns the metadata pair with the given key.
func (f *File) Lookup(key string) (KV, bool) {
	i, ok := f.kvIndex[key]
	if !ok {
		return KV{}, false
	}
	return f.KVs[i], true
}

func (f *File) value(key string) (any, bool) {
	i, ok := f.kvIndex[key]
	if !ok {
		return nil, false
	}
	return f.KVs[i].Value, true
}

// String returns a STRING value.
func (f *File) String(key string) (string, bool) {
	v, _ := f.value(key)
	s, ok := v.(string)
	return s, ok
}

// Bool returns a BOOL value.
func (f *File) Bool(key string) (bool, bool) {
	v, _ := f.value(key)
	b, ok := v.(bool)
	return b, ok
}

// Uint returns an integer value of any type that is not negative. Writers
// disagree about which integer type a given key uses (llama.cpp itself
// writes counts as UINT32 but some converters use INT32 or UINT64), so
// readers should not care.
func (f *File) Uint(key string) (uint64, bool) {
	v, _ := f.value(key)
	switch x := v.(type) {
	case uint8:
		return uint64(x), true
	case uint16:
		return uint64(x), true
	case uint32:
		return uint64(x), true
	case uint64:
		return x, true
	}
	if i, ok := asInt64(v); ok && i >= 0 {
		return uint64(i), true
	}
	return 0, false
}

// Int returns an integer value of any type whose value fits in int64.
func (f *File) Int(key string) (int64, bool) {
	v, _ := f.value(key)
	if i, ok := asInt64(v); ok {
		return i, true
	}
	if x, ok := v.(uint64); ok && x <= math.MaxInt64 {
		return int64(x), true
	}
	return 0, false
}

// asInt64 converts every integer type except uint64 (which may not fit).
func asInt64(v any) (int64, bool) {
	switch x := v.(type) {
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	}
	return 0, false
}

// Float returns a FLOAT32 or FLOAT64 value, or an integer value converted
// (hyperparameters such as rope_freq_base are sometimes written as
// integers).
func (f *File) Float(key string) (float64, bool) {
	v, _ := f.value(key)
	switch x := v.(type) {
	case float32:
		return float64(x), true
	case float64:
		return x, true
	case uint64:
		return float64(x), true
	}
	if i, ok := asInt64(v); ok {
		return float64(i), true
	}
	return 0, false
}

// Strings returns an array of STRING. The slice is shared with f.
func (f *File) Strings(key string) ([]string, bool) {
	v, _ := f.value(key)
	s, ok := v.([]string)
	return s, ok
}

// Float32s returns an array of FLOAT32 (shared with f), or an array of
// FLOAT64 converted to float32.
func (f *File) Float32s(key string) ([]float32, bool) {
	v, _ := f.value(key)
	switch x := v.(type) {
	case []float32:
		return x, true
	case []float64:
		out := make([]float32, len(x))
		for i, e := range x {
			out[i] = float32(e)
		}
		return out, true
	}
	return nil, false
}

// Int32s returns an array of INT32 (shared with f), or an array of any
// other integer type converted when every element fits in int32 (token
// types, for instance, are written as INT32 or UINT32 by different tools).
func (f *File) Int32s(key string) ([]int32, bool) {
	v, _ := f.value(key)
	switch x := v.(type) {
	case []int32:
		return x, true
	case []int8:
		return convertInt32(x)
	case []uint8:
		return convertInt32(x)
	case []int16:
		return convertInt32(x)
	case []uint16:
		return convertInt32(x)
	case []uint32:
		return convertInt32(x)
	case []int64:
		return convertInt32(x)
	case []uint64:
		return convertInt32(x)
	}
	return nil, false
}

func convertInt32[T int8 | uint8 | int16 | uint16 | uint32 | int64 | uint64](x []T) ([]int32, bool) {
	out := make([]int32, len(x))
	for i, e := range x {
		// Compare in the widest types so no conversion wraps: a negative
		// value is always representable as int64, a non-negative one as
		// uint64.
		if e < 0 {
			if int64(e) < math.MinInt32 {
				return nil, false
			}
		} else if uint64(e) > math.MaxInt32 {
			return nil, false
		}
		out[i] = int32(e)
	}
	return out, true
}

// Architecture returns general.architecture ("llama", "qwen2", ...), or ""
// if it is missing or not a string.
func (f *File) Architecture() string {
	s, _ := f.String("general.architecture")
	return s
}
