package diag

import (
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func kvLeak(c Config) Rule {
	return Rule{
		Name:     "kv-leak",
		Doc:      "KV pages are held by no live request (neither in a scheduler queue nor in a PD queue) at both ends of a window in which the engine ran no forward step and ended no request, or reserved for aborted rooms past the abort-ack deadline, so the pool shrinks until new requests cannot be admitted.",
		Severity: Critical,
		Check:    func(w Window) []Finding { return checkKVLeak(c, w) },
	}
}

// live counts a server's live requests: scheduler queues, submissions not
// yet taken, the step in flight and every PD queue of every rank.
func live(s *ServerSample) (n int, detail string) {
	if s.Requests != nil {
		for _, v := range s.Requests.Counts {
			n += v
		}
		n += s.Requests.Pending
		if s.Requests.StepInFlight {
			n++
		}
	}
	pd := map[string]int{}
	if s.PD != nil {
		for _, r := range s.PD.Ranks {
			for q, v := range r.Counts {
				pd[q] += v
				n += v
			}
		}
	}
	sched := "none"
	if s.Requests != nil {
		sched = counts(s.Requests.Counts, debug.Queues)
	}
	return n, fmt.Sprintf("scheduler %s, pd %s", sched, counts(pd, debug.PDQueues))
}

func kvPages(s *ServerSample, rank int) (debug.KVPages, bool) {
	if s == nil || s.Requests == nil {
		return debug.KVPages{}, false
	}
	for _, kv := range s.Requests.KV {
		if kv.Rank == rank {
			return kv, true
		}
	}
	return debug.KVPages{}, false
}

func checkKVLeak(c Config, w Window) []Finding {
	var out []Finding
	first := w.First()
	for i := range w.Last().Servers {
		last := &w.Last().Servers[i]
		if !last.Reachable || last.Requests == nil {
			continue
		}
		// Pages held with no live request, at both ends of a window in
		// which the engine served nothing. The queue counts come from the
		// loop's last snapshot and the pages from the pool's counters,
		// read moments apart: under traffic a request can hold pages in
		// between, so only an engine that ran no forward step and ended
		// no request all window proves the pages belong to nobody.
		f := first.Server(last.URL)
		if len(w.Samples) >= 2 && w.Span() > 0 && f != nil && f.Reachable && f.Requests != nil &&
			f.Requests.ForwardSteps == last.Requests.ForwardSteps && f.Requests.Finished == last.Requests.Finished {
			nl, detail := live(last)
			nf, _ := live(f)
			if nl == 0 && nf == 0 {
				for _, kv := range last.Requests.KV {
					kf, ok := kvPages(f, kv.Rank)
					held, heldFirst := kv.Used-kv.Cached, kf.Used-kf.Cached
					if !ok || held <= 0 || heldFirst <= 0 {
						continue
					}
					out = append(out, Finding{
						Rule: "kv-leak", Severity: Critical, Server: last.URL, Rank: AtRank(kv.Rank),
						Summary: fmt.Sprintf("rank %d holds %d KV pages with no live request", kv.Rank, held),
						Evidence: []Evidence{
							ev("held", "%d pages (used %d - cached %d) of %d", held, kv.Used, kv.Cached, kv.Total),
							ev("held_first", "%d pages, %v earlier", heldFirst, w.Span().Round(time.Millisecond)),
							ev("live_requests", "0 (%s)", detail),
							ev("scheduler_held_pages", "%d", last.Requests.HeldPages),
						},
						Remedy: fmt.Sprintf("the pages leaked (freed by no path): capture a bundle (pdctl bundle) for the engineers, then restart %s to get them back.", last.URL),
					})
				}
			}
		}
		// Pages reserved for aborted rooms past the abort-ack deadline.
		if last.PD == nil {
			continue
		}
		l := c.LimitsOf(last)
		if l.Timeouts.AbortAck <= 0 {
			continue // unknown: the server published no settings
		}
		limit := l.Timeouts.AbortAck + l.Grace
		for _, r := range last.PD.Ranks {
			var late []debug.ID
			var oldest float64
			var unsent int
			for _, e := range entries(&r, "aborting") {
				if time.Duration(e.InQueueMS*float64(time.Millisecond)) > limit {
					late = append(late, e.Room)
					oldest = max(oldest, e.InQueueMS)
					if !e.AbortSent {
						unsent++
					}
				}
			}
			if len(late) == 0 {
				continue
			}
			evidence := []Evidence{
				ev("queue", "aborting"),
				ev("overdue", "%d", len(late)),
				ev("oldest", "%s", ms(oldest)),
				ev("abort_ack_timeout", "%v (+%v grace)", l.Timeouts.AbortAck, l.Grace),
				ev("abort_not_sent", "%d", unsent),
				ev("rooms", "%s", list(late, 10)),
			}
			if kv, ok := kvPages(last, r.Rank); ok {
				evidence = append(evidence, ev("kv", "used %d, cached %d, total %d", kv.Used, kv.Cached, kv.Total))
			}
			out = append(out, Finding{
				Rule: "kv-leak", Severity: Warning, Server: last.URL, Rank: AtRank(r.Rank),
				Summary:  fmt.Sprintf("rank %d keeps pages for %d aborted rooms past the abort-ack deadline", r.Rank, len(late)),
				Evidence: evidence,
				Remedy:   fmt.Sprintf("the rank should free these pages once the deadline passes: check that its loop iterates and the prefill peers answer ABORT (control-loop-dead, peer-unreachable); restart %s if the pages stay held.", last.URL),
			})
		}
	}
	return out
}
