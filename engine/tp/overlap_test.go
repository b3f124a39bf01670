package tp_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/tp"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// Run, between Begin and End, may run on its own goroutine while the pool's
// owner changes other sequences (the overlap schedule's pattern): at TP 2,
// each rank's owner releases one sequence and starts and reserves another
// while that rank's forward pass runs, and the logits are bit for bit those
// of the same step run with Forward; the race detector (with the pool's
// self-checks on) sees nothing.
func TestRunBesideTheOwner(t *testing.T) {
	m := testmodel.Open(t, tiny(model.ArchLlamaDSA))
	ps := prompts(91, 3, m.Config.VocabSize)
	want := stepLogits(t, m, ps, func(rk *tp.Rank, batch []tp.Input) error { return rk.Forward(context.Background(), batch, nil) })
	got := stepLogits(t, m, ps, func(rk *tp.Rank, batch []tp.Input) error {
		ctx := context.Background()
		if err := rk.Begin(ctx, batch, nil); err != nil {
			return err
		}
		done := make(chan error, 1)
		go func() { done <- rk.Run(ctx) }()
		pool := rk.Pool()
		// Meanwhile, on the owner's goroutine: another sequence goes and
		// a new one takes pages.
		s, ok := pool.Seq(100)
		if !ok {
			return errMissing
		}
		if err := pool.Release(s); err != nil {
			return err
		}
		n, err := pool.NewSeq(101)
		if err != nil {
			return err
		}
		if err := pool.Reserve(n, 3*pageSize); err != nil {
			return err
		}
		if err := <-done; err != nil {
			return err
		}
		if err := pool.Release(n); err != nil {
			return err
		}
		return rk.End()
	})
	for r := range want {
		if !slices.Equal(got[r], want[r]) {
			t.Fatalf("rank %d: the logits differ when Run overlaps the owner's changes", r)
		}
	}
}

var errMissing = errors.New("tp: the spare sequence is missing")

// stepLogits prefills ps on TP 2 shards (plus a spare sequence 100 of 8
// tokens) with step, one goroutine per rank, and returns each rank's logits.
func stepLogits(t *testing.T, m *model.Model, ps [][]int32, step func(*tp.Rank, []tp.Input) error) [][]float32 {
	t.Helper()
	sh, err := tp.NewShards(m, tp.Options{Ranks: 2, Backend: func(int) kernels.Backend { return cpu.New(1) },
		PageSize: pageSize, KVTokens: kvTokens, MaxSeqs: maxSeqs + 2, IndexK: kernels.IndexBF16})
	if err != nil {
		t.Fatal(err)
	}
	defer sh.Close()
	out := make([][]float32, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			rk := sh.Rank(r)
			spare := []tp.Input{{SeqID: 100, Tokens: ps[0][:8]}}
			if err := rk.Forward(context.Background(), spare, nil); err != nil {
				t.Error(err)
				return
			}
			var batch []tp.Input
			for i, p := range ps {
				batch = append(batch, tp.Input{SeqID: uint64(i + 1), Tokens: p, NumLogits: 1})
			}
			if err := step(rk, batch); err != nil {
				t.Error(err)
				return
			}
			out[r] = slices.Clone(rk.Logits())
		})
	}
	wg.Wait()
	return out
}
