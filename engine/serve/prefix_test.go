package serve

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/testmodel"
)

// sharedPrompts are n prompts that start with the same system prefix of
// prefixLen tokens and end with their own suffixes.
func sharedPrompts(seed uint64, n, prefixLen, vocab int) [][]int32 {
	sys := testmodel.Prompts(seed, 1, prefixLen, prefixLen+1, vocab)[0][:prefixLen]
	var out [][]int32
	for _, tail := range testmodel.Prompts(seed+1, n, 2, 12, vocab) {
		out = append(out, append(slices.Clone(sys), tail...))
	}
	return out
}

// generateAll runs the prompts in two waves (so the second can hit the
// cache the first filled) and returns the tokens of each.
func generateAll(t *testing.T, e *Engine, ps [][]int32, maxTok int) [][]int32 {
	t.Helper()
	out := make([][]int32, len(ps))
	half := len(ps) / 2
	for _, wave := range [][2]int{{0, half}, {half, len(ps)}} {
		var wg sync.WaitGroup
		for i := wave[0]; i < wave[1]; i++ {
			wg.Go(func() {
				s, err := e.Submit(context.Background(), Request{Prompt: ps[i], MaxTokens: maxTok, IgnoreEOS: true})
				if err != nil {
					t.Error(err)
					return
				}
				out[i], _ = collect(t, s, 20*time.Second)
			})
		}
		wg.Wait()
	}
	return out
}

// The prefix cache changes what is computed, never what is generated: the
// same prompts give the same greedy tokens with the cache on and off, at
// TP=1 and TP=2, with a pool small enough to evict and retract.
func TestPrefixCacheOnOffEqual(t *testing.T) {
	m := tinyModel(t)
	ps := sharedPrompts(21, 12, 37, m.Config.VocabSize)
	const maxTok = 10
	for _, n := range []int{1, 2} {
		t.Run(fmt.Sprint("tp", n), func(t *testing.T) {
			cfg := Config{TP: n, PageSize: 4, KVTokens: 200, MaxRunning: 4, MaxBatchTokens: 32, PrefillChunk: 9}
			off := cfg
			off.DisablePrefixCache = true
			eOff := newEngine(t, m, off)
			want := generateAll(t, eOff, ps, maxTok)
			if tot := eOff.View().Snapshot().Totals; tot.CachedTokens != 0 || tot.PrefixHits != 0 {
				t.Errorf("cache off: totals %+v", tot)
			}
			checkPools(t, eOff)

			eOn := newEngine(t, m, cfg)
			got := generateAll(t, eOn, ps, maxTok)
			for i := range ps {
				if !slices.Equal(got[i], want[i]) {
					t.Errorf("prompt %d: cache on %v, off %v", i, got[i], want[i])
				}
			}
			tot := eOn.View().Snapshot().Totals
			t.Logf("cache on: %+v", tot)
			if tot.PrefixHits == 0 || tot.CachedTokens < uint64(len(ps)/2*36) {
				t.Errorf("the second wave did not read its 36-token prefix from the cache: %+v", tot)
			}
			if tot.PrefixEvictions == 0 {
				t.Error("no eviction: the pool was meant to run short")
			}
			checkPools(t, eOn)
			used, cached, _ := eOn.View().KVPages(0)
			if cached == 0 || used != cached {
				t.Errorf("idle engine: %d pages used, %d cached; want all used pages cached", used, cached)
			}
		})
	}
}

// After every iteration the ranks agree: same step, same plan digest, same
// sequence number on each communicator.
func TestRanksAgreeEachStep(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 24, PrefillChunk: 6})
	ps := testmodel.Prompts(5, 6, 4, 20, m.Config.VocabSize)
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(func() {
			s, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true})
			if err != nil {
				t.Error(err)
				return
			}
			collect(t, s, 20*time.Second)
		})
	}
	wg.Wait()
	checkPools(t, e) // every rank has passed the last busy step
	// Poll until both ranks published the same iteration (they may be one
	// idle iteration apart when read).
	var recs []StepRecord
	poll(t, "ranks at the same step", 10*time.Second, func() bool {
		recs = e.View().RankSteps()
		return recs[0].Step == recs[1].Step
	})
	if recs[0].Digest != recs[1].Digest || recs[0].ControlSeq != recs[1].ControlSeq || recs[0].ForwardSeq != recs[1].ForwardSeq ||
		recs[0].ControlSeq == 0 || recs[0].ForwardSeq == 0 {
		t.Errorf("ranks disagree: %+v vs %+v", recs[0], recs[1])
	}
	// Both communicators, control first, each with its own flight
	// recorders and wait totals.
	snaps := e.View().Collectives()
	if len(snaps) != 2 || snaps[0].Name != CommControl || snaps[1].Name != CommForward {
		t.Fatalf("communicators %+v", snaps)
	}
	for _, snap := range snaps {
		if snap.Broken != "" || len(snap.Ranks) != 2 {
			t.Fatalf("%s group %+v", snap.Name, snap)
		}
		for _, r := range snap.Ranks {
			if len(r.Records) == 0 {
				t.Errorf("%s rank %d: empty flight recorder", snap.Name, r.Rank)
			}
		}
		for r := range 2 {
			if e.View().CollectiveWait(snap.Name, r) <= 0 {
				t.Errorf("%s rank %d: collective wait %v", snap.Name, r, e.View().CollectiveWait(snap.Name, r))
			}
		}
	}
	if e.View().CollectiveWait("nonesuch", 0) != 0 {
		t.Error("a communicator that does not exist has a wait")
	}
}
