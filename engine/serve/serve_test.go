package serve

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

func tinyModel(t *testing.T) *model.Model {
	t.Helper()
	return testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
}

// cpuBackend gives a test engine's ranks one-thread cpu kernels.
func cpuBackend(int) kernels.Backend { return cpu.New(1) }

func newEngine(t *testing.T, m *model.Model, cfg Config) *Engine {
	t.Helper()
	if cfg.Backend == nil {
		cfg.Backend = cpuBackend
	}
	e, err := New(m, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// collect reads a stream to its end, failing the test after the deadline.
func collect(t *testing.T, s *Stream, deadline time.Duration) ([]int32, Finish) {
	t.Helper()
	var toks []int32
	timer := time.NewTimer(deadline)
	defer timer.Stop()
	for {
		select {
		case ev, ok := <-s.Events:
			if !ok {
				t.Errorf("stream %d closed without a finish", s.ID)
				return toks, Finish{}
			}
			if ev.Finish != nil {
				if _, ok := <-s.Events; ok {
					t.Errorf("stream %d: event after the finish", s.ID)
				}
				return toks, *ev.Finish
			}
			toks = append(toks, ev.Token)
		case <-timer.C:
			t.Errorf("stream %d: no finish within %v", s.ID, deadline)
			return toks, Finish{}
		}
	}
}

// checkPools verifies that every rank's pool is fully free. The loop is
// idle (every stream has finished), and the releases happened before the
// finishes were sent, so reading the pools here is ordered after them.
// checkPools waits until the loop has published a state with no pages held
// and every submitted request finished (a stream's Finish reaches its reader
// before the loop publishes the step that finished it), then checks every
// rank's pool. The loop is idle by then, so reading the pools is safe.
func checkPools(t *testing.T, e *Engine) {
	t.Helper()
	var snap *EngineSnapshot
	quiet := waitfor.Poll(20*time.Second, func() bool {
		snap = e.View().Snapshot()
		if snap.Queue.HeldPages != 0 || snap.Totals.Finished != e.nextID.Load() {
			return false
		}
		// Rank 0 published that at the end of its iteration; the other
		// ranks ran the same iteration (lock-step) and are done with its
		// releases once they published its record.
		for _, rec := range e.View().RankSteps()[1:] {
			if rec.Step < snap.Step.Step {
				return false
			}
		}
		// A PD request may end before its pages are released (held until
		// the peer acks an abort): every rank must have published empty
		// PD queues, after its releases.
		for _, entries := range e.PD().QueueEntries() {
			if len(entries) != 0 {
				return false
			}
		}
		return true
	})
	if !quiet {
		t.Errorf("engine not quiet within 20s: %d pages held, %d of %d requests finished", snap.Queue.HeldPages, snap.Totals.Finished, e.nextID.Load())
		return
	}
	for r, l := range e.sup.loops {
		p := l.rk.Pool()
		// Pages the prefix cache keeps are held by nothing else: each one
		// could be evicted.
		cached := 0
		if l.cache != nil {
			cached = l.cache.Evictable()
		}
		if p.FreePages()+cached != p.TotalPages() || p.CachedPages() != cached || p.Live() != 0 {
			t.Errorf("rank %d: %d of %d pages free, %d cached (%d evictable), %d live sequences", r, p.FreePages(), p.TotalPages(), p.CachedPages(), cached, p.Live())
		}
		if err := p.Check(); err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

func TestValidate(t *testing.T) {
	m := tinyModel(t)
	for _, c := range []Config{
		{TP: 3},
		{MaxRunning: 8, MaxBatchTokens: 4},
		{PrefillChunk: -1},
		{WaitingTimeout: -time.Second},
	} {
		c.Backend = cpuBackend
		if _, err := New(m, c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	if _, err := New(m, Config{}); err == nil || !strings.Contains(err.Error(), "backend") {
		t.Errorf("no backend: %v", err)
	}
}

// runnerGreedy returns the simple runner's greedy results for the prompts
// ps, maxTok tokens each, with opts (MaxSeqs is len(ps)).
func runnerGreedy(t *testing.T, m *model.Model, opts runner.Options, ps [][]int32, maxTok int) []runner.Result {
	t.Helper()
	opts.MaxSeqs = len(ps)
	rn, err := runner.New(m, cpu.New(1), opts)
	if err != nil {
		t.Fatal(err)
	}
	reqs := make([]runner.Request, len(ps))
	for i, p := range ps {
		reqs[i] = runner.Request{Prompt: p, MaxTokens: maxTok}
	}
	want, _, err := rn.Generate(context.Background(), reqs, nil)
	if err != nil {
		t.Fatal(err)
	}
	return want
}

// matchRunner submits the prompts ps to e concurrently, maxTok tokens
// each, and checks every stream's tokens, finish and usage against the
// runner's results want.
func matchRunner(t *testing.T, e *Engine, ps [][]int32, maxTok int, want []runner.Result) {
	t.Helper()
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Go(func() {
			s, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: maxTok})
			if err != nil {
				t.Error(err)
				return
			}
			toks, fin := collect(t, s, 20*time.Second)
			if !slices.Equal(toks, want[i].Tokens) || fin.Reason != want[i].Finish {
				t.Errorf("prompt %d: got %v (%s), want %v (%s)", i, toks, fin.Reason, want[i].Tokens, want[i].Finish)
			}
			if fin.PromptTokens != len(p) || fin.CompletionTokens != len(toks) {
				t.Errorf("prompt %d: usage %+v for %d tokens", i, fin, len(toks))
			}
		})
	}
	wg.Wait()
}

// Greedy outputs through the engine equal the simple runner's, with 8
// prompts submitted concurrently, on 1 and 2 ranks.
func TestGreedyMatchesRunner(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(7, 8, 3, 40, m.Config.VocabSize)
	const maxTok = 12
	want := runnerGreedy(t, m, runner.Options{PageSize: 4, KVTokens: 1024}, ps, maxTok)
	for _, n := range []int{1, 2, 4} {
		t.Run(fmt.Sprint("tp", n), func(t *testing.T) {
			// A small pool and batch force chunking and retraction.
			e := newEngine(t, m, Config{TP: n, PageSize: 4, KVTokens: 96, MaxRunning: 6, MaxBatchTokens: 24, PrefillChunk: 7})
			matchRunner(t, e, ps, maxTok, want)
			checkPools(t, e)
			tot := e.View().Snapshot().Totals
			t.Logf("totals %+v", tot)
			if tot.Retractions == 0 {
				t.Error("no retraction: the recompute path went untested")
			}
		})
	}
}

// 64 concurrent streams all complete with the right token counts.
func TestManyStreams(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 512, MaxRunning: 16, MaxBatchTokens: 64, PrefillChunk: 16})
	ps := testmodel.Prompts(5, 64, 2, 20, m.Config.VocabSize)
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Go(func() {
			n := 1 + i%9
			s, err := e.Submit(context.Background(), Request{
				Prompt: p, MaxTokens: n, IgnoreEOS: true,
				Sampling: sample.Params{Temperature: 0.8, TopP: 0.9, Seed: uint64(i)},
			})
			if err != nil {
				t.Error(err)
				return
			}
			toks, fin := collect(t, s, 20*time.Second)
			if len(toks) != n || fin.Reason != ReasonLength || fin.CompletionTokens != n {
				t.Errorf("stream %d: %d tokens, finish %+v; want %d, length", i, len(toks), fin, n)
			}
		})
	}
	wg.Wait()
	checkPools(t, e)
}

// A storm: 64 requests, 32 aborted at seeded random moments. Afterwards
// the pools are fully free and the engine still serves.
func TestAbortStorm(t *testing.T) {
	m := tinyModel(t)
	for _, n := range []int{1, 2} {
		t.Run(fmt.Sprint("tp", n), func(t *testing.T) {
			e := newEngine(t, m, Config{TP: n, PageSize: 4, KVTokens: 256, MaxRunning: 12, MaxBatchTokens: 40, PrefillChunk: 5})
			ps := testmodel.Prompts(13, 64, 4, 30, m.Config.VocabSize)
			rng := rand.New(rand.NewPCG(11, 11))
			const (
				keep = iota
				early
				prefill
				decode
				cancel
			)
			modes := make([]int, len(ps))
			for i := range 32 {
				modes[i] = early + i%4
			}
			rng.Shuffle(len(modes), func(i, j int) { modes[i], modes[j] = modes[j], modes[i] })
			after := make([]int, len(ps))
			for i := range after {
				after[i] = 1 + rng.IntN(6)
			}
			var wg sync.WaitGroup
			var mu sync.Mutex
			reasons := map[string]int{}
			for i, p := range ps {
				wg.Go(func() {
					ctx, stop := context.WithCancel(context.Background())
					defer stop()
					s, err := e.Submit(ctx, Request{Prompt: p, MaxTokens: 10, IgnoreEOS: true})
					if err != nil {
						t.Error(err)
						return
					}
					switch modes[i] {
					case early:
						s.Abort()
					case prefill:
						// Wait until it is admitted (or has already
						// produced an event), then abort.
						waitfor.Check(t, "admitted", 20*time.Second, func() bool {
							if len(s.Events) > 0 {
								return true
							}
							q := e.View().Snapshot().Queue
							for _, r := range q.Prefilling {
								if r.ID == s.ID {
									return true
								}
							}
							for _, r := range q.Running {
								if r.ID == s.ID {
									return true
								}
							}
							return false
						})
						s.Abort()
					}
					var toks []int32
					var fin *Finish
					timer := time.NewTimer(20 * time.Second)
					defer timer.Stop()
					for fin == nil {
						select {
						case ev := <-s.Events:
							if ev.Finish != nil {
								fin = ev.Finish
								break
							}
							toks = append(toks, ev.Token)
							if len(toks) == after[i] {
								switch modes[i] {
								case decode:
									s.Abort()
								case cancel:
									stop()
								}
							}
						case <-timer.C:
							t.Errorf("stream %d: no finish", i)
							return
						}
					}
					if fin.CompletionTokens != len(toks) {
						t.Errorf("stream %d: %d tokens received, finish says %d", i, len(toks), fin.CompletionTokens)
					}
					switch {
					case modes[i] == keep && (fin.Reason != ReasonLength || len(toks) != 10):
						t.Errorf("stream %d: %d tokens, %q; want 10, length", i, len(toks), fin.Reason)
					case modes[i] != keep && fin.Reason != ReasonAbort && fin.Reason != ReasonLength:
						t.Errorf("stream %d: reason %q", i, fin.Reason)
					}
					mu.Lock()
					reasons[fmt.Sprint(modes[i], fin.Reason)]++
					mu.Unlock()
				})
			}
			wg.Wait()
			tot := e.View().Snapshot().Totals
			t.Logf("outcomes (mode reason): %v; totals %+v", reasons, tot)
			if tot.AbortsInStep == 0 {
				t.Error("no abort landed in a step in flight")
			}
			checkPools(t, e)
			if snap := e.View().Snapshot().Queue; snap.HeldPages != 0 {
				t.Errorf("scheduler still counts %d held pages", snap.HeldPages)
			}
			s, err := e.Submit(context.Background(), Request{Prompt: ps[0], MaxTokens: 5, IgnoreEOS: true})
			if err != nil {
				t.Fatal(err)
			}
			if toks, fin := collect(t, s, 20*time.Second); len(toks) != 5 || fin.Reason != ReasonLength {
				t.Errorf("after the storm: %d tokens, %q", len(toks), fin.Reason)
			}
			checkPools(t, e)
		})
	}
}

// LastStep, Snapshot and Health are readable while the loop runs.
func TestReadersWhileRunning(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 8, MaxBatchTokens: 32, PrefillChunk: 8})
	ps := testmodel.Prompts(3, 16, 4, 20, m.Config.VocabSize)
	done := make(chan struct{})
	var readers sync.WaitGroup
	var seen sync.Map
	for range 4 {
		readers.Go(func() {
			var prev uint64
			for {
				select {
				case <-done:
					return
				default:
				}
				rec := e.View().LastStep()
				if rec.Step < prev {
					t.Errorf("step went back from %d to %d", prev, rec.Step)
				}
				prev = rec.Step
				seen.Store(rec.Phase, true)
				s := e.View().Snapshot()
				_ = len(s.Queue.Waiting) + len(s.Queue.Running) + s.Queue.HeldPages
				if h := e.View().Health(time.Now()); h.Err != "" {
					t.Errorf("health: %+v", h)
				}
				runtime.Gosched()
			}
		})
	}
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(func() {
			s, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: 8, IgnoreEOS: true})
			if err != nil {
				t.Error(err)
				return
			}
			collect(t, s, 20*time.Second)
		})
	}
	wg.Wait()
	close(done)
	readers.Wait()
	if _, ok := seen.Load("decode"); !ok {
		if _, ok := seen.Load("mixed"); !ok {
			t.Log("readers saw no decode step (timing); phases seen are not asserted")
		}
	}
	rec := e.View().LastStep()
	if rec.Step == 0 || rec.End.Before(rec.Start) {
		t.Errorf("last step %+v", rec)
	}
	if h := e.View().Health(time.Now()); h.LoopAge > time.Minute || h.Waiting != 0 {
		t.Errorf("health %+v", h)
	}
}

// Close finishes what is in flight and leaves no goroutines behind.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	m := tinyModel(t)
	before := runtime.NumGoroutine()
	e, err := New(m, Config{TP: 2, Backend: cpuBackend, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 16, PrefillChunk: 4})
	if err != nil {
		t.Fatal(err)
	}
	ps := testmodel.Prompts(9, 8, 4, 20, m.Config.VocabSize)
	var streams []*Stream
	for _, p := range ps {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s, err := e.Submit(ctx, Request{Prompt: p, MaxTokens: 50, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	// Let at least one token come out, then close mid-flight.
	if ev := <-streams[0].Events; ev.Finish != nil {
		t.Fatalf("first event is a finish: %+v", ev.Finish)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	for _, s := range streams {
		_, fin := collect(t, s, 5*time.Second)
		if fin.Reason != ReasonClosed && fin.Reason != ReasonLength {
			t.Errorf("stream %d: %q", s.ID, fin.Reason)
		}
	}
	if _, err := e.Submit(context.Background(), Request{Prompt: ps[0], MaxTokens: 1}); err != ErrClosed {
		t.Errorf("submit after close: %v", err)
	}
	waitfor.Check(t, "goroutines back to the start", 10*time.Second, func() bool { return runtime.NumGoroutine() <= before })
}

// While the loop is stuck (here: blocked on its inbox lock), LastStep,
// Snapshot and Health still answer, and Health shows the loop's age grow.
func TestReadersWhileStuck(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 64, Heartbeat: time.Millisecond})
	s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 3, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	collect(t, s, 20*time.Second)
	e.inbox.mu.Lock()
	grew := waitfor.Check(t, "loop age grows", 10*time.Second, func() bool { return e.View().Health(time.Now()).LoopAge > 100*time.Millisecond })
	rec := e.View().LastStep()
	snap := e.View().Snapshot()
	e.inbox.mu.Unlock()
	if !grew {
		t.FailNow()
	}
	if rec.Step == 0 || snap == nil || snap.Totals.Sampled != 3 {
		t.Errorf("while stuck: step %+v, snapshot %+v", rec, snap)
	}
	waitfor.Check(t, "loop age recovers", 10*time.Second, func() bool { return e.View().Health(time.Now()).LoopAge < 100*time.Millisecond })
}

// A request whose timeout expires finishes with "timeout" and frees its KV.
func TestTimeout(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 64, RequestTimeout: time.Nanosecond})
	s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 40, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, fin := collect(t, s, 20*time.Second); fin.Reason != ReasonTimeout {
		t.Errorf("finish %+v, want timeout", fin)
	}
	checkPools(t, e)
}

// Engine.Abort by id ends a request; unknown ids are ignored.
func TestAbortByID(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 256})
	s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if ev := <-s.Events; ev.Finish != nil {
		t.Fatalf("first event is a finish: %+v", ev.Finish)
	}
	e.Abort(s.ID + 1000)
	e.Abort(s.ID)
	toks, fin := collect(t, s, 20*time.Second)
	if fin.Reason != ReasonAbort || fin.CompletionTokens != len(toks)+1 {
		t.Errorf("finish %+v after %d more tokens", fin, len(toks))
	}
	checkPools(t, e)
}

// A reader that never reads does not stall the loop: its events wait in
// the stream's buffer while other requests complete.
func TestUnreadStreamDoesNotStall(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 256})
	idle, err := e.Submit(context.Background(), Request{Prompt: []int32{9, 8, 7}, MaxTokens: 30, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	busy, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 40, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if toks, fin := collect(t, busy, 20*time.Second); len(toks) != 40 || fin.Reason != ReasonLength {
		t.Errorf("busy stream: %d tokens, %+v", len(toks), fin)
	}
	if toks, fin := collect(t, idle, 20*time.Second); len(toks) != 30 || fin.Reason != ReasonLength {
		t.Errorf("unread stream: %d tokens, %+v", len(toks), fin)
	}
}

func TestSubmitRejects(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 64})
	for name, q := range map[string]Request{
		"empty":       {MaxTokens: 1},
		"no tokens":   {Prompt: []int32{5}},
		"context":     {Prompt: []int32{5}, MaxTokens: m.Config.ContextLen},
		"pool":        {Prompt: make([]int32, 60), MaxTokens: 10},
		"vocabulary":  {Prompt: []int32{int32(m.Config.VocabSize)}, MaxTokens: 1},
		"temperature": {Prompt: []int32{5}, MaxTokens: 1, Sampling: sample.Params{Temperature: -1}},
	} {
		if _, err := e.Submit(context.Background(), q); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := e.Submit(ctx, Request{Prompt: []int32{5}, MaxTokens: 1}); err == nil {
		t.Error("cancelled ctx: accepted")
	}
}
