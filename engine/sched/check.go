package sched

import "fmt"

// Check verifies the scheduler's invariants: every request is in exactly
// one queue matching its state, no id is in two queues, page holdings match
// token counts and sum to at most TotalPages, admitted requests number at
// most MaxRunning, and the step in flight matches the requests' in-flight
// tokens. Builds with -tags invariants or -race run it after every event.
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
				if r.pending == 0 || s.step == nil {
					return fmt.Errorf("sched: aborting request %d outside a step", r.id)
				}
			}
			if r.generated >= r.maxTokens {
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
	pending := 0
	for _, r := range s.reqs {
		if r.pending > 0 {
			pending++
		}
	}
	if pending != len(s.step) {
		return fmt.Errorf("sched: %d requests with tokens in flight, step has %d items", pending, len(s.step))
	}
	tokens := 0
	for _, it := range s.step {
		r := s.reqs[it.ID]
		if r == nil || r.pending != it.Tokens || r.fed != it.Start {
			return fmt.Errorf("sched: step item %+v does not match its request", it)
		}
		tokens += it.Tokens
	}
	if tokens > c.MaxBatchTokens {
		return fmt.Errorf("sched: step of %d tokens, budget %d", tokens, c.MaxBatchTokens)
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
