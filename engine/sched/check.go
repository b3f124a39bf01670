package sched

import "fmt"

// Check verifies the scheduler's invariants: every request is in exactly
// one queue matching its state, no id is in two queues, page holdings match
// token counts and sum to at most TotalPages, admitted requests number at
// most MaxRunning, and the step in flight matches the requests' in-flight
// tokens. With a step planned ahead (two steps in flight) it also checks
// that each step holds a request at most once and matches its tokens, that
// voided items are in no planned step, and that the predicted state is
// consistent: only the older step's requests carry a predicted token, a
// request predicted to end by length has reached MaxTokens, and nothing
// but the older step's requests is Aborting. Builds with -tags invariants
// or -race run it after every event.
func (s *Scheduler) Check() error {
	c := &s.cfg
	seen := make(map[uint64]State, len(s.reqs))
	sum := 0
	queues := []struct {
		st State
		q  []*request
	}{{Waiting, s.waiting}, {Prefilling, s.prefilling}, {Running, s.running}, {Aborting, s.aborting}}
	for _, q := range queues {
		var last uint64
		for i, r := range q.q {
			if st, dup := seen[r.id]; dup {
				return fmt.Errorf("sched: request %d in %v and %v queues", r.id, st, q.st)
			}
			seen[r.id] = q.st
			if s.reqs[r.id] != r {
				return fmt.Errorf("sched: request %d in %v queue but not known", r.id, q.st)
			}
			if r.state != q.st {
				return fmt.Errorf("sched: request %d is %v in the %v queue", r.id, r.state, q.st)
			}
			if (q.st == Prefilling || q.st == Running) && i > 0 && r.seq <= last {
				return fmt.Errorf("sched: %v queue out of admission order at %d", q.st, r.id)
			}
			last = r.seq
			sum += r.pages
			switch q.st {
			case Waiting:
				if r.fed != r.transferred || r.pages != c.pagesFor(r.transferred) || r.pending != 0 || r.shared*c.PageSize+r.loaded != r.cached {
					return fmt.Errorf("sched: waiting request %d holds pages %d fed %d pending %d (transferred %d)", r.id, r.pages, r.fed, r.pending, r.transferred)
				}
			default:
				if r.pages != c.pagesFor(r.fed+r.pending)-r.shared || r.pages == 0 || r.fed+r.pending <= r.cached {
					return fmt.Errorf("sched: request %d holds %d pages for %d+%d tokens", r.id, r.pages, r.fed, r.pending)
				}
			}
			switch q.st {
			case Prefilling:
				if r.fed+r.pending > r.target() {
					return fmt.Errorf("sched: prefilling request %d fed %d+%d beyond %d", r.id, r.fed, r.pending, r.target())
				}
			case Running:
				if r.fed != r.target()-1 || r.pending > 1 {
					return fmt.Errorf("sched: running request %d fed %d+%d, generated %d of prompt %d", r.id, r.fed, r.pending, r.generated, r.promptLen)
				}
			case Aborting:
				if !s.inStep(r) || s.step == nil {
					return fmt.Errorf("sched: aborting request %d outside a step", r.id)
				}
				if r.cut == ReasonLength && (!s.predicted || r.guess != 1 || r.generated != r.maxTokens) {
					return fmt.Errorf("sched: request %d predicted to end by length at %d of %d generated (guess %d)", r.id, r.generated, r.maxTokens, r.guess)
				}
			}
			// A request predicted to reach MaxTokens in the older step is
			// Aborting (its cut ReasonLength, or abort or timeout since).
			if r.generated-r.guess >= r.maxTokens || r.generated >= r.maxTokens && q.st != Aborting {
				return fmt.Errorf("sched: request %d generated %d of %d and still queued", r.id, r.generated, r.maxTokens)
			}
		}
	}
	if len(seen) != len(s.reqs) {
		return fmt.Errorf("sched: %d requests known, %d queued", len(s.reqs), len(seen))
	}
	if sum != s.held {
		return fmt.Errorf("sched: pages held sum to %d, counted %d", sum, s.held)
	}
	if sum > c.TotalPages {
		return fmt.Errorf("sched: %d pages held of %d", sum, c.TotalPages)
	}
	if n := len(s.prefilling) + len(s.running) + len(s.aborting); n > c.MaxRunning {
		return fmt.Errorf("sched: %d admitted, max %d", n, c.MaxRunning)
	}
	if s.ahead != nil && !s.predicted || s.predicted && s.step == nil {
		return fmt.Errorf("sched: step planned ahead %t, predicted %t, step in flight %t", s.ahead != nil, s.predicted, s.step != nil)
	}
	older, pending := 0, 0
	for _, r := range s.reqs {
		if r.older > 0 {
			older++
		}
		if r.pending > 0 {
			pending++
		}
		if r.guess != 0 && (r.guess != 1 || r.older == 0) || r.older > 0 && !s.predicted {
			return fmt.Errorf("sched: request %d predicted %d tokens with %d in the older step (predicted %t)", r.id, r.guess, r.older, s.predicted)
		}
	}
	// In lock-step the step in flight is the requests' pending tokens; once
	// predicted, its tokens are the requests' older ones (counted in fed)
	// and pending belongs to the step planned ahead.
	inFlight, planned := s.step, []Item(nil)
	if s.predicted {
		planned = s.ahead
		if older != len(s.step) {
			return fmt.Errorf("sched: %d requests with tokens in the older step, it has %d items", older, len(s.step))
		}
	}
	newest := planned
	if !s.predicted {
		newest = inFlight
	}
	if pending != len(newest) {
		return fmt.Errorf("sched: %d requests with tokens planned, step has %d items", pending, len(newest))
	}
	check := func(step []Item, match func(r *request, it Item) bool) error {
		tokens := 0
		in := make(map[uint64]bool, len(step))
		for _, it := range step {
			r := s.reqs[it.ID]
			if in[it.ID] {
				return fmt.Errorf("sched: request %d twice in one step", it.ID)
			}
			in[it.ID] = true
			if r == nil || !match(r, it) {
				return fmt.Errorf("sched: step item %+v does not match its request", it)
			}
			tokens += it.Tokens
		}
		if tokens > c.MaxBatchTokens {
			return fmt.Errorf("sched: step of %d tokens, budget %d", tokens, c.MaxBatchTokens)
		}
		return nil
	}
	if s.predicted {
		err := check(inFlight, func(r *request, it Item) bool {
			return r.older == it.Tokens && r.fed-r.older == it.Start && (r.guess == 0 || it.WantLogits)
		})
		if err != nil {
			return err
		}
	}
	if err := check(newest, func(r *request, it Item) bool {
		return r.pending == it.Tokens && r.fed == it.Start && r.state != Waiting
	}); err != nil {
		return err
	}
	for _, id := range s.voided {
		for _, it := range newest {
			if it.ID == id {
				return fmt.Errorf("sched: voided request %d still in the planned step", id)
			}
		}
	}
	return nil
}

// selfCheck runs Check in invariants builds and panics on a broken
// invariant.
func (s *Scheduler) selfCheck() {
	if invariants {
		if err := s.Check(); err != nil {
			panic(err)
		}
	}
}
