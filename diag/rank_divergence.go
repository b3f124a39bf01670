package diag

import (
	"fmt"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func rankDivergence(c Config) Rule {
	return Rule{
		Name:     "rank-divergence",
		Doc:      "The TP ranks of a server disagree on their step or on a communicator's sequence number (control or forward), or one waits in a collective while a peer is elsewhere: in no collective, in another call of that communicator or in a call of the other one (the overlap-schedule desync), which hangs the server while /health stays green.",
		Severity: Critical,
		Check:    func(w Window) []Finding { return checkRankDivergence(c, w) },
	}
}

const desyncRemedy = "the ranks took different branches before a collective, or one rank is stuck outside the collectives: capture a bundle (pdctl bundle) with the flight recorders and stacks; if the fault stall-last-rank is on (fault-switch-on), it holds the last rank on purpose: switch it off (pdctl fault off stall-last-rank); otherwise restart the server."

func checkRankDivergence(c Config, w Window) []Finding {
	var out []Finding
	// Steps more than one apart, or equal steps with different sequence
	// numbers on a communicator while neither rank is in a collective:
	// reported once per server, from the first sample that shows it.
	seen := map[string]bool{}
	for _, sample := range w.Samples {
		for _, s := range sample.Servers {
			if seen[s.URL] || !s.Reachable || s.Steps == nil || len(s.Steps.Ranks) < 2 {
				continue
			}
			if f, ok := stepDivergence(s, sample.Taken); ok {
				seen[s.URL] = true
				out = append(out, f)
			}
		}
	}
	// A rank waiting in a collective too long while a peer is not in it.
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.Collectives == nil {
			continue
		}
		out = append(out, collectiveWaits(c.LimitsOf(&s).CollectiveWait, s)...)
	}
	return out
}

func stepDivergence(s ServerSample, taken time.Time) (Finding, bool) {
	rs := s.Steps.Ranks
	lo, hi := rs[0], rs[0]
	for _, r := range rs[1:] {
		if r.Step < lo.Step {
			lo = r
		}
		if r.Step > hi.Step {
			hi = r
		}
	}
	at := ev("sample", "%s", taken.UTC().Format(time.RFC3339Nano))
	if hi.Step-lo.Step > 1 {
		return Finding{
			Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: AtRank(lo.Rank),
			Summary: fmt.Sprintf("rank %d is at step %d while rank %d is at step %d", lo.Rank, lo.Step, hi.Rank, hi.Step),
			Evidence: []Evidence{
				at,
				ev("steps", "%s", stepList(rs)),
				ev("spread", "%d (at most 1 mid-iteration)", hi.Step-lo.Step),
			},
			Remedy: desyncRemedy,
		}, true
	}
	for i, a := range rs {
		for _, b := range rs[i+1:] {
			if a.Step != b.Step || inCollective(s.Collectives, a.Rank) || inCollective(s.Collectives, b.Rank) {
				continue
			}
			var differ []string
			for _, comm := range debug.Comms {
				if sa, sb := a.Seq(comm), b.Seq(comm); sa != sb {
					differ = append(differ, fmt.Sprintf("%s seq %d and %d", comm, sa, sb))
				}
			}
			if len(differ) == 0 {
				continue
			}
			return Finding{
				Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: AtRank(a.Rank),
				Summary: fmt.Sprintf("ranks %d and %d both finished step %d but at %s", a.Rank, b.Rank, a.Step, strings.Join(differ, ", ")),
				Evidence: []Evidence{
					at,
					ev("steps", "%s", stepList(rs)),
					ev(fmt.Sprintf("rank %d", a.Rank), "step %d, control_seq %d, forward_seq %d, digest %s, not in a collective", a.Step, a.ControlSeq, a.ForwardSeq, a.Digest),
					ev(fmt.Sprintf("rank %d", b.Rank), "step %d, control_seq %d, forward_seq %d, digest %s, not in a collective", b.Step, b.ControlSeq, b.ForwardSeq, b.Digest),
				},
				Remedy: desyncRemedy,
			}, true
		}
	}
	return Finding{}, false
}

func stepList(rs []debug.Step) string {
	var parts []string
	for _, r := range rs {
		parts = append(parts, fmt.Sprintf("rank %d step %d control seq %d forward seq %d", r.Rank, r.Step, r.ControlSeq, r.ForwardSeq))
	}
	return listSep(parts, len(parts), "; ")
}

// wait is a call a rank waits in, with its communicator.
type wait struct {
	comm string
	call *debug.Collective
}

// String names the call with its communicator, whose seq it is: "control
// seq 41 AllReduceMin".
func (w wait) String() string { return fmt.Sprintf("%s seq %d %s", w.comm, w.call.Seq, w.call.Op) }

// waited is how long the call has waited.
func (w wait) waited() time.Duration {
	return time.Duration(w.call.DurationMS * float64(time.Millisecond))
}

// waitsOf lists the calls rank waits in, at most one per communicator, in
// the answer's order of the communicators.
func waitsOf(c *debug.CollectivesResponse, rank int) []wait {
	if c == nil {
		return nil
	}
	var out []wait
	for i := range c.Comms {
		if r := c.Comms[i].Rank(rank); r != nil && r.Waiting != nil {
			out = append(out, wait{comm: c.Comms[i].Name, call: r.Waiting})
		}
	}
	return out
}

// inCollective reports whether the collectives answer shows rank waiting
// in a call of any communicator; without an answer, or one that lacks the
// rank, a rank counts as in one (no judgement).
func inCollective(c *debug.CollectivesResponse, rank int) bool {
	if c == nil || len(c.Comms) == 0 {
		return true
	}
	for i := range c.Comms {
		if r := c.Comms[i].Rank(rank); r == nil || r.Waiting != nil {
			return true
		}
	}
	return false
}

// waitsText says where a rank waits: "waits in control seq 41
// AllReduceMin for 2.2s", joined by " and " when it waits on both
// communicators.
func waitsText(ws []wait) string {
	var parts []string
	for _, w := range ws {
		parts = append(parts, fmt.Sprintf("waits in %v for %s", w, ms(w.call.DurationMS)))
	}
	return strings.Join(parts, " and ")
}

// lastSeqs says where a rank not in a collective stopped on each
// communicator: "control: last entered seq 15000, last completed 15000;
// forward: ...".
func lastSeqs(c *debug.CollectivesResponse, rank int) string {
	var parts []string
	for i := range c.Comms {
		if r := c.Comms[i].Rank(rank); r != nil {
			parts = append(parts, fmt.Sprintf("%s: last entered seq %d, last completed %d", c.Comms[i].Name, r.LastEntered, r.LastCompleted))
		}
	}
	return strings.Join(parts, "; ")
}

// collectiveWaits names the ranks of s that wait in a collective longer
// than limit while a peer is elsewhere: in no collective, in another call
// of the communicator, or in a call of the other communicator.
func collectiveWaits(limit time.Duration, s ServerSample) []Finding {
	var out []Finding
	col := s.Collectives
	for ci := range col.Comms {
		comm := &col.Comms[ci]
		for _, r := range comm.Ranks {
			if r.Waiting == nil {
				continue
			}
			wt := wait{comm: comm.Name, call: r.Waiting}
			if wt.waited() <= limit {
				continue
			}
			var elsewhere []Evidence
			var names []string
			for _, p := range comm.Ranks {
				if p.Rank == r.Rank || p.Waiting != nil && p.Waiting.Seq == wt.call.Seq {
					continue // the rank itself, or a peer that arrived
				}
				key := fmt.Sprintf("rank %d", p.Rank)
				if pw := waitsOf(col, p.Rank); len(pw) > 0 {
					elsewhere = append(elsewhere, ev(key, "%s%s", waitsText(pw), stepOf(s.Steps, p.Rank)))
					var in []string
					for _, w := range pw {
						in = append(in, w.String())
					}
					names = append(names, fmt.Sprintf("rank %d waits in %s", p.Rank, strings.Join(in, " and ")))
					continue
				}
				elsewhere = append(elsewhere, ev(key, "not in a collective (%s)%s", lastSeqs(col, p.Rank), stepOf(s.Steps, p.Rank)))
				names = append(names, fmt.Sprintf("rank %d is not in a collective (last %s seq %d)", p.Rank, comm.Name, p.LastEntered))
			}
			if len(elsewhere) == 0 {
				continue
			}
			evidence := []Evidence{
				ev(fmt.Sprintf("rank %d", r.Rank), "waits in %v for %s (threshold %v)%s", wt, ms(wt.call.DurationMS), limit, stepOf(s.Steps, r.Rank)),
			}
			evidence = append(evidence, elsewhere...)
			for _, g := range col.Comms {
				if g.Broken {
					evidence = append(evidence, ev(g.Name+" communicator", "broken: %s", g.BrokenReason))
				}
			}
			out = append(out, Finding{
				Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
				Summary:  fmt.Sprintf("rank %d waits in %v for %s while %s", r.Rank, wt, ms(wt.call.DurationMS), listSep(names, 3, "; ")),
				Evidence: evidence,
				Remedy:   desyncRemedy,
			})
		}
	}
	return out
}

// stepOf returns ", step N" for a rank with a step record.
func stepOf(st *debug.StepsResponse, rank int) string {
	if st == nil {
		return ""
	}
	for _, r := range st.Ranks {
		if r.Rank == rank {
			return fmt.Sprintf(", step %d", r.Step)
		}
	}
	return ""
}
