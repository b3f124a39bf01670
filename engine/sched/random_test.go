package sched

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// event is one recorded scheduler input.
type event struct {
	kind     string // add, abort, tick, schedule, done
	req      Request
	id       uint64
	now      time.Duration
	free     int
	outcomes []Outcome
}

// apply feeds e to s and prints what came back.
func apply(s *Scheduler, e event) string {
	switch e.kind {
	case "add":
		return fmt.Sprintf("add %+v: %v", e.req, s.Add(e.req, e.now))
	case "abort":
		f, err := s.Abort(e.id, e.now)
		return fmt.Sprintf("abort %d: %+v %v voided %v", e.id, f, err, s.Voided())
	case "tick":
		return fmt.Sprintf("tick: %+v voided %v", s.Tick(e.now), s.Voided())
	case "schedule":
		p, err := s.Schedule(e.now, e.free)
		return fmt.Sprintf("schedule %d: %+v %v", e.free, p, err)
	case "done":
		f, err := s.StepDone(e.now, e.outcomes)
		return fmt.Sprintf("done %+v: %+v %v voided %v", e.outcomes, f, err, s.Voided())
	}
	panic(e.kind)
}

// pageModel is an independent account of the pages the loop holds per
// request, built only from the plans and finishes the scheduler returns.
type pageModel struct {
	t      *testing.T
	cfg    Config
	alive  map[uint64]bool // added and not yet finished
	tokens map[uint64]int  // tokens the loop reserved KV for, per held sequence
	shared map[uint64]int  // shared prefix pages per held sequence (not held by it)
	parked map[uint64]bool // sequences that arrived with transferred KV and are not admitted yet
	seen   map[string]int  // what happened, to check the run covered it
}

func (m *pageModel) pages(id uint64) int { return m.cfg.pagesFor(m.tokens[id]) - m.shared[id] }

func (m *pageModel) held() int {
	n := 0
	for id := range m.tokens {
		n += m.pages(id)
	}
	return n
}

// release checks one released (or not) sequence against the model.
func (m *pageModel) release(what string, id uint64, release bool, pages int) {
	m.t.Helper()
	_, holds := m.tokens[id]
	if release != holds || (holds && pages != m.pages(id)) || (!holds && pages != 0) {
		m.t.Fatalf("%s %d: release=%t pages=%d, model holds=%t pages=%d", what, id, release, pages, holds, m.pages(id))
	}
	delete(m.tokens, id)
	delete(m.shared, id)
	delete(m.parked, id)
}

func (m *pageModel) finish(fs []Finish) {
	m.t.Helper()
	for _, f := range fs {
		if !m.alive[f.ID] {
			m.t.Fatalf("finish of %d, which is not alive: %+v", f.ID, f)
		}
		delete(m.alive, f.ID)
		m.seen["finish "+f.Reason.String()]++
		m.release("finish", f.ID, f.Release, f.Pages)
	}
}

func (m *pageModel) plan(p Plan, free int) {
	m.t.Helper()
	m.finish(p.Finished)
	freed := 0
	for _, f := range p.Finished {
		freed += f.Pages
	}
	for _, r := range p.Retract {
		if !m.alive[r.ID] {
			m.t.Fatalf("retract of %d, not alive", r.ID)
		}
		freed += r.Pages
		m.seen["retract"]++
		m.release("retract", r.ID, true, r.Pages)
	}
	need, tokens := 0, 0
	seen := map[uint64]bool{}
	for _, it := range p.Run {
		if seen[it.ID] || !m.alive[it.ID] {
			m.t.Fatalf("run item %+v twice or not alive", it)
		}
		seen[it.ID] = true
		have, holds := m.tokens[it.ID]
		if it.Fresh {
			if holds || it.Start != it.Cached || it.Cached%m.cfg.PageSize != 0 {
				m.t.Fatalf("fresh run item %+v: model holds=%t tokens=%d", it, holds, have)
			}
			m.shared[it.ID] = it.Cached / m.cfg.PageSize
			if it.Cached > 0 {
				m.seen["cached admission"]++
			}
		} else if !holds || have != it.Start {
			m.t.Fatalf("run item %+v: model holds=%t tokens=%d", it, holds, have)
		}
		if it.Tokens < 1 || (it.Tokens > 1 && it.Tokens > m.cfg.PrefillChunk) {
			m.t.Fatalf("run item %+v: bad chunk", it)
		}
		delete(m.parked, it.ID)
		before := 0
		if holds {
			before = m.pages(it.ID)
		}
		m.tokens[it.ID] = it.Start + it.Tokens
		if m.pages(it.ID) != it.Pages {
			m.t.Fatalf("run item %+v: model pages %d", it, m.pages(it.ID))
		}
		need += it.Pages - before
		tokens += it.Tokens
	}
	if need != p.PagesNeeded || need > free+freed {
		m.t.Fatalf("pages needed %d (model %d), free %d + freed %d", p.PagesNeeded, need, free, freed)
	}
	if tokens > m.cfg.MaxBatchTokens {
		m.t.Fatalf("step of %d tokens", tokens)
	}
	if n := len(m.tokens) - len(m.parked); n > m.cfg.MaxRunning {
		m.t.Fatalf("%d admitted sequences held, max running %d", n, m.cfg.MaxRunning)
	}
	if h := m.held(); h > m.cfg.TotalPages {
		m.t.Fatalf("model holds %d pages of %d", h, m.cfg.TotalPages)
	}
}

// configFor is a small random configuration, so that pages, chunks and
// slots all run short; overlap sets Config.Overlap.
func configFor(seed uint64, overlap bool) Config {
	rng := rand.New(rand.NewPCG(seed, 1))
	cfg := Config{
		MaxRunning:     1 + rng.IntN(6),
		PrefillChunk:   1 + rng.IntN(12),
		PageSize:       1 + rng.IntN(6),
		TotalPages:     8 + rng.IntN(40),
		WaitingTimeout: time.Duration(rng.IntN(3)) * 200 * time.Millisecond,
		PrefillTimeout: time.Duration(rng.IntN(3)) * 100 * time.Millisecond,
		RequestTimeout: time.Duration(rng.IntN(3)) * time.Second,
	}
	cfg.MaxBatchTokens = cfg.MaxRunning + rng.IntN(24)
	cfg.Overlap = overlap
	return cfg
}

// randomRun drives a scheduler with n seeded random events, checking it
// against Check and the page model after each; it returns the events and
// a count of what happened. With overlap it schedules ahead: while a step
// is in flight it often plans the next one, sometimes asks for a third
// (which must be refused), and checks that every voided item was in the
// planned step and that its request finished in the same event.
func randomRun(t *testing.T, seed uint64, n int, overlap bool) ([]event, map[string]int) {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	cfg := configFor(seed, overlap)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m := &pageModel{t: t, cfg: cfg, alive: map[uint64]bool{}, tokens: map[uint64]int{}, shared: map[uint64]int{}, parked: map[uint64]bool{}, seen: map[string]int{}}
	var events []event
	var now time.Duration
	var step, ahead []Item // the step in flight and the one planned ahead, as the loop runs them
	voided := 0            // of s.Voided(), those already handled
	// dropVoided takes the newly voided items out of planned; each must
	// have been in it and have finished in fs.
	dropVoided := func(planned []Item, fs []Finish) []Item {
		t.Helper()
		v := s.Voided()
		for _, id := range v[voided:] {
			if !overlap {
				t.Fatalf("seed %d: voided %d in lock-step", seed, id)
			}
			in := slices.ContainsFunc(planned, func(it Item) bool { return it.ID == id })
			fin := slices.ContainsFunc(fs, func(f Finish) bool { return f.ID == id })
			if !in || !fin {
				t.Fatalf("seed %d: voided %d: in the planned step %t, finished now %t", seed, id, in, fin)
			}
			planned = slices.DeleteFunc(planned, func(it Item) bool { return it.ID == id })
			m.seen["voided"]++
		}
		voided = len(v)
		return planned
	}
	for i := 0; i < n; i++ {
		now += time.Duration(rng.IntN(20)) * time.Millisecond
		e := event{now: now}
		switch k := rng.IntN(10); {
		case k < 3:
			e.kind = "add"
			e.req = Request{ID: uint64(rng.IntN(30)), PromptLen: rng.IntN(30), MaxTokens: rng.IntN(12)}
			switch k := rng.IntN(4); {
			case k == 0:
				if c := rng.IntN(4) * cfg.PageSize; c < e.req.PromptLen {
					e.req.Cached = c
				}
			case k == 1 && e.req.PromptLen > 1:
				e.req.Transferred = 1 + rng.IntN(e.req.PromptLen-1)
			}
			err := s.Add(e.req, now)
			switch {
			case err == nil:
				if m.alive[e.req.ID] {
					t.Fatalf("added %d twice", e.req.ID)
				}
				m.alive[e.req.ID] = true
				if e.req.Transferred > 0 {
					m.tokens[e.req.ID] = e.req.Transferred
					m.parked[e.req.ID] = true
					m.seen["transferred arrival"]++
				}
			case errors.Is(err, ErrDuplicate) != m.alive[e.req.ID]:
				t.Fatalf("add %+v: %v, alive %t", e.req, err, m.alive[e.req.ID])
			}
		case k < 4:
			e.kind = "abort"
			e.id = uint64(rng.IntN(30))
			f, err := s.Abort(e.id, now)
			if (err != nil) != !m.alive[e.id] {
				t.Fatalf("abort %d: %v, alive %t", e.id, err, m.alive[e.id])
			}
			if err == nil && len(f) == 0 {
				m.seen["abort deferred"]++
			}
			m.finish(f)
			ahead = dropVoided(ahead, f)
		case k < 5:
			e.kind = "tick"
			f := s.Tick(now)
			m.finish(f)
			ahead = dropVoided(ahead, f)
		case overlap && ahead != nil && rng.IntN(8) == 0:
			e.kind = "schedule"
			e.free = max(0, cfg.TotalPages-m.held())
			if _, err := s.Schedule(now, e.free); !errors.Is(err, ErrStepInFlight) {
				t.Fatalf("seed %d: schedule with two steps in flight: %v", seed, err)
			}
			m.seen["refused"]++
		case step == nil || overlap && ahead == nil && rng.IntN(3) > 0:
			e.kind = "schedule"
			e.free = max(0, cfg.TotalPages-m.held()-rng.IntN(3))
			p, err := s.Schedule(now, e.free)
			if err != nil {
				t.Fatal(err)
			}
			m.plan(p, e.free)
			switch {
			case len(p.Run) > 0 && step == nil:
				step, voided = p.Run, 0
			case len(p.Run) > 0:
				if len(p.Retract) > 0 {
					t.Fatalf("seed %d: retraction with a step in flight: %+v", seed, p)
				}
				ahead, voided = p.Run, 0
				m.seen["ahead"]++
			case step != nil && len(m.tokens) > len(m.parked)+len(step):
				m.seen["ahead empty"]++
			}
		default:
			e.kind = "done"
			for _, it := range step {
				o := Outcome{ID: it.ID}
				if it.WantLogits {
					o.Emitted = 1
					o.Stop = rng.IntN(8) == 0
				}
				switch rng.IntN(50) {
				case 0:
					continue // lost outcome
				case 1:
					o.Emitted++ // impossible outcome
				}
				e.outcomes = append(e.outcomes, o)
			}
			if rng.IntN(50) == 0 {
				e.outcomes = append(e.outcomes, Outcome{ID: 1000, Emitted: 1})
			}
			f, _ := s.StepDone(now, e.outcomes)
			m.finish(f)
			step = nil
			if ahead != nil {
				step, ahead = dropVoided(ahead, f), nil
				if len(step) == 0 {
					step = nil
				}
			}
			if s.InFlight() != (step != nil) {
				t.Fatalf("seed %d: in flight %t, planned step %+v", seed, s.InFlight(), step)
			}
		}
		events = append(events, e)
		if err := s.Check(); err != nil {
			t.Fatalf("seed %d event %d %+v: %v", seed, i, e, err)
		}
		if s.HeldPages() != m.held() {
			t.Fatalf("seed %d event %d: scheduler holds %d pages, model %d", seed, i, s.HeldPages(), m.held())
		}
	}
	// Drain: end the steps, abort everything; nothing may stay held.
	for s.InFlight() {
		f, _ := s.StepDone(now, nil)
		m.finish(f)
	}
	for id := uint64(0); id < 30; id++ {
		if m.alive[id] {
			f, err := s.Abort(id, now)
			if err != nil || len(f) != 1 {
				t.Fatalf("drain abort %d: %+v %v", id, f, err)
			}
			m.finish(f)
		}
	}
	if s.Len() != 0 || s.HeldPages() != 0 || len(m.tokens) != 0 || len(m.alive) != 0 {
		t.Fatalf("seed %d: after drain %d requests, %d pages held, model %d sequences", seed, s.Len(), s.HeldPages(), len(m.tokens))
	}
	return events, m.seen
}

func TestRandomAgainstModel(t *testing.T) {
	total := map[string]int{}
	for seed := uint64(1); seed <= 10; seed++ {
		_, seen := randomRun(t, seed, 10_000, false)
		for k, v := range seen {
			total[k] += v
		}
	}
	for _, k := range []string{"retract", "abort deferred", "finish stop", "finish length", "finish abort", "finish timeout", "finish error"} {
		if total[k] == 0 {
			t.Errorf("random runs never saw %q: %v", k, total)
		}
	}
	t.Logf("%v", total)
}

// TestRandomOverlapAgainstModel runs the overlap pattern (plan a step
// ahead of the one in flight, random stops, aborts, timeouts and failed
// outcomes) with Check and the page model after every event: no request
// finishes twice, voided items were planned and finish with their pages,
// and no plan made with a step in flight retracts.
func TestRandomOverlapAgainstModel(t *testing.T) {
	total := map[string]int{}
	for seed := uint64(1); seed <= 10; seed++ {
		_, seen := randomRun(t, seed, 10_000, true)
		for k, v := range seen {
			total[k] += v
		}
	}
	for _, k := range []string{"ahead", "ahead empty", "refused", "voided", "retract", "abort deferred", "finish stop", "finish length", "finish abort", "finish timeout", "finish error"} {
		if total[k] == 0 {
			t.Errorf("random runs never saw %q: %v", k, total)
		}
	}
	t.Logf("%v", total)
}

// TestDeterminism replays one recorded event sequence into two fresh
// schedulers: every result must be identical, so ranks that feed their
// schedulers the same (reduced) inputs get the same plans.
func TestDeterminism(t *testing.T) {
	for seed := uint64(1); seed <= 10; seed++ {
		overlap := seed > 5
		events, _ := randomRun(t, seed, 5_000, overlap)
		run := func() string {
			a, err := New(configFor(seed, overlap))
			if err != nil {
				t.Fatal(err)
			}
			var b strings.Builder
			for _, e := range events {
				b.WriteString(apply(a, e) + "\n")
			}
			fmt.Fprintf(&b, "%+v\n", a.Snapshot())
			return b.String()
		}
		x, y := run(), run()
		if x != y {
			t.Fatalf("seed %d: two schedulers fed the same events diverged", seed)
		}
		if !strings.Contains(x, "Run:[{") {
			t.Fatalf("seed %d: trace scheduled nothing", seed)
		}
	}
}

// TestCheckCatches makes sure Check is not vacuous.
func TestCheckCatches(t *testing.T) {
	s, err := New(Config{MaxRunning: 2, MaxBatchTokens: 8, PrefillChunk: 4, PageSize: 4, TotalPages: 4})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Add(Request{ID: 1, PromptLen: 4, MaxTokens: 2}, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Schedule(0, 4); err != nil {
		t.Fatal(err)
	}
	r := s.reqs[1]
	for name, corrupt := range map[string]func(undo bool){
		"held": func(undo bool) { s.held += map[bool]int{false: 1, true: -1}[undo] },
		"two queues": func(undo bool) {
			if undo {
				s.waiting = nil
			} else {
				s.waiting = append(s.waiting, r)
			}
		},
		"step": func(undo bool) { r.pending += map[bool]int{false: 1, true: -1}[undo] },
	} {
		corrupt(false)
		if err := s.Check(); err == nil {
			t.Errorf("%s: Check missed the corruption", name)
		}
		corrupt(true)
		if err := s.Check(); err != nil {
			t.Fatalf("%s: %v after undo", name, err)
		}
	}
}
