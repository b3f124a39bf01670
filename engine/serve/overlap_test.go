package serve

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// overlapPrompts is the equality matrix's workload size: make test keeps it
// small; the stress tag runs the 200 at TP 1, 2 and 4.
var overlapPrompts, overlapTPs = 48, []int{1, 2}

// runAll runs every prompt (greedy, maxTok tokens) on e, all at once, and
// cancels those whose index is in cancel after their first token; it
// returns each one's tokens and finish.
func runAll(t *testing.T, e *Engine, ps [][]int32, maxTok int, cancel map[int]bool) ([][]int32, []Finish) {
	t.Helper()
	toks, fins := make([][]int32, len(ps)), make([]Finish, len(ps))
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Go(func() {
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			s, err := e.Submit(ctx, Request{Prompt: p, MaxTokens: maxTok, IgnoreEOS: true})
			if err != nil {
				t.Error(err)
				return
			}
			deadline := time.NewTimer(60 * time.Second)
			defer deadline.Stop()
			for {
				select {
				case ev, ok := <-s.Events:
					if !ok {
						return
					}
					if ev.Finish != nil {
						fins[i] = *ev.Finish
						continue
					}
					toks[i] = append(toks[i], ev.Token)
					if cancel[i] && len(toks[i]) == 1 {
						stop()
					}
				case <-deadline.C:
					t.Errorf("prompt %d: no finish within 60s", i)
					return
				}
			}
		})
	}
	wg.Wait()
	return toks, fins
}

// The overlap loop generates what the lock-step loop generates, bit for bit:
// the same greedy tokens for every prompt, at TP 1 and 2, with a pool small
// enough to retract, chunked prefill, and requests aborted after their first
// token (which end as aborted in both loops); pools balance afterwards.
func TestOverlapMatchesLockstep(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(101, overlapPrompts, 3, 40, m.Config.VocabSize)
	cancel := map[int]bool{}
	for i := 0; i < len(ps); i += 7 {
		cancel[i] = true
	}
	const maxTok = 10
	for _, n := range overlapTPs {
		t.Run(fmt.Sprint("tp", n), func(t *testing.T) {
			cfg := Config{TP: n, PageSize: 4, KVTokens: 128, MaxRunning: 8, MaxBatchTokens: 32, PrefillChunk: 7, IndexK: kernels.IndexBF16}
			lock := newEngine(t, m, cfg)
			want, _ := runAll(t, lock, ps, maxTok, nil)
			ov := cfg
			ov.Schedule = ScheduleOverlap
			e := newEngine(t, m, ov)
			got, fins := runAll(t, e, ps, maxTok, cancel)
			for i := range ps {
				switch {
				case cancel[i]:
					if fins[i].Reason != ReasonAbort && fins[i].Reason != ReasonLength {
						t.Errorf("prompt %d (cancelled): %+v", i, fins[i])
					}
					if !slices.Equal(got[i], want[i][:len(got[i])]) {
						t.Errorf("prompt %d (cancelled): %v is not a prefix of %v", i, got[i], want[i])
					}
				case !slices.Equal(got[i], want[i]) || fins[i].Reason != ReasonLength:
					t.Errorf("prompt %d: overlap %v (%s), lockstep %v", i, got[i], fins[i].Reason, want[i])
				}
			}
			tot := e.View().Snapshot().Totals
			t.Logf("overlap: %d steps, %d planned ahead, %d retractions", tot.Steps, tot.PlannedAhead, tot.Retractions)
			if tot.Retractions == 0 {
				t.Error("no retraction: the pool was meant to run short")
			}
			if tot.PlannedAhead < tot.Steps/3 {
				t.Errorf("only %d of %d steps were planned while the one before flew", tot.PlannedAhead, tot.Steps)
			}
			checkPools(t, e)
			if rs := e.View().RankSteps(); rs[0].Loop != LoopOverlap {
				t.Errorf("step record loop %q", rs[0].Loop)
			}
		})
	}
}

// TestResolveSchedule: auto is overlap exactly when the forward passes
// leave a CPU free (a device backend keeps none busy), and an engine
// refuses auto itself.
func TestResolveSchedule(t *testing.T) {
	for _, c := range []struct {
		schedule      string
		threads, cpus int
		want          string
	}{
		{ScheduleAuto, 2, 2, ScheduleLockstep},
		{ScheduleAuto, 4, 2, ScheduleLockstep},
		{ScheduleAuto, 1, 2, ScheduleOverlap},
		{ScheduleAuto, 0, 1, ScheduleOverlap},
		{ScheduleLockstep, 1, 16, ScheduleLockstep},
		{ScheduleOverlap, 16, 16, ScheduleOverlap},
	} {
		if got := ResolveSchedule(c.schedule, c.threads, c.cpus); got != c.want {
			t.Errorf("ResolveSchedule(%q, %d, %d) = %q, want %q", c.schedule, c.threads, c.cpus, got, c.want)
		}
	}
	cfg := Config{Schedule: ScheduleAuto}
	cfg.setDefaults(tinyModel(t))
	if err := cfg.Validate(tinyModel(t)); err == nil || !strings.Contains(err.Error(), "ResolveSchedule") {
		t.Errorf("an engine given auto: %v", err)
	}
}
