package serve

import (
	"context"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/kvcache/kvtest"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
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
	return runChatsGated(t, e, ss, maxTok, nil)
}

// runChatsGated is runChats where each session calls before(j), when it is
// not nil, ahead of its turn j: a test holds turns back with it to make the
// load at a given moment a fact rather than a matter of timing.
func runChatsGated(t *testing.T, e *Engine, ss []chat, maxTok int, before func(turn int)) [][][]int32 {
	t.Helper()
	out := make([][][]int32, len(ss))
	var wg sync.WaitGroup
	for i, s := range ss {
		out[i] = make([][]int32, len(s))
		wg.Go(func() {
			for j, p := range s {
				if before != nil {
					before(j)
				}
				st, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true})
				if err != nil {
					t.Error(err)
					return
				}
				var f Finish
				out[i][j], f = collect(t, st, 60*time.Second)
				if f.Reason != "length" {
					t.Errorf("chat %d turn %d: %s (engine: %s)", i, j, f.Reason, e.View().Snapshot().Err)
					return
				}
			}
		})
	}
	wg.Wait()
	return out
}

// checkTurns reports every turn whose tokens in got (what) differ from its
// tokens in want (ref).
func checkTurns(t *testing.T, got, want [][][]int32, what, ref string) {
	t.Helper()
	for i := range got {
		for j := range got[i] {
			if !slices.Equal(got[i][j], want[i][j]) {
				t.Errorf("chat %d turn %d: %s %v, %s %v", i, j, what, got[i][j], ref, want[i][j])
			}
		}
	}
}

// kvDigests records, per (room, rank), an FNV digest of the prompt KV a
// decode received (every layer's K, V, index-K rows and scales).
type kvDigests struct {
	mu  sync.Mutex
	got map[[2]uint64]uint64
}

func (d *kvDigests) hook(rank int, room uint64, pool *kvcache.Pool, slots []int32) {
	h := fnv.New64a()
	for _, b := range kvtest.SlotBytes(pool, slots) {
		h.Write(b)
	}
	d.mu.Lock()
	d.got[[2]uint64{room, uint64(rank)}] = h.Sum64()
	d.mu.Unlock()
}

// runPDChats is runSessions through a PD pair: turn j of chat i is room
// base+i*100+j (revisits j = turns).
func runPDChats(t *testing.T, pp *pdPair, ss []chat, maxTok int, base uint64) [][][]int32 {
	t.Helper()
	out := make([][][]int32, len(ss))
	turn := func(i, j int, p []int32) {
		toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true}, base+uint64(i*100+j))
		if dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
			t.Errorf("chat %d turn %d: decode %+v, prefill %+v", i, j, dfin, pfin)
		}
		out[i] = append(out[i], toks)
	}
	var wg sync.WaitGroup
	for i, s := range ss {
		wg.Go(func() {
			for j, p := range s {
				turn(i, j, p)
			}
		})
	}
	wg.Wait()
	for i, s := range ss {
		turn(i, len(s), s[len(s)-1])
	}
	return out
}

// A PD prefill with HiCache sends the KV and index-K a prefill without it
// sends, bit for bit: the decode's received prompt KV of every turn (every
// rank's shard) has the same digest, and the greedy tokens are the same,
// while the prefill really loaded prefixes back from host.
func TestHiCachePDSameKV(t *testing.T) {
	m := tinyModel(t)
	ss := sessions(41, 40, 5, 24, m.Config.VocabSize) // 200 requests, 40 revisits
	const maxTok = 3
	for _, ik := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, n := range []int{1, 2} {
			t.Run(fmt.Sprintf("%v/tp%d", ik, n), func(t *testing.T) {
				d := &kvDigests{got: map[[2]uint64]uint64{}}
				arrivedHook = d.hook
				t.Cleanup(func() { arrivedHook = nil })
				cfg := Config{TP: n, PageSize: 4, KVTokens: 512, MaxRunning: 4, MaxBatchTokens: 48, PrefillChunk: 16, IndexK: ik}
				off := newPDPair(t, cfg)
				want := runPDChats(t, off, ss, maxTok, 10000)
				on := cfg
				on.HiCache = HiCacheConfig{Enabled: true, Ratio: 8}
				pp := newPDPair(t, on)
				got := runPDChats(t, pp, ss, maxTok, 20000)
				checkTurns(t, got, want, "hicache on", "off")
				for i := range ss {
					for j := range got[i] {
						for r := range uint64(n) {
							a, b := d.got[[2]uint64{20000 + uint64(i*100+j), r}], d.got[[2]uint64{10000 + uint64(i*100+j), r}]
							if a == 0 || a != b {
								t.Errorf("chat %d turn %d rank %d: received KV digest %x with hicache, %x without", i, j, r, a, b)
							}
						}
					}
				}
				for _, ts := range pp.prefill.View().HiCache() {
					if ts.Totals.HostHits == 0 || ts.Totals.LoadFailures != 0 {
						t.Errorf("prefill rank %d: %+v", ts.Rank, ts.Totals)
					}
				}
				checkPools(t, pp.prefill)
				checkPools(t, pp.decode)
			})
		}
	}
}

// closeAndCheckCaches closes e and then, the loops gone, checks every
// rank's pool, prefix cache and host pool: nothing leaked on either tier.
func closeAndCheckCaches(t *testing.T, e *Engine) {
	t.Helper()
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	for _, l := range e.sup.loops {
		if err := l.rk.Pool().Check(); err != nil {
			t.Errorf("rank %d: %v", l.r, err)
		}
		if err := l.cache.Check(); err != nil {
			t.Errorf("rank %d: %v", l.r, err)
		}
		// Close checked the host tier against the cache before it gave
		// the pool's memory back.
		if h := l.cache.Host(); h != nil && !h.Closed() {
			t.Errorf("rank %d: the host pool still holds its memory after close", l.r)
		}
		if held := l.rk.Pool().TotalPages() - l.rk.Pool().FreePages() - l.cache.Pages(); held != 0 {
			t.Errorf("rank %d: %d device pages held outside the cache after every request ended", l.r, held)
		}
	}
}

// Turning HiCache off and on again and again under a 60-session load fails
// nothing and changes no output: every turn's greedy tokens equal the
// reference, and no page leaks on either tier. Then, the tier left on, the
// chats' last turns run again and revisit, so the tier is seen to load
// prefixes back after all the switching.
func TestHiCacheLiveToggles(t *testing.T) {
	m := tinyModel(t)
	ss := sessions(51, 60, 4, 24, m.Config.VocabSize)
	const maxTok = 3
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 6, MaxBatchTokens: 64, PrefillChunk: 16, IndexK: kernels.IndexBF16}
	want := runChats(t, newEngine(t, m, cfg), ss, maxTok)
	on := cfg
	// Selective: the 60 chats' histories are several times the host pool
	// and are revisited in order, a cyclic scan in which writing every
	// prefix through evicts each one from host just before it is revisited
	// (least recently used); backing up only the reused ones keeps hits.
	on.HiCache = HiCacheConfig{Enabled: true, Ratio: 8, Policy: prefix.WriteThroughSelective}
	before := hicache.MappedBytes()
	e := newEngine(t, m, on)
	stop := make(chan struct{})
	toggles := 0
	state := true
	set := func(v bool) bool {
		if err := e.SetHiCache(v); err != nil {
			t.Error(err)
			return false
		}
		if !waitfor.Check(t, "the hicache switch taking effect", 20*time.Second, func() bool {
			for _, ts := range e.View().HiCache() {
				if ts.On != v {
					return false
				}
			}
			return true
		}) {
			return false
		}
		// Off gives each rank's host memory back at once; on maps a pool
		// per rank again.
		var pools int64
		for _, l := range e.sup.cur().loops {
			if h := l.cache.Host(); v && h != nil {
				pools += h.Bytes()
			}
		}
		if got := hicache.MappedBytes() - before; got != pools || v == (pools == 0) {
			t.Errorf("hicache %v: %d host bytes mapped, want %d", v, got, pools)
		}
		return true
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			// Every 30 finished requests, so that the tier fills and
			// serves between switches.
			from := e.View().Snapshot().Totals.Finished
			for e.View().Snapshot().Totals.Finished < from+30 {
				select {
				case <-stop:
					return
				case <-time.After(time.Millisecond):
				}
			}
			state = !state
			toggles++
			if !set(state) {
				return
			}
		}
	})
	got := runChats(t, e, ss, maxTok)
	close(stop)
	wg.Wait()
	if !state && !set(true) {
		return
	}
	last := make([]chat, len(ss))
	for i, s := range ss {
		last[i] = s[len(s)-1:]
	}
	again := runSessions(t, e, last, maxTok)
	checkTurns(t, got, want, "with toggles", "reference")
	for i := range ss {
		for j := range again[i] {
			if w := want[i][len(ss[i])-1]; !slices.Equal(again[i][j], w) {
				t.Errorf("chat %d last turn, run %d after the toggles: %v, reference %v", i, j, again[i][j], w)
			}
		}
	}
	checkPools(t, e)
	var hits uint64
	for _, ts := range e.View().HiCache() {
		hits += ts.Totals.HostHits
		t.Logf("rank %d after %d toggles: %+v", ts.Rank, toggles, ts.Totals)
	}
	if toggles < 4 || hits == 0 {
		t.Errorf("%d toggles and %d host hits: the test did not exercise the tier", toggles, hits)
	}
	closeAndCheckCaches(t, e)
}

// Offload sends a cached prefix to host so that the next request loads it
// back (a canary's way to exercise the path), and NoCache computes a prompt
// from scratch: all three runs of the prompt give the same tokens, the
// second with a host hit, the third reading no cached token.
func TestOffloadAndNoCache(t *testing.T) {
	m := tinyModel(t)
	for _, n := range []int{1, 2} {
		t.Run(fmt.Sprint("tp", n), func(t *testing.T) {
			e := newEngine(t, m, Config{TP: n, PageSize: 4, KVTokens: 256, IndexK: kernels.IndexBF16,
				HiCache: HiCacheConfig{Enabled: true, Ratio: 2}})
			p := testmodel.Prompts(81, 1, 30, 30, m.Config.VocabSize)[0]
			run := func(noCache bool) []int32 {
				s, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: 4, IgnoreEOS: true, NoCache: noCache})
				if err != nil {
					t.Fatal(err)
				}
				toks, _ := collect(t, s, 20*time.Second)
				return toks
			}
			first := run(false)
			got, err := e.Offload(context.Background(), p)
			if err != nil || got < 24 {
				t.Fatalf("Offload = %d tokens, %v; want the prompt's whole pages", got, err)
			}
			hits := func() (h uint64) {
				for _, ts := range e.View().HiCache() {
					h += ts.Totals.HostHits
				}
				return h
			}
			before, cached := hits(), e.View().Snapshot().Totals.CachedTokens
			if second := run(false); !slices.Equal(second, first) || hits() != before+uint64(n) {
				t.Fatalf("after the offload: %v (first %v), host hits %d → %d", second, first, before, hits())
			}
			cached2 := e.View().Snapshot().Totals.CachedTokens
			if cached2 <= cached {
				t.Fatal("the request after the offload read nothing cached")
			}
			if third := run(true); !slices.Equal(third, first) || e.View().Snapshot().Totals.CachedTokens != cached2 {
				t.Fatalf("no-cache run: %v (first %v), cached tokens %d → %d", third, first, cached2, e.View().Snapshot().Totals.CachedTokens)
			}
			checkPools(t, e)
		})
	}
}
