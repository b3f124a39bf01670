package cpu

import (
	"fmt"
	"testing"

	"github.com/pdkit/pdkit/kernels/kerneltest"
)

func TestConformance(t *testing.T) {
	for _, threads := range []int{1, 2, 3} {
		t.Run(fmt.Sprintf("threads=%d", threads), func(t *testing.T) {
			b := New(threads)
			defer b.Close()
			kerneltest.Run(t, b)
		})
	}
	// Every call cut into as many parts as allowed, even tiny ones.
	t.Run("threads=3/split", func(t *testing.T) {
		b := New(3)
		defer b.Close()
		b.minWork = 1
		kerneltest.Run(t, b)
	})
	// The AVX2 kernels alone, as machines without AVX-512 run them.
	t.Run("avx2/threads=2", func(t *testing.T) {
		b := testBackend(2, "avx2")
		defer b.Close()
		b.minWork = 1
		kerneltest.Run(t, b)
	})
	// The portable kernels that non-AVX2 machines run.
	t.Run("portable/threads=2", func(t *testing.T) {
		b := newBackend(2, true)
		defer b.Close()
		b.minWork = 1
		kerneltest.Run(t, b)
	})
}
