package bench

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
)

// TestRunOverlapTiny runs the overlap benchmark end to end on the tiny
// model: a lock-step and an overlap server on loopback, two interleaved
// rounds at two concurrency levels. It checks the structure of the
// figures, never their speed.
func TestRunOverlapTiny(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cfg := OverlapConfig{
		Home: t.TempDir(), Arch: model.ArchLlama, Size: builtin.SizeTiny, Threads: []int{1}, MaxRunning: 8,
		Concurrency: []int{1, 4}, PromptLen: 24, MaxTokens: 6, Requests: 4, Rounds: 2, RequestTimeout: time.Minute,
	}
	rep, err := RunOverlap(ctx, cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 1 || rep.Runs[0].Threads != 1 || len(rep.Runs[0].Levels) != 2 {
		t.Fatalf("runs %+v, want one at 1 thread with 2 levels", rep.Runs)
	}
	for i, l := range rep.Runs[0].Levels {
		if l.Concurrency != cfg.Concurrency[i] {
			t.Errorf("level %d has concurrency %d, want %d", i, l.Concurrency, cfg.Concurrency[i])
		}
		for name, f := range map[string]LoopFigures{"lock-step": l.Lockstep, "overlap": l.Overlap} {
			if want := cfg.Rounds * cfg.Requests; f.Requests != want {
				t.Errorf("c=%d %s: %d requests, want %d", l.Concurrency, name, f.Requests, want)
			}
			if want := cfg.Rounds * cfg.Requests * cfg.MaxTokens; f.OutputTokens != want {
				t.Errorf("c=%d %s: %d output tokens, want %d", l.Concurrency, name, f.OutputTokens, want)
			}
			if !(f.Elapsed > 0 && f.TokPerSec > 0 && f.EngineITLP50 > 0 && f.EngineITLP50 <= f.EngineITLP99 && f.ITLP50 <= f.ITLP99) {
				t.Errorf("c=%d %s: a non-positive rate or percentiles out of order: %+v", l.Concurrency, name, f)
			}
			// Six tokens a request: the first from the prefill, five decode
			// steps, so every run has decode pairs.
			if s := f.Steps; s.Pairs == 0 || s.Batch < 1 || s.Period <= 0 || s.Forward <= 0 {
				t.Errorf("c=%d %s: step figures %+v", l.Concurrency, name, s)
			}
		}
		// Lock-step runs each forward pass inside its iteration.
		if s := l.Lockstep.Steps; s.Forward > s.Period {
			t.Errorf("c=%d: lock-step forward %v longer than its period %v", l.Concurrency, s.Forward, s.Period)
		}
		if lo, med, hi := l.RoundSpread(); len(l.RoundRatios) != cfg.Rounds || !(lo > 0 && lo <= med && med <= hi) {
			t.Errorf("c=%d: round ratios %v, want %d positive ones", l.Concurrency, l.RoundRatios, cfg.Rounds)
		}
		if l.TokRatio() <= 0 || l.OutsideShare() <= 0 || l.OutsideShare() >= 1 {
			t.Errorf("c=%d: ratio %v, outside share %v", l.Concurrency, l.TokRatio(), l.OutsideShare())
		}
	}
	g := rep.Goals()
	if len(g) != 2 || !strings.HasPrefix(g[0].Name, "overlap never slower") || !strings.HasPrefix(g[1].Name, "the default, --schedule auto") {
		t.Errorf("goals %+v, want the never-slower ones of overlap and of auto (concurrency 32 did not run)", g)
	}
	// One thread leaves a CPU free wherever there are two.
	wantPick := map[bool]string{true: "overlap at threads 1", false: "lockstep at threads 1"}[rep.CPUs > 1]
	if len(g) == 2 && !strings.Contains(g[1].Detail, wantPick) {
		t.Errorf("auto's goal %+v on %d CPUs, want it to say %q", g[1], rep.CPUs, wantPick)
	}
	checkReport(t, rep.Print, "built-in llama tiny model", "tok/s ratio", "per round (min med max)", "ITL p99 ratio", "outside share", "hidden", "goal ", "verdict: ")
}

// TestStepProbePairs checks the step probe's pairing: only consecutive decode
// steps pair, and each period runs from one forward pass's start to the
// next one's and carries the forward pass of its first step.
func TestStepProbePairs(t *testing.T) {
	p := &stepProbe{}
	t0 := time.Unix(100, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	steps := []struct {
		step  uint64
		phase string
		start int
		fwd   time.Duration
	}{
		{1, "prefill", 0, 5 * time.Millisecond},
		{2, "decode", 10, 2 * time.Millisecond}, // after a prefill: no pair
		{3, "decode", 13, 3 * time.Millisecond}, // pair (2, 3): period 3 ms, forward 2 ms
		{5, "decode", 20, 1 * time.Millisecond}, // step 4 missing: no pair
		{6, "decode", 24, 1 * time.Millisecond}, // pair (5, 6): period 4 ms, forward 1 ms
	}
	for _, s := range steps {
		// The forward pass runs from 1 ms after the iteration's start.
		p.StepFinished(serve.StepRecord{Step: s.step, Phase: s.phase, Start: at(s.start), BatchTokens: 4,
			ForwardStart: at(s.start + 1), ForwardEnd: at(s.start + 1).Add(s.fwd)})
	}
	p.StepFinished(serve.StepRecord{Step: 7, Phase: "decode", Start: at(30)}) // no forward pass: no pair
	got, _ := p.take()
	want := pairTally{pairs: 2, tokens: 8, period: 7 * time.Millisecond, forward: 3 * time.Millisecond, before: 2 * time.Millisecond, after: 2 * time.Millisecond}
	if got != want {
		t.Errorf("tally %+v, want %+v", got, want)
	}
	if f := got.figures(); f.Period != 3500*time.Microsecond || f.Forward != 1500*time.Microsecond || f.Batch != 4 {
		t.Errorf("figures %+v", f)
	}
}

// TestOverlapGoalsReadTheNoise: a level is slower only when its rounds
// say so beyond their spread; auto's goal counts only the thread counts
// at which auto runs overlap.
func TestOverlapGoalsReadTheNoise(t *testing.T) {
	level := func(conc int, rounds ...float64) OverlapLevel {
		lock := LoopFigures{TokPerSec: 1000}
		over := LoopFigures{TokPerSec: 1000 * rounds[0]}
		return OverlapLevel{Concurrency: conc, Lockstep: lock, Overlap: over, RoundRatios: rounds}
	}
	slower := level(32, 0.95, 0.96, 0.94, 0.95)
	noisy := level(8, 0.96, 1.03, 0.99, 1.02)
	if b := slower.UpperBound(); b >= 1 {
		t.Errorf("rounds all near 0.95: bound %.4f, want below 1", b)
	}
	if b := noisy.UpperBound(); b < 1 {
		t.Errorf("rounds on both sides of 1: bound %.4f, want at least 1", b)
	}
	if one := level(1, 0.97); one.UpperBound() != one.TokRatio() {
		t.Errorf("one round: bound %v, want its ratio %v", one.UpperBound(), one.TokRatio())
	}
	rep := OverlapReport{CPUs: 2, Runs: []OverlapRun{
		{Threads: 2, Levels: []OverlapLevel{noisy, slower}},
		{Threads: 1, Levels: []OverlapLevel{noisy}},
	}}
	g := rep.Goals()
	if len(g) != 2 || g[0].Met || !g[1].Met || !rep.DefaultOK() {
		t.Fatalf("goals %+v, DefaultOK %v: want overlap's missed (threads 2 slower), auto's met", g, rep.DefaultOK())
	}
	if !strings.Contains(g[1].Detail, "lockstep at threads 2, overlap at threads 1") {
		t.Errorf("auto's detail %q", g[1].Detail)
	}
	rep.Runs[1].Levels = append(rep.Runs[1].Levels, slower)
	if g := rep.Goals(); g[1].Met || rep.DefaultOK() {
		t.Errorf("overlap slower where auto runs it: goals %+v", g)
	}
}
