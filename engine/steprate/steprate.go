// Package steprate keeps a server's step times per kind of step, so that a
// slow server can be told from a busy one: a step's time grows with its
// batch, so steps are compared only with steps of the same phase and of a
// batch of about the same size (a power-of-two bucket of its tokens). Each
// bucket keeps a recent average (the last few dozen steps) and a baseline
// (the last few thousand): a server several times slower than its own
// baseline, or than its peers at the same bucket, is slow, whatever its
// load. No clock and no goroutines: the caller gives each step's time.
package steprate

import (
	"math/bits"
	"slices"
	"sync"
	"time"
)

// The averages' weights: an exponential moving average over about 32
// steps, and one over about 4,096.
const (
	recentWeight   = 1.0 / 32
	baselineWeight = 1.0 / 4096
)

// Rate is one bucket's figures.
type Rate struct {
	Phase string // prefill, decode or mixed
	// Tokens is the bucket's bound: batches of more than Tokens/2 and at
	// most Tokens tokens.
	Tokens   int
	Steps    uint64
	Recent   time.Duration
	Baseline time.Duration
	// Cycles, CycleRecent and CycleBaseline are the same for the wall
	// time from one busy step's end to the next's (AddCycle): the step
	// and whatever held the loop between steps. A process its cgroup's
	// quota throttles spends its time there, not in its steps.
	Cycles                     uint64
	CycleRecent, CycleBaseline time.Duration
}

type key struct {
	phase  string
	tokens int
}

type avg struct {
	steps            uint64
	recent, baseline float64 // seconds
	cycle            ewma
}

// ewma is a recent and a baseline average of one figure.
type ewma struct {
	n                uint64
	recent, baseline float64 // seconds
}

// add folds in s seconds. The first values weigh more, so that the
// averages mean something before they have seen their whole spans.
func (e *ewma) add(s float64) {
	if e.n == 0 {
		e.recent, e.baseline = s, s
	} else {
		rw := max(recentWeight, 1/float64(e.n+1))
		bw := max(baselineWeight, 1/float64(e.n+1))
		e.recent += rw * (s - e.recent)
		e.baseline += bw * (s - e.baseline)
	}
	e.n++
}

// Tracker is safe for concurrent use: one loop adds, readers snapshot.
type Tracker struct {
	mu sync.Mutex
	m  map[key]*avg
}

// bucket is the power of two at or above tokens.
func bucket(tokens int) int {
	if tokens <= 1 {
		return 1
	}
	return 1 << bits.Len(uint(tokens-1))
}

// Add records one step of phase over batchTokens tokens that took d. Idle
// steps, and steps of no token, are not rates.
func (t *Tracker) Add(phase string, batchTokens int, d time.Duration) {
	if phase == "" || phase == "idle" || batchTokens <= 0 || d <= 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	a := t.bucketOf(phase, batchTokens)
	e := ewma{n: a.steps, recent: a.recent, baseline: a.baseline}
	e.add(d.Seconds())
	a.steps, a.recent, a.baseline = e.n, e.recent, e.baseline
}

// AddCycle records the wall time from the end of the loop's previous busy
// step to the end of this one, of phase over batchTokens tokens: the
// caller passes it only when the loop had work the whole time (a decode
// batch running on), so that waiting for requests is not counted.
func (t *Tracker) AddCycle(phase string, batchTokens int, d time.Duration) {
	if phase == "" || phase == "idle" || batchTokens <= 0 || d <= 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.bucketOf(phase, batchTokens).cycle.add(d.Seconds())
}

// bucketOf is the bucket of phase and batchTokens, made on first use;
// t.mu is held.
func (t *Tracker) bucketOf(phase string, batchTokens int) *avg {
	if t.m == nil {
		t.m = map[key]*avg{}
	}
	k := key{phase, bucket(batchTokens)}
	a := t.m[k]
	if a == nil {
		a = &avg{}
		t.m[k] = a
	}
	return a
}

// Rates returns every bucket, by phase then size.
func (t *Tracker) Rates() []Rate {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Rate, 0, len(t.m))
	for k, a := range t.m {
		out = append(out, Rate{Phase: k.phase, Tokens: k.tokens, Steps: a.steps,
			Recent: seconds(a.recent), Baseline: seconds(a.baseline),
			Cycles: a.cycle.n, CycleRecent: seconds(a.cycle.recent), CycleBaseline: seconds(a.cycle.baseline)})
	}
	slices.SortFunc(out, func(a, b Rate) int {
		if a.Phase != b.Phase {
			if a.Phase < b.Phase {
				return -1
			}
			return 1
		}
		return a.Tokens - b.Tokens
	})
	return out
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
