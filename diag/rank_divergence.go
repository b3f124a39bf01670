package diag

import (
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func rankDivergence(c Config) Rule {
	return Rule{
		Name:     "rank-divergence",
		Doc:      "The TP ranks of a server disagree on their step or collective sequence number, or one waits in a collective while a peer is elsewhere (the overlap-schedule desync), which hangs the server while /health stays green.",
		Severity: Critical,
		Check:    func(w Window) []Finding { return checkRankDivergence(c, w) },
	}
}

const desyncRemedy = "the ranks took different branches before a collective, or one rank is stuck outside the collectives: capture a bundle (pdctl bundle) with the flight recorders and stacks; if the fault stall-last-rank is on (fault-switch-on), it holds the last rank on purpose: switch it off (pdctl fault off stall-last-rank); otherwise restart the server."

func checkRankDivergence(c Config, w Window) []Finding {
	var out []Finding
	// Steps more than one apart, or equal steps with different collective
	// sequence numbers while neither rank is in a collective: reported once
	// per server, from the first sample that shows it.
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
			Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: lo.Rank,
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
			if a.Step != b.Step || a.CollectiveSeq == b.CollectiveSeq || inCollective(s.Collectives, a.Rank) || inCollective(s.Collectives, b.Rank) {
				continue
			}
			return Finding{
				Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: a.Rank,
				Summary: fmt.Sprintf("ranks %d and %d both finished step %d but at collective seq %d and %d", a.Rank, b.Rank, a.Step, a.CollectiveSeq, b.CollectiveSeq),
				Evidence: []Evidence{
					at,
					ev("steps", "%s", stepList(rs)),
					ev(fmt.Sprintf("rank %d", a.Rank), "step %d, collective_seq %d, digest %s, not in a collective", a.Step, a.CollectiveSeq, a.Digest),
					ev(fmt.Sprintf("rank %d", b.Rank), "step %d, collective_seq %d, digest %s, not in a collective", b.Step, b.CollectiveSeq, b.Digest),
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
		parts = append(parts, fmt.Sprintf("rank %d step %d seq %d", r.Rank, r.Step, r.CollectiveSeq))
	}
	return listSep(parts, len(parts), "; ")
}

func collectiveRank(c *debug.CollectivesResponse, rank int) *debug.CollectiveRank {
	if c == nil {
		return nil
	}
	for i := range c.Ranks {
		if c.Ranks[i].Rank == rank {
			return &c.Ranks[i]
		}
	}
	return nil
}

// inCollective reports whether the collectives answer shows rank waiting
// in a call; without an answer a rank counts as in one (no judgement).
func inCollective(c *debug.CollectivesResponse, rank int) bool {
	r := collectiveRank(c, rank)
	return c == nil || r == nil || r.Waiting != nil
}

// collectiveWaits names the ranks of s that wait in a collective longer
// than wait while a peer is elsewhere.
func collectiveWaits(wait time.Duration, s ServerSample) []Finding {
	var out []Finding
	col := s.Collectives
	for _, r := range col.Ranks {
		wt := r.Waiting
		if wt == nil || time.Duration(wt.DurationMS*float64(time.Millisecond)) <= wait {
			continue
		}
		var elsewhere []Evidence
		var names []string
		for _, p := range col.Ranks {
			if p.Rank == r.Rank {
				continue
			}
			switch {
			case p.Waiting == nil:
				elsewhere = append(elsewhere, ev(fmt.Sprintf("rank %d", p.Rank), "not in a collective (last entered seq %d, last completed %d%s)", p.LastEntered, p.LastCompleted, stepOf(s.Steps, p.Rank)))
				names = append(names, fmt.Sprintf("rank %d is not in a collective (last seq %d)", p.Rank, p.LastEntered))
			case p.Waiting.Seq != wt.Seq:
				elsewhere = append(elsewhere, ev(fmt.Sprintf("rank %d", p.Rank), "waits in %s seq %d for %s%s", p.Waiting.Op, p.Waiting.Seq, ms(p.Waiting.DurationMS), stepOf(s.Steps, p.Rank)))
				names = append(names, fmt.Sprintf("rank %d waits in %s seq %d", p.Rank, p.Waiting.Op, p.Waiting.Seq))
			}
		}
		if len(elsewhere) == 0 {
			continue
		}
		evidence := []Evidence{
			ev(fmt.Sprintf("rank %d", r.Rank), "waits in %s seq %d for %s (threshold %v)%s", wt.Op, wt.Seq, ms(wt.DurationMS), wait, stepOf(s.Steps, r.Rank)),
		}
		evidence = append(evidence, elsewhere...)
		if col.Broken {
			evidence = append(evidence, ev("group", "broken: %s", col.BrokenReason))
		}
		out = append(out, Finding{
			Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: r.Rank,
			Summary:  fmt.Sprintf("rank %d waits in %s seq %d for %s while %s", r.Rank, wt.Op, wt.Seq, ms(wt.DurationMS), listSep(names, 3, "; ")),
			Evidence: evidence,
			Remedy:   desyncRemedy,
		})
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
