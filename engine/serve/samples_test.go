package serve

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// collectAll reads every stream of a request of n samples.
func collectAll(t *testing.T, ss []*Stream) ([][]int32, []Finish) {
	t.Helper()
	toks, fins := make([][]int32, len(ss)), make([]Finish, len(ss))
	done := make(chan struct{})
	for i, s := range ss {
		go func() {
			defer func() { done <- struct{}{} }()
			toks[i], fins[i] = collect(t, s, 30*time.Second)
		}()
	}
	for range ss {
		<-done
	}
	return toks, fins
}

// n samples of one prompt: greedy samples equal the single sample's
// output, the prompt is computed once, seeded samples differ and repeat,
// on 1 and 2 ranks.
func TestSamplesShareThePrefill(t *testing.T) {
	m := tinyModel(t)
	p := testmodel.Prompts(23, 1, 21, 22, m.Config.VocabSize)[0]
	const maxTok, n = 6, 3
	for _, tpn := range []int{1, 2} {
		e := newEngine(t, m, Config{TP: tpn, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 64, PrefillChunk: 64, DisablePrefixCache: true})
		s, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		want, _ := collect(t, s, 30*time.Second)
		checkPools(t, e)
		before := e.View().Snapshot().Totals.Tokens
		ss, err := e.SubmitN(context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true, N: n})
		if err != nil {
			t.Fatal(err)
		}
		toks, fins := collectAll(t, ss)
		for i := range n {
			if !slices.Equal(toks[i], want) || fins[i].Reason != ReasonLength || fins[i].CompletionTokens != maxTok || fins[i].PromptTokens != len(p) {
				t.Errorf("tp%d sample %d: %v %+v, want %v", tpn, i, toks[i], fins[i], want)
			}
			if ss[i].Index != i || ss[i].ID != ss[0].ID+uint64(i) {
				t.Errorf("sample %d: index %d id %d", i, ss[i].Index, ss[i].ID)
			}
		}
		checkPools(t, e)
		// The prompt once, then maxTok-1 decode tokens per sample.
		if got, wantTok := e.View().Snapshot().Totals.Tokens-before, uint64(len(p)+n*(maxTok-1)); got != wantTok {
			t.Errorf("tp%d: %d tokens run, want %d (the prompt once)", tpn, got, wantTok)
		}

		seeded := func() [][]int32 {
			ss, err := e.SubmitN(context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true, N: n,
				Sampling: sample.Params{Temperature: 1.5, Seed: 9}})
			if err != nil {
				t.Fatal(err)
			}
			toks, _ := collectAll(t, ss)
			return toks
		}
		a, b := seeded(), seeded()
		for i := range n {
			if !slices.Equal(a[i], b[i]) {
				t.Errorf("tp%d sample %d not reproducible: %v, %v", tpn, i, a[i], b[i])
			}
		}
		if slices.Equal(a[0], a[1]) && slices.Equal(a[1], a[2]) {
			t.Errorf("tp%d: seeded samples all equal: %v", tpn, a)
		}
		checkPools(t, e)
	}
}

// tokenHold is an Observer that holds rank 0's loop once, inside the
// first token emitted after arm whose count reaches n: the test acts while
// the engine can do nothing, then resumes it. A request of a few dozen
// tokens on the tiny model ends in milliseconds, sooner than a test
// goroutine may be scheduled on a loaded machine: without the hold, "abort
// after the first token" would race the request's end.
type tokenHold struct {
	mu      sync.Mutex
	n       int // 0: disarmed
	reached chan struct{}
	resumed chan struct{}
}

func newTokenHold() *tokenHold {
	return &tokenHold{reached: make(chan struct{}), resumed: make(chan struct{})}
}

func (h *tokenHold) arm(n int) { h.mu.Lock(); h.n = n; h.mu.Unlock() }

func (h *tokenHold) TokenEmitted(_ uint64, n int, _ time.Duration) {
	h.mu.Lock()
	hold := h.n > 0 && n >= h.n
	if hold {
		h.n = 0
	}
	h.mu.Unlock()
	if !hold {
		return
	}
	select {
	case h.reached <- struct{}{}:
	case <-time.After(time.Minute): // the test gave up
		return
	}
	select {
	case <-h.resumed:
	case <-time.After(time.Minute):
	}
}

func (h *tokenHold) RequestFinished(uint64, Finish) {}
func (h *tokenHold) StepFinished(StepRecord)        {}

// wait waits until the loop is held.
func (h *tokenHold) wait(t *testing.T) {
	t.Helper()
	select {
	case <-h.reached:
	case <-time.After(time.Minute):
		t.Fatal("the engine never reached the hold")
	}
}

// resume lets the held loop go on.
func (h *tokenHold) resume(t *testing.T) {
	t.Helper()
	select {
	case h.resumed <- struct{}{}:
	case <-time.After(time.Minute):
		t.Fatal("the held loop never took the resume")
	}
}

// queuedAborts is the number of aborts in e's inbox.
func queuedAborts(e *Engine) int {
	e.inbox.mu.Lock()
	defer e.inbox.mu.Unlock()
	return len(e.inbox.aborts)
}

// Aborting one stream of a request ends every sample, in any state; the
// pools end free. Each abort lands while rank 0's loop is held, so the
// state it meets is the one the case names, whatever the scheduling.
func TestSamplesAbort(t *testing.T) {
	m := tinyModel(t)
	hold := newTokenHold()
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 512, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 8, Observer: hold})
	ps := testmodel.Prompts(3, 12, 4, 30, m.Config.VocabSize)
	for i, p := range ps {
		var blocker *Stream
		switch i % 3 {
		case 0:
			// At once: the loop is held in another request's first token
			// while the request and its abort come in, so both reach the
			// same step input.
			hold.arm(1)
			var err error
			if blocker, err = e.Submit(context.Background(), Request{Prompt: ps[0], MaxTokens: 40, IgnoreEOS: true}); err != nil {
				t.Fatal(err)
			}
			hold.wait(t)
		case 1:
			hold.arm(1) // after the first token
		case 2:
			hold.arm(5) // in the decode
		}
		ss, err := e.SubmitN(context.Background(), Request{Prompt: p, MaxTokens: 40, IgnoreEOS: true, N: 3})
		if err != nil {
			t.Fatal(err)
		}
		if blocker == nil {
			hold.wait(t)
		}
		ss[i%3].Abort()
		if blocker != nil {
			blocker.Abort()
		}
		hold.resume(t)
		_, fins := collectAll(t, ss)
		for j, f := range fins {
			if f.Reason != ReasonAbort && f.Reason != AbortByClient.String() {
				t.Errorf("request %d sample %d: finish %+v", i, j, f)
			}
		}
		if blocker != nil {
			if _, f := collect(t, blocker, 30*time.Second); f.Reason == ReasonLength {
				t.Errorf("the blocker ran to its end after its abort")
			}
		}
	}
	// A cancelled context ends them too; the cancel's abort is queued
	// (context.AfterFunc calls it on a goroutine of its own) before the
	// loop goes on.
	ctx, cancel := context.WithCancel(context.Background())
	hold.arm(1)
	ss, err := e.SubmitN(ctx, Request{Prompt: ps[0], MaxTokens: 40, IgnoreEOS: true, N: 4})
	if err != nil {
		t.Fatal(err)
	}
	hold.wait(t)
	cancel()
	waitfor.Check(t, "the cancel's aborts queued", 30*time.Second, func() bool { return queuedAborts(e) >= 4 })
	hold.resume(t)
	_, fins := collectAll(t, ss)
	for j, f := range fins {
		if f.Reason == ReasonLength {
			t.Errorf("sample %d ran to its end after the cancel", j)
		}
	}
	checkPools(t, e)
}

func TestSamplesRefused(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 64, MaxRunning: 4})
	p := []int32{1, 2, 3, 4, 5}
	for _, c := range []struct {
		q    Request
		want string
	}{
		{Request{Prompt: p, MaxTokens: 4, N: MaxN + 1}, "between 1 and"},
		{Request{Prompt: p, MaxTokens: 40, N: 3}, "KV pages"},
	} {
		if _, err := e.SubmitN(context.Background(), c.q); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("n %d: %v, want %q", c.q.N, err, c.want)
		}
	}
	if _, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: 4, N: 2}); err == nil {
		t.Error("Submit took n 2")
	}
}

// More samples than the engine runs at once (16 against MaxRunning 4, on
// one rank and colocated; and through a PD pair) are served: those that do
// not fit wait their turn in the scheduler (busy is not dead), and every
// greedy sample equals the single sample's output.
func TestSamplesBeyondMaxRunning(t *testing.T) {
	m := tinyModel(t)
	p := testmodel.Prompts(41, 1, 12, 12, m.Config.VocabSize)[0]
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 256, MaxRunning: 4})
	st, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	one, f := collect(t, st, 30*time.Second)
	if f.Reason != ReasonLength {
		t.Fatalf("one sample: %+v", f)
	}
	ss, err := e.SubmitN(context.Background(), Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true, N: MaxN})
	if err != nil {
		t.Fatal(err)
	}
	toks, fins := collectAll(t, ss)
	for i := range ss {
		if fins[i].Reason != ReasonLength || !slices.Equal(toks[i], one) {
			t.Errorf("sample %d: %v %+v, want %v", i, toks[i], fins[i], one)
		}
	}
	checkPools(t, e)

	pp := newPDPair(t, Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, MaxBatchTokens: 64, PrefillChunk: 8})
	room := newAbortRoom()
	q := Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true, N: MaxN}
	pss, dss := pp.submitN(t, q, room)
	collectAll(t, pss)
	toks, fins = collectAll(t, dss)
	for i := range dss {
		if fins[i].Reason != ReasonLength || !slices.Equal(toks[i], one) {
			t.Errorf("PD sample %d: %v %+v, want %v", i, toks[i], fins[i], one)
		}
	}
	pp.settle(t, 20*time.Second)
}

// PD: one transfer per request; the decode forks the samples. Greedy
// samples equal the colocated output, seeded samples repeat, the prefill
// computes the prompt once, and both pools end free.
func TestPDSamples(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(29, 4, 1, 30, m.Config.VocabSize)
	ps[0] = ps[0][:1] // a one-token prompt: nothing to copy
	const maxTok, n = 5, 3
	for _, tpn := range []int{1, 2} {
		cfg := Config{TP: tpn, PageSize: 4, KVTokens: 512, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 16, DisablePrefixCache: true}
		col := newEngine(t, m, cfg)
		pp := newPDPair(t, cfg)
		for i, p := range ps {
			s, err := col.Submit(context.Background(), Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true})
			if err != nil {
				t.Fatal(err)
			}
			want, _ := collect(t, s, 30*time.Second)
			for _, q := range []Request{
				{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true, N: n},
				{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true, N: n, Sampling: sample.Params{Temperature: 1.5, Seed: 5}},
			} {
				var runs [2][][]int32
				for k := range runs {
					before := pp.prefill.View().Snapshot().Totals.Tokens
					room := newAbortRoom()
					pstream, dss := pp.submitN(t, q, room)
					if len(pstream) != 1 || len(dss) != n {
						t.Fatalf("%d prefill and %d decode streams", len(pstream), len(dss))
					}
					toks, fins := collectAll(t, dss)
					collect(t, pstream[0], 30*time.Second)
					for j := range n {
						if fins[j].Reason != ReasonLength || len(toks[j]) != maxTok {
							t.Errorf("tp%d prompt %d sample %d: %v %+v", tpn, i, j, toks[j], fins[j])
						}
						if q.Sampling.Temperature == 0 && !slices.Equal(toks[j], want) {
							t.Errorf("tp%d prompt %d sample %d: %v, colocated %v", tpn, i, j, toks[j], want)
						}
					}
					if got := pp.prefill.View().Snapshot().Totals.Tokens - before; got != uint64(len(p)) {
						t.Errorf("tp%d prompt %d: the prefill ran %d tokens for a prompt of %d", tpn, i, got, len(p))
					}
					runs[k] = toks
				}
				for j := range n {
					if !slices.Equal(runs[0][j], runs[1][j]) {
						t.Errorf("tp%d prompt %d sample %d not reproducible: %v, %v", tpn, i, j, runs[0][j], runs[1][j])
					}
				}
			}
		}
		for _, e := range []*Engine{pp.prefill, pp.decode} {
			checkPools(t, e)
		}
	}
}

// PD: aborting a request of n samples on the decode ends every sample,
// before or after the transfer, and frees both pools.
func TestPDSamplesAbort(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(31, 6, 4, 30, m.Config.VocabSize)
	pp := newPDPair(t, Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 8})
	for i, p := range ps {
		room := newAbortRoom()
		q := Request{Prompt: p, MaxTokens: 60, IgnoreEOS: true, N: 3}
		pss, dss := pp.submitN(t, q, room)
		if i%2 == 1 {
			for range 3 {
				<-dss[i%3].Events
			}
		}
		dss[i%3].Abort()
		_, fins := collectAll(t, dss)
		for j, f := range fins {
			if f.Reason == ReasonLength {
				t.Errorf("request %d sample %d ran to its end after the abort", i, j)
			}
		}
		pss[0].Abort()
		collect(t, pss[0], 30*time.Second)
	}
	pp.settle(t, 30*time.Second)
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		checkPools(t, e)
	}
}

// Busy is not dead: a sample with no room to fork in (the pool held by
// another request) waits its turn in the scheduler without KV and computes
// its prompt and first token itself once admitted; greedy, it gives the
// first sample's tokens, and the pools end free.
func TestSamplesNoRoomToForkWaitTheirTurn(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{TP: 2, PageSize: 4, KVTokens: 64, MaxRunning: 4, MaxBatchTokens: 64, PrefillChunk: 64, DisablePrefixCache: true})
	blocker, err := e.Submit(context.Background(), Request{Prompt: testmodel.Prompts(1, 1, 40, 41, m.Config.VocabSize)[0], MaxTokens: 8, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-blocker.Events // admitted and holding its pages
	p := testmodel.Prompts(2, 1, 12, 13, m.Config.VocabSize)[0]
	ss, err := e.SubmitN(context.Background(), Request{Prompt: p, MaxTokens: 2, IgnoreEOS: true, N: 2})
	if err != nil {
		t.Fatal(err)
	}
	toks, fins := collectAll(t, ss)
	collect(t, blocker, 30*time.Second)
	if fins[0].Reason != ReasonLength || len(toks[0]) != 2 {
		t.Errorf("first sample: %v %+v", toks[0], fins[0])
	}
	if fins[1].Reason != ReasonLength || !slices.Equal(toks[1], toks[0]) {
		t.Errorf("second sample: %v %+v, want the first's %v and length", toks[1], fins[1], toks[0])
	}
	checkPools(t, e)
}
