//go:build amd64

package cpu

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

// BenchmarkFMAPeak measures this machine's FMA peak: independent FMA
// chains on zmm and ymm registers, on 1 and 2 goroutines at once (two
// separate cores give twice the one-thread figure).
func BenchmarkFMAPeak(b *testing.B) {
	if !hasAVX512GEMM {
		b.Skip("no AVX-512 (F, DQ, VL)")
	}
	const iters = 1 << 18
	for _, reg := range []struct {
		name  string
		lanes int
		run   func(int)
	}{{"zmm", 16, fmaPeakZ}, {"ymm", 8, fmaPeakY}} {
		for _, threads := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/threads=%d", reg.name, threads), func(b *testing.B) {
				for b.Loop() {
					var wg sync.WaitGroup
					for range threads {
						wg.Go(func() { reg.run(iters) })
					}
					wg.Wait()
				}
				sec := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(float64(threads*iters*24*2*reg.lanes)/sec/1e9, "GFLOP/s")
			})
		}
	}
}

// gemmShapes are the prefill projections (n×k) of the small model (dim
// 288, hidden 768) and the medium one (dim 768, hidden 2048), and their
// vocabulary projections (32000).
var gemmShapes = []struct{ n, k int }{
	{288, 288}, {768, 288}, {288, 768}, {32000, 288},
	{768, 768}, {2048, 768}, {768, 2048}, {32000, 768},
}

// BenchmarkGEMM compares the AVX-512 prefill kernel with the AVX2 one at
// m = 512 (a prompt) and 32 (a decode batch), F32 weights, side by side in
// the same run.
func BenchmarkGEMM(b *testing.B) {
	if !hasAVX512GEMM {
		b.Skip("no AVX-512 (F, DQ, VL)")
	}
	for _, s := range gemmShapes {
		w := benchMatrix(kernels.F32, s.n, s.k)
		for _, m := range []int{32, 512} {
			benchGEMM(b, w, m)
		}
	}
}

// benchGEMM runs both kernel sets on w at m rows, 1 and 2 threads.
func benchGEMM(b *testing.B, w *kernels.Matrix, m int) {
	x := randVec(rand.New(rand.NewPCG(9, 9)), m*w.Cols, 1)
	dst := make([]float32, m*w.Rows)
	for _, threads := range []int{1, 2} {
		for _, set := range []string{"avx2", "avx512"} {
			b.Run(fmt.Sprintf("%dx%d/m=%d/threads=%d/%s", w.Rows, w.Cols, m, threads, set), func(b *testing.B) {
				be := New(threads)
				defer be.Close()
				if set == "avx2" {
					avx2Only(be)
				}
				for b.Loop() {
					be.MatMul(dst, x, w, m)
				}
				reportMatMul(b, w, m)
			})
		}
	}
}
