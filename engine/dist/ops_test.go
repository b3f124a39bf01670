package dist

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
)

// randF32 gives values of mixed sign and magnitude, so that the order of a
// float sum shows in its bits.
func randF32(rng *rand.Rand, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(7)-3)))
	}
	return out
}

// rankOrderSum is the reference: element-wise, rank 0 + rank 1 + … in order.
func rankOrderSum(in [][]float32) []float32 {
	out := slices.Clone(in[0])
	for _, x := range in[1:] {
		for i, v := range x {
			out[i] += v
		}
	}
	return out
}

func bitsEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

func TestOpsGiveTheReferenceResultOnEveryRank(t *testing.T) {
	for _, size := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("ranks=%d", size), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(size)))
			const n = 37
			f := make([][]float32, size)
			ints := make([][]int64, size)
			blobs := make([][]byte, size)
			for r := range size {
				f[r] = randF32(rng, n)
				ints[r] = make([]int64, n)
				for i := range ints[r] {
					ints[r][i] = rng.Int64N(1000) - 500
				}
				blobs[r] = make([]byte, 10+r)
				for i := range blobs[r] {
					blobs[r][i] = byte(rng.UintN(256))
				}
			}
			wantSum := rankOrderSum(f)
			wantMin, wantMax := slices.Clone(f[0]), slices.Clone(f[0])
			wantMinI, wantMaxI := slices.Clone(ints[0]), slices.Clone(ints[0])
			var wantGather []float32
			for r := range size {
				for i := range n {
					wantMin[i] = min(wantMin[i], f[r][i])
					wantMax[i] = max(wantMax[i], f[r][i])
					wantMinI[i] = min(wantMinI[i], ints[r][i])
					wantMaxI[i] = max(wantMaxI[i], ints[r][i])
				}
				wantGather = append(wantGather, f[r]...)
			}
			root := size - 1

			var entered atomic.Int32
			g := newGroup(t, size, Options{})
			errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
				r := c.Rank()
				check := func(what string, ok bool) {
					if !ok {
						t.Errorf("rank %d: %s differs from the reference", r, what)
					}
				}
				buf := slices.Clone(f[r])
				if err := c.AllReduceSum(ctx, buf); err != nil {
					return err
				}
				check("AllReduceSum", bitsEqual(buf, wantSum))
				buf = slices.Clone(f[r])
				if err := c.AllReduceMin(ctx, buf); err != nil {
					return err
				}
				check("AllReduceMin", bitsEqual(buf, wantMin))
				buf = slices.Clone(f[r])
				if err := c.AllReduceMax(ctx, buf); err != nil {
					return err
				}
				check("AllReduceMax", bitsEqual(buf, wantMax))
				ib := slices.Clone(ints[r])
				if err := c.AllReduceMinInt(ctx, ib); err != nil {
					return err
				}
				check("AllReduceMinInt", slices.Equal(ib, wantMinI))
				ib = slices.Clone(ints[r])
				if err := c.AllReduceMaxInt(ctx, ib); err != nil {
					return err
				}
				check("AllReduceMaxInt", slices.Equal(ib, wantMaxI))
				buf = slices.Clone(f[r])
				if err := c.Broadcast(ctx, root, buf); err != nil {
					return err
				}
				check("Broadcast", bitsEqual(buf, f[root]))
				var data []byte
				if r == root {
					data = slices.Clone(blobs[r])
				}
				got, err := c.BroadcastBytes(ctx, root, data)
				if err != nil {
					return err
				}
				check("BroadcastBytes", bytes.Equal(got, blobs[root]))
				out := make([]float32, size*n)
				if err := c.AllGather(ctx, slices.Clone(f[r]), out); err != nil {
					return err
				}
				check("AllGather", bitsEqual(out, wantGather))
				entered.Add(1)
				if err := c.Barrier(ctx); err != nil {
					return err
				}
				check("Barrier (a rank left before all entered)", entered.Load() == int32(size))
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
			for _, rs := range g.Snapshot().Ranks {
				if rs.LastEntered != 9 || rs.LastCompleted != 9 || rs.Waiting != nil {
					t.Errorf("rank %d: entered %d completed %d waiting %v, want 9, 9, nil",
						rs.Rank, rs.LastEntered, rs.LastCompleted, rs.Waiting)
				}
			}
		})
	}
}

func TestBroadcastBytesGivesEachRankItsOwnCopy(t *testing.T) {
	g := newGroup(t, 3, Options{})
	got := make([][]byte, 3)
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		var data []byte
		if c.Rank() == 0 {
			data = []byte("plan")
		}
		b, err := c.BroadcastBytes(ctx, 0, data)
		got[c.Rank()] = b
		return err
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	got[1][0] = 'X'
	if string(got[2]) != "plan" || string(got[0]) != "plan" {
		t.Errorf("a rank's result changed when another's was written: %q %q", got[0], got[2])
	}
}

func TestNaNWinsMinAndMax(t *testing.T) {
	g := newGroup(t, 2, Options{})
	nan := float32(math.NaN())
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		buf := []float32{1, 1}
		buf[c.Rank()] = nan
		if err := c.AllReduceMin(ctx, buf); err != nil {
			return err
		}
		if buf[0] == buf[0] || buf[1] == buf[1] {
			t.Errorf("rank %d: min %v, want NaN, NaN", c.Rank(), buf)
		}
		buf = []float32{1, 1}
		buf[c.Rank()] = nan
		if err := c.AllReduceMax(ctx, buf); err != nil {
			return err
		}
		if buf[0] == buf[0] || buf[1] == buf[1] {
			t.Errorf("rank %d: max %v, want NaN, NaN", c.Rank(), buf)
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// permutations returns every order of 0..n-1.
func permutations(n int) [][]int {
	if n == 1 {
		return [][]int{{0}}
	}
	var out [][]int
	for _, p := range permutations(n - 1) {
		for i := 0; i <= len(p); i++ {
			q := append(append(slices.Clone(p[:i]), n-1), p[i:]...)
			out = append(out, q)
		}
	}
	return out
}

func TestAllReduceSumIsRankOrderWhateverTheArrivalOrder(t *testing.T) {
	const size, n = 4, 4096
	rng := rand.New(rand.NewPCG(7, 7))
	in := make([][]float32, size)
	for r := range in {
		in[r] = randF32(rng, n)
	}
	want := rankOrderSum(in)
	// The data must be such that order matters, or the test proves nothing.
	rev := slices.Clone(in)
	slices.Reverse(rev)
	if bitsEqual(rankOrderSum(rev), want) {
		t.Fatal("reverse-order sum equals rank-order sum; pick data where order shows")
	}

	orders := permutations(size)
	g := newGroup(t, size, Options{})
	results := make([][][]float32, len(orders)) // [order][rank]
	for i := range results {
		results[i] = make([][]float32, size)
	}
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		for i, order := range orders {
			seq := uint64(i + 1)
			pos := slices.Index(order, c.Rank())
			// Enter only after the ranks before this one in order are waiting.
			if err := waitArrived(g, seq, order[:pos]...); err != nil {
				return err
			}
			buf := slices.Clone(in[c.Rank()])
			if err := c.AllReduceSum(ctx, buf); err != nil {
				return err
			}
			results[i][c.Rank()] = buf
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for i, order := range orders {
		for r := range size {
			if !bitsEqual(results[i][r], want) {
				t.Errorf("arrival order %v: rank %d's sum is not the rank-order sum", order, r)
			}
		}
	}
}

func TestRanksMayReuseAndMutateTheirBuffersAfterACall(t *testing.T) {
	// A fast rank that returns and overwrites its buffer must not change what
	// a slower rank copies out of the same round.
	const size, n, rounds = 4, 300, 200
	g := newGroup(t, size, Options{})
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		buf := make([]float32, n)
		for k := range rounds {
			for i := range buf {
				buf[i] = float32(k*size + c.Rank())
			}
			if err := c.AllReduceSum(ctx, buf); err != nil {
				return err
			}
			want := float32(k*size*size + size*(size-1)/2)
			for i := range buf {
				if buf[i] != want {
					t.Errorf("rank %d round %d: buf[%d] = %v, want %v", c.Rank(), k, i, buf[i], want)
					return nil
				}
				buf[i] = -1
			}
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}
