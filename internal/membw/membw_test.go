package membw

import (
	"math/rand/v2"
	"testing"
)

// TestReadBlocksMatchesGo: the vector reader depends on every byte as the
// plain one does: both give the same XOR of the buffer's 8-byte words.
func TestReadBlocksMatchesGo(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{block, 2 * block, 37 * block} {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		want := readBlocksGo(b)
		if got := readBlocks(b); got != want {
			t.Fatalf("%d bytes: %#x, want %#x", n, got, want)
		}
		b[n-1] ^= 0x80 // the last byte counts
		if readBlocks(b) == want {
			t.Fatalf("%d bytes: the last byte changed nothing", n)
		}
	}
}

func TestReadMeasures(t *testing.T) {
	if bw := Read(1<<20, 2, 3); bw <= 0 {
		t.Fatalf("bandwidth %v", bw)
	}
}

func BenchmarkRead(b *testing.B) {
	for b.Loop() {
		Read(64<<20, 1, 1)
	}
}
