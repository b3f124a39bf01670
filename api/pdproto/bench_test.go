package pdproto

import "testing"

// The KV_CHUNK benchmarks move a 1 MiB chunk (8 layers of K, V, index-K and
// scales). B/op and allocs/op stay at a few hundred bytes and a handful of
// allocations whatever the payload size: the payload frames are neither
// copied by Encode nor by Decode. SetBytes makes MB/s the payload rate.

func BenchmarkEncodeKVChunk1MiB(b *testing.B) {
	c := bigChunk(8, 1<<20)
	b.SetBytes(int64(c.PayloadBytes()))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Encode(c); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeKVChunk1MiB(b *testing.B) {
	c := bigChunk(8, 1<<20)
	frames := mustEncode(b, c)
	b.SetBytes(int64(c.PayloadBytes()))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(frames); err != nil {
			b.Fatal(err)
		}
	}
}

// TestKVChunkDoesNotCopyPayload pins what the benchmarks show: encoding and
// decoding a 1 MiB chunk allocates a few small objects, not the payload.
func TestKVChunkDoesNotCopyPayload(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation counts")
	}
	c := bigChunk(8, 1<<20)
	frames := mustEncode(t, c)
	if n := testing.AllocsPerRun(20, func() { Encode(c) }); n > 3 {
		t.Errorf("Encode: %v allocs per 1 MiB chunk, want ≤ 3", n)
	}
	if n := testing.AllocsPerRun(20, func() { Decode(frames) }); n > 4 {
		t.Errorf("Decode: %v allocs per 1 MiB chunk, want ≤ 4", n)
	}
}
