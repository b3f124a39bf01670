package serve

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// The workload HiCache exists for: many sessions whose prefixes leave
// the device before they come back. Twelve distinct 249-token prompts,
// each sent three times in rounds, four at a time, on a device pool of
// 512 tokens (two such prompts) with a host tier 8 times as large: under
// the default policy, write-through, every prefix is backed up when it is
// cached, so the second and third rounds load back from host; under
// write-through-selective nothing is reused on the device before it is
// evicted, so nothing reaches the host; under write-back the evictions
// back it up. Every output is the one computed with HiCache off.
func TestHiCacheWritePolicies(t *testing.T) {
	m := tinyModel(t)
	prompts := testmodel.Prompts(26, 12, 249, 250, m.Config.VocabSize)
	const rounds, maxTok = 3, 4
	cfg := Config{PageSize: 4, KVTokens: 512, MaxRunning: 4}
	run := func(e *Engine) [][]int32 {
		out := make([][]int32, rounds*len(prompts))
		for r := range rounds {
			next := make(chan int, len(prompts))
			for i := range prompts {
				next <- i
			}
			close(next)
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					for i := range next {
						st, err := e.Submit(context.Background(), Request{Prompt: prompts[i], MaxTokens: maxTok, IgnoreEOS: true})
						if err != nil {
							t.Error(err)
							return
						}
						out[r*len(prompts)+i], _ = collect(t, st, 60*time.Second)
					}
				})
			}
			wg.Wait()
		}
		return out
	}
	want := run(newEngine(t, m, cfg))
	for _, tc := range []struct {
		policy  prefix.Policy
		minHits uint64 // host hits at least
		maxHits uint64 // and at most
	}{
		{prefix.WriteThrough, 20, 24},
		{prefix.WriteThroughSelective, 0, 0},
		{prefix.WriteBack, 20, 24},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			on := cfg
			on.HiCache = HiCacheConfig{Enabled: true, Ratio: 8, Policy: tc.policy}
			e := newEngine(t, m, on)
			got := run(e)
			for i := range want {
				if !slices.Equal(got[i], want[i]) {
					t.Errorf("request %d (prompt %d, round %d): %v, with HiCache off %v", i, i%len(prompts), i/len(prompts), got[i], want[i])
				}
			}
			// Rank 0 publishes its tier before the engine snapshot that
			// counts the last request finished.
			waitfor.For(t, "every request's end published", 20*time.Second, func() bool {
				snap := e.View().Snapshot()
				return snap != nil && snap.Totals.Finished >= uint64(len(want))
			})
			ts := e.View().HiCache()[0]
			if h := ts.Totals.HostHits; h < tc.minHits || h > tc.maxHits {
				t.Errorf("%d host hits (%d tokens), %d backups; want %d to %d hits", h, ts.Totals.HitTokens, ts.Totals.Backups, tc.minHits, tc.maxHits)
			}
			t.Logf("%v: %d host hits, %d tokens loaded, %d backups (%d bytes)", tc.policy, ts.Totals.HostHits, ts.Totals.HitTokens, ts.Totals.Backups, ts.Totals.BackupBytes)
		})
	}
}
