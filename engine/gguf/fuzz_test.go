package gguf

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// FuzzParse checks that Parse never panics, that every error wraps
// ErrFormat, and that every file it accepts is internally consistent and
// survives a Writer round trip unchanged. Plain `go test` runs only the
// seeds; run it for real with
//
//	go test -run XXX -fuzz FuzzParse -fuzztime 60s ./engine/gguf
func FuzzParse(f *testing.F) {
	w, _ := buildSample(f, 0)
	f.Add(encode(f, w))
	small := NewWriter()
	small.SetAlignment(8)
	small.Add("general.architecture", "llama")
	small.Add("a", []any{[]int32{1}, []any{}})
	if err := small.AddTensor("t", TypeQ8_0, []uint64{32}, make([]byte, 34)); err != nil {
		f.Fatal(err)
	}
	f.Add(encode(f, small))
	f.Add([]byte(header(2, 2).kv("general.alignment", ValueUint32).u32(64).kv("n", ValueBool).u8(1).
		tensor("a", TypeF32, 0, 4).tensor("b", TypeBF16, 64, 2, 2).padTo(64, 72)))
	f.Add([]byte("GGUF"))

	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := Parse(data)
		if err != nil {
			if !errors.Is(err, ErrFormat) || !strings.HasPrefix(err.Error(), "gguf: ") {
				t.Fatalf("error without ErrFormat: %v", err)
			}
			return
		}
		if file.DataOffset%file.Alignment != 0 {
			t.Fatalf("DataOffset %d not aligned to %d", file.DataOffset, file.Alignment)
		}
		for i := range file.Tensors {
			ti := &file.Tensors[i]
			d, err := file.TensorData(ti.Name)
			if err != nil {
				t.Fatal(err)
			}
			if uint64(len(d)) != ti.Size {
				t.Fatalf("tensor %q: %d bytes, Size %d", ti.Name, len(d), ti.Size)
			}
			if n, err := TensorBytes(ti.Type, ti.Shape); err != nil || n != ti.Size {
				t.Fatalf("tensor %q: TensorBytes %d, %v; Size %d", ti.Name, n, err, ti.Size)
			}
		}
		// A legal but absurd alignment (up to 2^31) makes the re-encoded
		// file that large, since the Writer pads after the header; that
		// costs the fuzzer seconds per input and tests nothing new.
		if file.Alignment > 1<<16 {
			return
		}
		// Re-encoding is stable: encode(parse(x)) is a fixed point.
		b1 := encode(t, rewriter(t, file))
		file2, err := Parse(b1)
		if err != nil {
			t.Fatalf("re-encoded file does not parse: %v", err)
		}
		if b2 := encode(t, rewriter(t, file2)); !bytes.Equal(b1, b2) {
			t.Fatal("re-encoding is not stable")
		}
		if len(file2.KVs) != len(file.KVs) || len(file2.Tensors) != len(file.Tensors) {
			t.Fatal("re-encoded file lost entries")
		}
		for _, ti := range file.Tensors {
			d1, _ := file.TensorData(ti.Name)
			d2, err := file2.TensorData(ti.Name)
			if err != nil || !bytes.Equal(d1, d2) {
				t.Fatalf("tensor %q: data changed in round trip (%v)", ti.Name, err)
			}
		}
	})
}
