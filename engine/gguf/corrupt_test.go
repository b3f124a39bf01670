package gguf

import (
	"encoding/binary"
	"errors"
	"math"
	"runtime"
	"strings"
	"testing"
)

// raw assembles GGUF bytes by hand, so tests can write what Writer refuses.
type raw []byte

func (r raw) u8(v uint8) raw   { return append(r, v) }
func (r raw) u32(v uint32) raw { return binary.LittleEndian.AppendUint32(r, v) }
func (r raw) u64(v uint64) raw { return binary.LittleEndian.AppendUint64(r, v) }
func (r raw) str(s string) raw { return append(r.u64(uint64(len(s))), s...) }

// header starts a v3 file.
func header(tensors, kvs uint64) raw {
	return raw("GGUF").u32(3).u64(tensors).u64(kvs)
}

// kv appends a key and value type; the caller appends the value.
func (r raw) kv(key string, t ValueType) raw { return r.str(key).u32(uint32(t)) }

// tensor appends a tensor info.
func (r raw) tensor(name string, t Type, offset uint64, shape ...uint64) raw {
	r = r.str(name).u32(uint32(len(shape)))
	for _, ne := range shape {
		r = r.u64(ne)
	}
	return r.u32(uint32(t)).u64(offset)
}

// padTo appends zeros up to a multiple of align, then n more bytes.
func (r raw) padTo(align, n int) raw {
	for len(r)%align != 0 {
		r = append(r, 0)
	}
	return append(r, make([]byte, n)...)
}

func TestHandBuiltValid(t *testing.T) {
	// A hand-assembled file must parse, which anchors the corrupt cases
	// below to real layout rather than to the Writer.
	b := header(2, 2).kv("general.alignment", ValueUint32).u32(64).kv("n", ValueUint8).u8(1).
		tensor("a", TypeF32, 0, 4).tensor("b", TypeQ8_0, 64, 32, 2).padTo(64, 64+68)
	f, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if f.DataOffset%64 != 0 || f.Tensors[1].Size != 68 {
		t.Errorf("DataOffset %d, size %d", f.DataOffset, f.Tensors[1].Size)
	}
	// Version 2 shares the layout.
	b2 := append(raw(nil), b...)
	binary.LittleEndian.PutUint32(b2[4:], 2)
	if f, err := Parse(b2); err != nil || f.Version != 2 {
		t.Errorf("version 2: %v", err)
	}
	// A file without tensors may end right after the header.
	if _, err := Parse(header(0, 1).kv("x", ValueBool).u8(0)); err != nil {
		t.Errorf("unpadded file without tensors: %v", err)
	}
}

func TestCorrupt(t *testing.T) {
	huge := uint64(1) << 60
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "truncated: file is 0 bytes"},
		{"short magic", []byte("GGU"), "truncated: file is 3 bytes"},
		{"bad magic", []byte("ABCD\x03\x00\x00\x00"), `not a GGUF file (magic "ABCD")`},
		{"version 1", raw("GGUF").u32(1).u32(0).u32(0), "unsupported version 1 (want 2 or 3)"},
		{"version 4", raw("GGUF").u32(4).u64(0).u64(0), "unsupported version 4"},
		{"big-endian", raw("GGUF").u32(0x03000000).u64(0).u64(0), "big-endian GGUF v3"},
		{"no version", raw("GGUF").u8(3), "truncated: version at offset 4 needs 4 bytes, 1 remain"},
		{"huge kv count", header(0, huge), "metadata key count 1152921504606846976 exceeds what the remaining 0 bytes can hold"},
		{"huge tensor count", header(huge, 0), "tensor count 1152921504606846976 exceeds"},
		{"max string length", header(0, 1).u64(math.MaxInt64).u32(0).u8(0),
			"metadata key 0: string length 9223372036854775807 at offset 24 exceeds remaining 5 bytes"},
		{"max uint64 string length", header(0, 1).u64(math.MaxUint64).u32(0).u8(0),
			"string length 18446744073709551615"},
		{"bad value type", header(0, 1).kv("k", 13).u64(0), `metadata key 0 "k": unknown value type 13 at offset 33`},
		{"truncated value", header(0, 1).kv("k", ValueUint64).u32(0), `metadata key 0 "k": truncated: UINT64 value at offset 37 needs 8 bytes, 4 remain`},
		{"bad array elem type", header(0, 1).kv("k", ValueArray).u32(99).u64(0), "unknown array element type 99"},
		{"huge array", header(0, 1).kv("k", ValueArray).u32(uint32(ValueUint8)).u64(huge).u64(0),
			`metadata key 0 "k": array of 1152921504606846976 UINT8 at offset 37 exceeds remaining 8 bytes`},
		{"huge string array", header(0, 1).kv("k", ValueArray).u32(uint32(ValueString)).u64(huge),
			"array of 1152921504606846976 STRING"},
		{"huge nested array", header(0, 1).kv("k", ValueArray).u32(uint32(ValueArray)).u64(huge),
			"array of 1152921504606846976 ARRAY"},
		{"array slightly too long", header(0, 1).kv("k", ValueArray).u32(uint32(ValueFloat32)).u64(3).u64(0),
			"array of 3 FLOAT32"},
		{"bad string in array", header(0, 1).kv("k", ValueArray).u32(uint32(ValueString)).u64(2).str("ok").u64(100),
			`metadata key 0 "k": element 1: string length 100`},
		{"too deep", deepArray(maxArrayDepth + 1), "arrays nested more than 8 deep"},
		{"bad bool", header(0, 1).kv("k", ValueBool).u8(2), "invalid BOOL value 2 at offset 37"},
		{"bad bool in array", header(0, 1).kv("k", ValueArray).u32(uint32(ValueBool)).u64(3).u8(1).u8(0).u8(7),
			`"k": element 2: invalid BOOL value 7 at offset 51`},
		{"duplicate key", header(0, 2).kv("a", ValueUint8).u8(1).kv("a", ValueUint8).u8(2),
			`metadata key 1: duplicate key "a"`},
		{"alignment type", header(0, 1).kv(KeyAlignment, ValueUint64).u64(64), "type UINT64, want UINT32"},
		{"alignment zero", header(0, 1).kv(KeyAlignment, ValueUint32).u32(0), "alignment 0 is not a power of two"},
		{"alignment 48", header(0, 1).kv(KeyAlignment, ValueUint32).u32(48), "alignment 48 is not a power of two"},
		{"n_dims 5", header(1, 0).tensor("t", TypeF32, 0, 1, 1, 1, 1, 1).padTo(32, 4), `tensor 0 "t": n_dims 5 at offset`},
		{"n_dims 0", header(1, 0).tensor("t", TypeF32, 0).padTo(32, 4), `tensor 0 "t": n_dims 0`},
		{"n_dims huge", header(1, 0).str("t").u32(math.MaxUint32).padTo(32, 64), "n_dims 4294967295"},
		{"zero dim", header(1, 0).tensor("t", TypeF32, 0, 4, 0).padTo(32, 4), "dimension 1 is zero"},
		{"shape overflow", header(1, 0).tensor("t", TypeI8, 0, 1<<32, 1<<32).padTo(32, 4), "more than 2^63-1 elements"},
		{"size overflow", header(1, 0).tensor("t", TypeF64, 0, 1<<62).padTo(32, 4), "more than 2^63-1 bytes"},
		{"row not multiple of block", header(1, 0).tensor("t", TypeQ8_0, 0, 33).padTo(32, 34), "row length 33 is not a multiple of the Q8_0 block size 32"},
		{"unknown ggml type", header(1, 0).tensor("t", Type(99), 0, 4).padTo(32, 4), `tensor 0 "t": unknown ggml type 99`},
		{"removed ggml type", header(1, 0).tensor("t", Type(4), 0, 32).padTo(32, 64), "unknown ggml type 4"},
		{"misaligned", header(2, 0).tensor("a", TypeF32, 0, 4).tensor("b", TypeF32, 16, 4).padTo(32, 64),
			`tensor 1 "b": offset 16 is not a multiple of the alignment 32`},
		{"past end", header(1, 0).tensor("blk.0.attn_q.weight", TypeF32, 32, 8).padTo(32, 40),
			`tensor "blk.0.attn_q.weight": data [offset 128, 32 bytes] extends past end of file (136 bytes)`},
		{"past end by one", header(1, 0).tensor("t", TypeF32, 0, 8).padTo(32, 31), "extends past end of file"},
		{"data section missing", header(1, 0).tensor("t", TypeF32, 0, 1), "extends past end of file"},
		{"offset overflow", header(1, 0).tensor("t", TypeF32, math.MaxUint64-31, 1).padTo(32, 4), "overflows"},
		{"duplicate tensor", header(2, 0).tensor("t", TypeF32, 0, 1).tensor("t", TypeF32, 32, 1).padTo(32, 64),
			`tensor 1: duplicate tensor name "t"`},
		{"tensor name truncated", header(1, 0).u64(1000).padTo(64, 0), "tensor 0 name: string length 1000"},
		{"tensor count after kvs", header(1, 1).kv("k", ValueArray).u32(uint32(ValueUint8)).u64(20).padTo(1, 20),
			"tensor count 1 exceeds"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f, err := Parse(c.data)
			if err == nil {
				t.Fatalf("parsed: %+v", f)
			}
			if !errors.Is(err, ErrFormat) {
				t.Errorf("error does not wrap ErrFormat: %v", err)
			}
			if !strings.HasPrefix(err.Error(), "gguf: ") || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q\nwant it to contain %q", err, c.want)
			}
		})
	}
}

// deepArray returns a file whose one key holds arrays nested depth deep.
func deepArray(depth int) raw {
	r := header(0, 1).kv("k", ValueArray)
	for range depth - 1 {
		r = r.u32(uint32(ValueArray)).u64(1)
	}
	return r.u32(uint32(ValueUint8)).u64(0)
}

func TestNestingLimit(t *testing.T) {
	if _, err := Parse(deepArray(maxArrayDepth)); err != nil {
		t.Errorf("depth %d: %v", maxArrayDepth, err)
	}
}

// TestTruncated cuts a valid file at every byte: each prefix that loses
// part of the header or of a tensor must fail cleanly; prefixes that only
// lose trailing padding must still parse.
func TestTruncated(t *testing.T) {
	w, _ := buildSample(t, 0)
	full := encode(t, w)
	f, err := Parse(full)
	if err != nil {
		t.Fatal(err)
	}
	var end uint64
	for _, ti := range f.Tensors {
		end = max(end, f.DataOffset+ti.Offset+ti.Size)
	}
	for n := range len(full) {
		g, err := Parse(full[:n])
		if uint64(n) >= end {
			if err != nil {
				t.Errorf("prefix %d (data ends at %d): %v", n, end, err)
			}
			continue
		}
		if err == nil {
			t.Fatalf("prefix %d of %d parsed: %d tensors", n, len(full), len(g.Tensors))
		}
		if !errors.Is(err, ErrFormat) || !strings.HasPrefix(err.Error(), "gguf: ") {
			t.Fatalf("prefix %d: %v", n, err)
		}
		if uint64(n) < f.DataOffset && !strings.Contains(err.Error(), "truncated") &&
			!strings.Contains(err.Error(), "exceeds") && !strings.Contains(err.Error(), "past end") {
			t.Errorf("prefix %d: error does not say the file is short: %v", n, err)
		}
	}
}

// TestHugeCountsDoNotAllocate checks that counts are validated before
// allocation: a tiny file claiming 2^60 elements must not allocate much.
func TestHugeCountsDoNotAllocate(t *testing.T) {
	inputs := [][]byte{
		header(0, 1).kv("k", ValueArray).u32(uint32(ValueUint64)).u64(1 << 60),
		header(0, 1).kv("k", ValueArray).u32(uint32(ValueString)).u64(1 << 60),
		header(0, 1).kv("k", ValueArray).u32(uint32(ValueArray)).u64(1 << 60),
		header(0, 1).kv("k", ValueString).u64(1 << 60),
		header(1<<60, 1<<60),
		header(1, 0).u64(1<<60).padTo(64, 0),
	}
	for i, in := range inputs {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := Parse(in)
		runtime.ReadMemStats(&after)
		if !errors.Is(err, ErrFormat) {
			t.Errorf("input %d: %v", i, err)
		}
		if d := after.TotalAlloc - before.TotalAlloc; d > 1<<20 {
			t.Errorf("input %d: allocated %d bytes", i, d)
		}
	}
}
