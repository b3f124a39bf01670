package dist

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
)

var benchShapes = []struct{ ranks, n int }{{2, 288}, {2, 32000}, {4, 288}, {4, 32000}}

// BenchmarkAllReduceSum: one op is one AllReduceSum on every rank (the
// benchmark goroutine is rank 0).
func BenchmarkAllReduceSum(b *testing.B) {
	for _, sh := range benchShapes {
		b.Run(fmt.Sprintf("ranks=%d/n=%d", sh.ranks, sh.n), func(b *testing.B) {
			g := newGroup(b, sh.ranks, Options{})
			ctx := context.Background()
			rng := rand.New(rand.NewPCG(1, 2))
			bufs := make([][]float32, sh.ranks)
			for r := range bufs {
				bufs[r] = randF32(rng, sh.n)
			}
			iters := b.N
			var wg sync.WaitGroup
			for r := 1; r < sh.ranks; r++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range iters {
						if err := g.Rank(r).AllReduceSum(ctx, bufs[r]); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			b.SetBytes(int64(4 * sh.n))
			b.ResetTimer()
			for range iters {
				if err := g.Rank(0).AllReduceSum(ctx, bufs[0]); err != nil {
					b.Fatal(err)
				}
			}
			wg.Wait()
		})
	}
}

// BenchmarkRankOrderSum is the arithmetic alone, for comparison: the same
// rank-order sum into a result buffer, and no copies back to the ranks.
func BenchmarkRankOrderSum(b *testing.B) {
	for _, sh := range benchShapes {
		b.Run(fmt.Sprintf("ranks=%d/n=%d", sh.ranks, sh.n), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 2))
			bufs := make([][]float32, sh.ranks)
			for r := range bufs {
				bufs[r] = randF32(rng, sh.n)
			}
			var scratch []float32
			b.SetBytes(int64(4 * sh.n))
			for b.Loop() {
				reduceRanks(OpAllReduceSum, &scratch, sh.n, sh.ranks, func(r int) []float32 { return bufs[r] })
			}
		})
	}
}
