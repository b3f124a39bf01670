package serve

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// chat is a scripted multi-turn conversation: every turn's prompt is the
// previous prompt plus a scripted reply and a new user message, so that
// references can be computed up front.
type chat [][]int32

// sessions are n conversations of turns turns over one shared system
// prefix of sysLen tokens.
func sessions(seed uint64, n, turns, sysLen, vocab int) []chat {
	sys := testmodel.Prompts(seed, 1, sysLen, sysLen+1, vocab)[0][:sysLen]
	out := make([]chat, n)
	for i := range out {
		prompt := slices.Clone(sys)
		for j, msg := range testmodel.Prompts(seed+1+uint64(i), turns, 6, 14, vocab) {
			prompt = append(prompt, msg...)
			out[i] = append(out[i], slices.Clone(prompt))
			_ = j
		}
	}
	return out
}

// runSessions runs the chats concurrently, each turn after the previous
// one of its chat, then revisits every chat's last turn one chat at a time
// (one extra turn each), by when most chats' histories have been evicted
// from the small device pool; it returns every turn's greedy tokens.
func runSessions(t *testing.T, e *Engine, ss []chat, maxTok int) [][][]int32 {
	t.Helper()
	out := runChats(t, e, ss, maxTok)
	for i, s := range ss {
		again := runChats(t, e, []chat{s[len(s)-1:]}, maxTok)
		out[i] = append(out[i], again[0]...)
	}
	return out
}

func runChats(t *testing.T, e *Engine, ss []chat, maxTok int) [][][]int32 {
	t.Helper()
	out := make([][][]int32, len(ss))
	var wg sync.WaitGroup
	for i, s := range ss {
		out[i] = make([][]int32, len(s))
		wg.Go(func() {
			for j, p := range s {
				st, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true})
				if err != nil {
					t.Error(err)
					return
				}
				var f Finish
				out[i][j], f = collect(t, st, 60*time.Second)
				if f.Reason != "length" {
					t.Errorf("chat %d turn %d: %s (engine: %s)", i, j, f.Reason, e.Snapshot().Err)
					return
				}
			}
		})
	}
	wg.Wait()
	return out
}

// HiCache changes where a cached prefix comes from, never what is generated:
// 200 multi-turn requests whose histories are evicted from a small device pool
// to the host tier and loaded back give the same greedy tokens as with the
// tier off, at TP 1 and 2, with fp8 and bf16 index keys, and the tier
// really loaded prefixes back.
func TestHiCacheOnOffEqual(t *testing.T) {
	m := tinyModel(t)
	ss := sessions(31, 40, 5, 24, m.Config.VocabSize) // 200 requests, 40 revisits
	const maxTok = 4
	for _, ik := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, n := range []int{1, 2} {
			t.Run(fmt.Sprintf("%v/tp%d", ik, n), func(t *testing.T) {
				cfg := Config{TP: n, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 48, PrefillChunk: 16, IndexK: ik}
				want := runSessions(t, newEngine(t, m, cfg), ss, maxTok)
				on := cfg
				on.HiCache = HiCacheConfig{Enabled: true, Ratio: 8}
				e := newEngine(t, m, on)
				got := runSessions(t, e, ss, maxTok)
				for i := range ss {
					for j := range got[i] {
						if !slices.Equal(got[i][j], want[i][j]) {
							t.Errorf("chat %d turn %d: hicache on %v, off %v", i, j, got[i][j], want[i][j])
						}
					}
				}
				checkPools(t, e)
				for _, ts := range e.HiCache() {
					t.Logf("rank %d: %+v", ts.Rank, ts.Totals)
					if !ts.On || ts.Totals.HostHits == 0 || ts.Totals.Loads == 0 || ts.Totals.Backups == 0 {
						t.Errorf("rank %d: no prefix went to host and came back: %+v", ts.Rank, ts)
					}
					if ts.Totals.LoadFailures != 0 || len(ts.Loads) != 0 {
						t.Errorf("rank %d: load failures or loads left: %+v", ts.Rank, ts)
					}
				}
			})
		}
	}
}
