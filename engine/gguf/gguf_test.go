package gguf

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// sampleKVs covers every scalar and array type, empty arrays and nested
// arrays, in the order they are added.
func sampleKVs() []KV {
	return []KV{
		{"general.architecture", ValueString, "llama"},
		{"u8", ValueUint8, uint8(200)},
		{"i8", ValueInt8, int8(-5)},
		{"u16", ValueUint16, uint16(60000)},
		{"i16", ValueInt16, int16(-30000)},
		{"u32", ValueUint32, uint32(4_000_000_000)},
		{"i32", ValueInt32, int32(-2_000_000_000)},
		{"f32", ValueFloat32, float32(1.5)},
		{"bool.t", ValueBool, true},
		{"bool.f", ValueBool, false},
		{"str", ValueString, "héllo\x00world"},
		{"str.empty", ValueString, ""},
		{"u64", ValueUint64, uint64(1<<63 + 5)},
		{"i64", ValueInt64, int64(-1 << 62)},
		{"f64", ValueFloat64, math.Pi},
		{"a.u8", ValueArray, []uint8{0, 1, 255}},
		{"a.i8", ValueArray, []int8{-128, 0, 127}},
		{"a.u16", ValueArray, []uint16{0, 65535}},
		{"a.i16", ValueArray, []int16{-32768, 32767}},
		{"a.u32", ValueArray, []uint32{1, 2, math.MaxUint32}},
		{"a.i32", ValueArray, []int32{-1, 0, math.MaxInt32}},
		{"a.f32", ValueArray, []float32{0.25, -1e30, float32(math.Inf(1))}},
		{"a.bool", ValueArray, []bool{true, false, true}},
		{"a.str", ValueArray, []string{"<s>", "", "▁the", "\xff\xfe"}},
		{"a.u64", ValueArray, []uint64{math.MaxUint64}},
		{"a.i64", ValueArray, []int64{math.MinInt64, 7}},
		{"a.f64", ValueArray, []float64{math.SmallestNonzeroFloat64, -2}},
		{"a.empty", ValueArray, []int32{}},
		{"a.nested", ValueArray, []any{
			[]int32{1, 2},
			[]string{"x"},
			[]any{[]uint8{9}, []any{}},
			[]float64{},
		}},
	}
}

type sampleTensor struct {
	name  string
	typ   Type
	shape []uint64
}

var sampleTensors = []sampleTensor{
	{"token_embd.weight", TypeF32, []uint64{8, 3}},
	{"blk.0.attn_q.weight", TypeQ8_0, []uint64{64, 2}},
	{"f16", TypeF16, []uint64{16, 2}},
	{"bf16", TypeBF16, []uint64{5}},
	{"q4k", TypeQ4_K, []uint64{256}},
	{"i64.4d", TypeI64, []uint64{3, 1, 1, 2}},
}

// buildSample returns a Writer holding the sample metadata and tensors, and
// the tensor contents by name.
func buildSample(t testing.TB, align int) (*Writer, map[string][]byte) {
	t.Helper()
	w := NewWriter()
	if align != 0 {
		w.SetAlignment(align)
	}
	for _, kv := range sampleKVs() {
		w.Add(kv.Key, kv.Value)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	data := map[string][]byte{}
	for _, st := range sampleTensors {
		size, err := TensorBytes(st.typ, st.shape)
		if err != nil {
			t.Fatal(err)
		}
		b := make([]byte, size)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		if err := w.AddTensor(st.name, st.typ, st.shape, b); err != nil {
			t.Fatal(err)
		}
		data[st.name] = b
	}
	return w, data
}

func encode(t testing.TB, w *Writer) []byte {
	t.Helper()
	var buf bytes.Buffer
	n, err := w.WriteTo(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(buf.Len()) {
		t.Fatalf("WriteTo returned %d, wrote %d bytes", n, buf.Len())
	}
	return buf.Bytes()
}

// checkSample verifies that f holds exactly what buildSample wrote.
func checkSample(t *testing.T, f *File, data map[string][]byte, align uint64) {
	t.Helper()
	if f.Version != 3 {
		t.Errorf("Version = %d", f.Version)
	}
	want := sampleKVs()
	if align != DefaultAlignment {
		want = append([]KV{{KeyAlignment, ValueUint32, uint32(align)}}, want...)
	}
	if !reflect.DeepEqual(f.KVs, want) {
		t.Errorf("KVs differ:\n got %#v\nwant %#v", f.KVs, want)
	}
	if f.Alignment != align {
		t.Errorf("Alignment = %d, want %d", f.Alignment, align)
	}
	if f.DataOffset%align != 0 {
		t.Errorf("DataOffset %d not aligned to %d", f.DataOffset, align)
	}
	if len(f.Tensors) != len(sampleTensors) {
		t.Fatalf("%d tensors, want %d", len(f.Tensors), len(sampleTensors))
	}
	for i, st := range sampleTensors {
		ti := f.Tensors[i]
		if ti.Name != st.name || ti.Type != st.typ || !reflect.DeepEqual(ti.Shape, st.shape) {
			t.Errorf("tensor %d = %+v, want %+v", i, ti, st)
		}
		if ti.Size != uint64(len(data[st.name])) {
			t.Errorf("tensor %q: Size %d, want %d", st.name, ti.Size, len(data[st.name]))
		}
		if ti.Offset%align != 0 {
			t.Errorf("tensor %q: offset %d not aligned", st.name, ti.Offset)
		}
		p, ok := f.Tensor(st.name)
		if !ok || p != &f.Tensors[i] {
			t.Errorf("Tensor(%q) = %v, %v", st.name, p, ok)
		}
		got, err := f.TensorData(st.name)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data[st.name]) {
			t.Errorf("tensor %q: data differs", st.name)
		}
		if cap(got) != len(got) {
			t.Errorf("tensor %q: cap %d exceeds len %d", st.name, cap(got), len(got))
		}
	}
	if f.Architecture() != "llama" {
		t.Errorf("Architecture() = %q", f.Architecture())
	}
}

func TestRoundTrip(t *testing.T) {
	for _, align := range []int{0, 32, 64, 1, 4096} {
		w, data := buildSample(t, align)
		b := encode(t, w)
		f, err := Parse(b)
		if err != nil {
			t.Fatalf("align %d: %v", align, err)
		}
		wantAlign := uint64(align)
		if align == 0 {
			wantAlign = DefaultAlignment
		}
		checkSample(t, f, data, wantAlign)
		// Writing is deterministic and a parsed file re-encodes to the
		// same bytes.
		if b2 := encode(t, w); !bytes.Equal(b, b2) {
			t.Errorf("align %d: second WriteTo differs", align)
		}
		if b3 := encode(t, rewriter(t, f)); !bytes.Equal(b, b3) {
			t.Errorf("align %d: re-encoding a parsed file differs", align)
		}
	}
}

// rewriter builds a Writer that reproduces f.
func rewriter(t testing.TB, f *File) *Writer {
	t.Helper()
	w := NewWriter()
	for _, kv := range f.KVs {
		w.Add(kv.Key, kv.Value)
	}
	for _, ti := range f.Tensors {
		d, err := f.TensorData(ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.AddTensor(ti.Name, ti.Type, ti.Shape, d); err != nil {
			t.Fatalf("writer refuses a tensor the reader accepted: %v", err)
		}
	}
	return w
}

func TestOpen(t *testing.T) {
	w, data := buildSample(t, 64)
	dir := t.TempDir()
	path := filepath.Join(dir, "model.gguf")
	if err := w.WriteFile(path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path + ".tmp"); !os.IsNotExist(err) {
		t.Errorf("temporary file left behind: %v", err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	checkSample(t, f, data, 64)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := f.TensorData("f16"); !errors.Is(err, ErrClosed) {
		t.Errorf("TensorData after Close: %v, want ErrClosed", err)
	}
	// Metadata outlives the mapping.
	if s, ok := f.Strings("a.str"); !ok || s[2] != "▁the" {
		t.Errorf("Strings after Close = %q, %v", s, ok)
	}

	// WriteFile replaces an existing file.
	w2 := NewWriter()
	w2.Add("general.architecture", "other")
	if err := w2.WriteFile(path); err != nil {
		t.Fatal(err)
	}
	f2, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	if f2.Architecture() != "other" || len(f2.Tensors) != 0 {
		t.Errorf("rewritten file: arch %q, %d tensors", f2.Architecture(), len(f2.Tensors))
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := Open(filepath.Join(dir, "missing.gguf")); err == nil || errors.Is(err, ErrFormat) || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("directory: %v", err)
	}
	empty := filepath.Join(dir, "empty.gguf")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(empty); !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), empty) {
		t.Errorf("empty file: %v", err)
	}
	w, _ := buildSample(t, 0)
	b := encode(t, w)
	bad := filepath.Join(dir, "bad.gguf")
	if err := os.WriteFile(bad, b[:len(b)-100], 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Open(bad)
	if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "past end of file") {
		t.Errorf("truncated file: %v", err)
	}
}

func TestTensorDataMissing(t *testing.T) {
	w, _ := buildSample(t, 0)
	f, err := Parse(encode(t, w))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.TensorData("nope"); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("TensorData(missing) = %v", err)
	}
	if _, ok := f.Tensor("nope"); ok {
		t.Error("Tensor(missing) found")
	}
	if _, ok := f.Lookup("nope"); ok {
		t.Error("Lookup(missing) found")
	}
}

func TestAccessors(t *testing.T) {
	w := NewWriter()
	w.Add("s", "str")
	w.Add("b", true)
	w.Add("u8", uint8(7))
	w.Add("i32.neg", int32(-3))
	w.Add("i64.pos", int64(1<<40))
	w.Add("u64.big", uint64(math.MaxUint64))
	w.Add("u64.small", uint64(12))
	w.Add("f32", float32(0.5))
	w.Add("f64", 1e300)
	w.Add("strs", []string{"a", "b"})
	w.Add("f32s", []float32{1, 2})
	w.Add("f64s", []float64{1.5, 3})
	w.Add("i32s", []int32{-1, 2})
	w.Add("u32s.fit", []uint32{1, math.MaxInt32})
	w.Add("u32s.big", []uint32{1, math.MaxInt32 + 1})
	w.Add("i64s.fit", []int64{math.MinInt32, math.MaxInt32})
	w.Add("i64s.low", []int64{math.MinInt32 - 1})
	w.Add("u8s", []uint8{255})
	w.Add("i8s", []int8{-128})
	f, err := Parse(encode(t, w))
	if err != nil {
		t.Fatal(err)
	}

	if v, ok := f.String("s"); !ok || v != "str" {
		t.Errorf("String = %q %v", v, ok)
	}
	if _, ok := f.String("b"); ok {
		t.Error("String accepted a bool")
	}
	if v, ok := f.Bool("b"); !ok || !v {
		t.Errorf("Bool = %v %v", v, ok)
	}
	if _, ok := f.Bool("u8"); ok {
		t.Error("Bool accepted an integer")
	}

	uints := []struct {
		key string
		v   uint64
		ok  bool
	}{
		{"u8", 7, true}, {"i32.neg", 0, false}, {"i64.pos", 1 << 40, true},
		{"u64.big", math.MaxUint64, true}, {"f32", 0, false}, {"s", 0, false}, {"missing", 0, false},
	}
	for _, c := range uints {
		if v, ok := f.Uint(c.key); v != c.v || ok != c.ok {
			t.Errorf("Uint(%q) = %d %v, want %d %v", c.key, v, ok, c.v, c.ok)
		}
	}
	ints := []struct {
		key string
		v   int64
		ok  bool
	}{
		{"u8", 7, true}, {"i32.neg", -3, true}, {"u64.big", 0, false}, {"u64.small", 12, true}, {"f64", 0, false},
	}
	for _, c := range ints {
		if v, ok := f.Int(c.key); v != c.v || ok != c.ok {
			t.Errorf("Int(%q) = %d %v, want %d %v", c.key, v, ok, c.v, c.ok)
		}
	}
	floats := []struct {
		key string
		v   float64
		ok  bool
	}{
		{"f32", 0.5, true}, {"f64", 1e300, true}, {"i32.neg", -3, true}, {"u64.small", 12, true}, {"s", 0, false},
	}
	for _, c := range floats {
		if v, ok := f.Float(c.key); v != c.v || ok != c.ok {
			t.Errorf("Float(%q) = %g %v, want %g %v", c.key, v, ok, c.v, c.ok)
		}
	}

	if v, ok := f.Strings("strs"); !ok || !reflect.DeepEqual(v, []string{"a", "b"}) {
		t.Errorf("Strings = %q %v", v, ok)
	}
	if _, ok := f.Strings("f32s"); ok {
		t.Error("Strings accepted floats")
	}
	if v, ok := f.Float32s("f32s"); !ok || !reflect.DeepEqual(v, []float32{1, 2}) {
		t.Errorf("Float32s = %v %v", v, ok)
	}
	if v, ok := f.Float32s("f64s"); !ok || !reflect.DeepEqual(v, []float32{1.5, 3}) {
		t.Errorf("Float32s(f64) = %v %v", v, ok)
	}
	int32s := []struct {
		key string
		v   []int32
		ok  bool
	}{
		{"i32s", []int32{-1, 2}, true},
		{"u32s.fit", []int32{1, math.MaxInt32}, true},
		{"u32s.big", nil, false},
		{"i64s.fit", []int32{math.MinInt32, math.MaxInt32}, true},
		{"i64s.low", nil, false},
		{"u8s", []int32{255}, true},
		{"i8s", []int32{-128}, true},
		{"f32s", nil, false},
		{"strs", nil, false},
	}
	for _, c := range int32s {
		if v, ok := f.Int32s(c.key); !reflect.DeepEqual(v, c.v) || ok != c.ok {
			t.Errorf("Int32s(%q) = %v %v, want %v %v", c.key, v, ok, c.v, c.ok)
		}
	}

	kv, ok := f.Lookup("u32s.fit")
	if !ok || kv.Type != ValueArray {
		t.Fatalf("Lookup = %+v %v", kv, ok)
	}
	if et, ok := kv.ElemType(); !ok || et != ValueUint32 {
		t.Errorf("ElemType = %v %v", et, ok)
	}
	if kv, _ := f.Lookup("s"); kv.Type != ValueString {
		t.Errorf("Lookup(s).Type = %v", kv.Type)
	} else if _, ok := kv.ElemType(); ok {
		t.Error("ElemType of a scalar reported ok")
	}
}

func TestTypes(t *testing.T) {
	cases := []struct {
		t          Type
		name       string
		block, siz int
	}{
		{TypeF32, "F32", 1, 4}, {TypeF16, "F16", 1, 2}, {TypeQ4_0, "Q4_0", 32, 18},
		{TypeQ4_1, "Q4_1", 32, 20}, {TypeQ5_0, "Q5_0", 32, 22}, {TypeQ5_1, "Q5_1", 32, 24},
		{TypeQ8_0, "Q8_0", 32, 34}, {TypeQ8_1, "Q8_1", 32, 36}, {TypeQ2_K, "Q2_K", 256, 84},
		{TypeQ3_K, "Q3_K", 256, 110}, {TypeQ4_K, "Q4_K", 256, 144}, {TypeQ5_K, "Q5_K", 256, 176},
		{TypeQ6_K, "Q6_K", 256, 210}, {TypeQ8_K, "Q8_K", 256, 292}, {TypeI8, "I8", 1, 1},
		{TypeI16, "I16", 1, 2}, {TypeI32, "I32", 1, 4}, {TypeI64, "I64", 1, 8},
		{TypeF64, "F64", 1, 8}, {TypeBF16, "BF16", 1, 2}, {TypeIQ4_NL, "IQ4_NL", 32, 18},
		{Type(99), "type(99)", 0, 0}, {Type(4), "type(4)", 0, 0},
	}
	for _, c := range cases {
		if c.t.String() != c.name || c.t.BlockSize() != c.block || c.t.TypeSize() != c.siz || c.t.Known() != (c.block != 0) {
			t.Errorf("%d: %q %d %d, want %q %d %d", uint32(c.t), c.t.String(), c.t.BlockSize(), c.t.TypeSize(), c.name, c.block, c.siz)
		}
	}
	if ValueFloat64.String() != "FLOAT64" || ValueArray.String() != "ARRAY" || ValueType(13).String() != "valuetype(13)" {
		t.Error("ValueType.String")
	}

	rows := []struct {
		t    Type
		ne0  int
		want int
		err  string
	}{
		{TypeQ8_0, 64, 68, ""}, {TypeF32, 3, 12, ""}, {TypeBF16, 0, 0, ""}, {TypeQ6_K, 512, 420, ""},
		{TypeQ8_0, 33, 0, "not a multiple of the Q8_0 block size 32"},
		{TypeF16, -1, 0, "negative"},
		{Type(99), 32, 0, "unknown tensor type type(99)"},
		{TypeF64, math.MaxInt, 0, "overflows"},
	}
	for _, c := range rows {
		got, err := RowBytes(c.t, c.ne0)
		if c.err == "" {
			if err != nil || got != c.want {
				t.Errorf("RowBytes(%v, %d) = %d, %v; want %d", c.t, c.ne0, got, err, c.want)
			}
		} else if err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("RowBytes(%v, %d) error = %v, want %q", c.t, c.ne0, err, c.err)
		}
	}

	if n, err := TensorBytes(TypeQ8_0, []uint64{64, 3, 2}); err != nil || n != 68*6 {
		t.Errorf("TensorBytes = %d, %v", n, err)
	}
	ti := TensorInfo{Shape: []uint64{4, 3, 2, 5}}
	if ti.Elements() != 120 {
		t.Errorf("Elements = %d", ti.Elements())
	}
}

func TestWriterErrors(t *testing.T) {
	w := NewWriter()
	if err := w.AddTensor("a", TypeF32, []uint64{2}, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	errCases := []struct {
		name  string
		typ   Type
		shape []uint64
		n     int
		want  string
	}{
		{"a", TypeF32, []uint64{2}, 8, `duplicate tensor "a"`},
		{"b", TypeF32, []uint64{2}, 7, "data is 7 bytes, F32 [2] needs 8"},
		{"c", TypeQ8_0, []uint64{16}, 17, "not a multiple of the Q8_0 block size"},
		{"d", Type(5), []uint64{1}, 1, "unknown ggml type 5"},
		{"e", TypeF32, []uint64{1, 1, 1, 1, 1}, 4, "5 dimensions"},
		{"f", TypeF32, nil, 4, "0 dimensions"},
		{"g", TypeF32, []uint64{4, 0}, 0, "dimension 1 is zero"},
		{"h", TypeI8, []uint64{1 << 32, 1 << 32}, 0, "more than 2^63-1 elements"},
	}
	for _, c := range errCases {
		err := w.AddTensor(c.name, c.typ, c.shape, make([]byte, c.n))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("AddTensor(%q): %v, want %q", c.name, err, c.want)
		}
	}
	if len(w.tensors) != 1 {
		t.Errorf("failed AddTensor calls added tensors: %d", len(w.tensors))
	}

	// Add replaces in place and copies slices.
	s := []string{"x", "y"}
	w.Add("k1", uint32(1))
	w.Add("k2", s)
	w.Add("k1", "replaced")
	s[0] = "mutated"
	f, err := Parse(encode(t, w))
	if err != nil {
		t.Fatal(err)
	}
	want := []KV{{"k1", ValueString, "replaced"}, {"k2", ValueArray, []string{"x", "y"}}}
	if !reflect.DeepEqual(f.KVs, want) {
		t.Errorf("KVs = %#v, want %#v", f.KVs, want)
	}

	// Alignment: default removes the key, explicit Add keeps it.
	w = NewWriter()
	w.Add("a", int8(1))
	w.SetAlignment(128)
	w.Add("b", int8(2))
	w.SetAlignment(256)
	if f, err := Parse(encode(t, w)); err != nil || f.Alignment != 256 || f.KVs[1].Key != KeyAlignment {
		t.Errorf("SetAlignment(256): %v %+v", err, f)
	}
	w.SetAlignment(32)
	if f, err := Parse(encode(t, w)); err != nil || f.Alignment != 32 || len(f.KVs) != 2 {
		t.Errorf("SetAlignment(32): %v %+v", err, f)
	}
	w.Add(KeyAlignment, uint32(32))
	if f, err := Parse(encode(t, w)); err != nil || f.Alignment != 32 || len(f.KVs) != 3 {
		t.Errorf("Add(general.alignment, 32): %v %+v", err, f)
	}

	for _, bad := range []func(*Writer){
		func(w *Writer) { w.SetAlignment(0) },
		func(w *Writer) { w.SetAlignment(48) },
		func(w *Writer) { w.SetAlignment(-8) },
		func(w *Writer) { w.Add(KeyAlignment, uint64(64)) },
		func(w *Writer) { w.Add(KeyAlignment, uint32(3)) },
	} {
		w := NewWriter()
		bad(w)
		if _, err := w.WriteTo(&bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "power of two") {
			t.Errorf("invalid alignment: WriteTo error %v", err)
		}
		if err := w.WriteFile(filepath.Join(t.TempDir(), "x.gguf")); err == nil {
			t.Error("WriteFile with invalid alignment succeeded")
		}
	}

	for _, v := range []any{1, nil, []int{1}, map[string]int{}, []any{uint8(1)}, []any{[]any{1}}, nested(9)} {
		func() {
			defer func() {
				if r := recover(); r == nil {
					t.Errorf("Add(%T) did not panic", v)
				}
			}()
			NewWriter().Add("k", v)
		}()
	}
	NewWriter().Add("k", nested(8)) // the deepest allowed
}

// nested returns arrays nested depth deep.
func nested(depth int) any {
	var v any = []uint8{1}
	for range depth - 1 {
		v = []any{v}
	}
	return v
}

func TestWriteFileError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "missing", "x.gguf")
	if err := NewWriter().WriteFile(path); err == nil {
		t.Error("WriteFile into a missing directory succeeded")
	}
}

type failWriter struct{ left int }

func (f *failWriter) Write(p []byte) (int, error) {
	if len(p) > f.left {
		n := f.left
		f.left = 0
		return n, errors.New("disk full")
	}
	f.left -= len(p)
	return len(p), nil
}

func TestWriteToError(t *testing.T) {
	w, _ := buildSample(t, 0)
	n, err := w.WriteTo(&failWriter{left: 1000})
	if err == nil || !strings.Contains(err.Error(), "disk full") || n != 1000 {
		t.Errorf("WriteTo = %d, %v", n, err)
	}
}
