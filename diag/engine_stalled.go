package diag

import (
	"fmt"
	"time"
)

func engineStalled(c Config) Rule {
	return Rule{
		Name:     "engine-stalled",
		Doc:      "No rank of a server finished a step during the window although a loop iterates at least every heartbeat, idle or not: the server serves nothing while every rank may look alive.",
		Severity: Critical,
		Check:    func(w Window) []Finding { return checkEngineStalled(c, w) },
	}
}

func checkEngineStalled(c Config, w Window) []Finding {
	if len(w.Samples) < 2 {
		return nil
	}
	var out []Finding
	first := w.First()
	for _, last := range w.Last().Servers {
		f := first.Server(last.URL)
		if !last.Reachable || last.Steps == nil || f == nil || !f.Reachable || f.Steps == nil || len(last.Steps.Ranks) == 0 {
			continue
		}
		stall := c.LimitsOf(&last).LoopStall
		if w.Span() < stall {
			continue
		}
		moved := false
		var ranks []string
		for _, r := range last.Steps.Ranks {
			before, ok := stepOfRank(f, r.Rank)
			moved = moved || !ok || r.Step != before
			where := "not in a collective"
			if ws := waitsOf(last.Collectives, r.Rank); len(ws) > 0 {
				where = waitsText(ws)
			}
			age := "never"
			if !r.End.IsZero() {
				age = w.Last().Taken.Sub(r.End).Round(time.Millisecond).String()
			}
			ranks = append(ranks, fmt.Sprintf("rank %d at step %d (%s, last step ended %s before the sample), %s", r.Rank, r.Step, r.Phase, age, where))
		}
		if moved {
			continue
		}
		out = append(out, Finding{
			Rule: "engine-stalled", Severity: Critical, Server: last.URL, Rank: nil,
			Summary:  fmt.Sprintf("no rank of the %s server finished a step in %v", last.Role, w.Span().Round(time.Millisecond)),
			Evidence: []Evidence{ev("window", "%v over %d samples (threshold %v)", w.Span().Round(time.Millisecond), len(w.Samples), stall), ev("ranks", "%s", listSep(ranks, 8, "; "))},
			Remedy:   fmt.Sprintf("the engine loop is stuck: read the ranks' stacks (pdctl bundle, or GET %s/debug/v1/stacks?rank=N) and the collectives (rank-divergence); a fault switch such as stall-last-rank holds a rank on purpose (fault-switch-on); restart the server if it does not move.", last.URL),
		})
	}
	return out
}

// stepOfRank is rank's step in s.
func stepOfRank(s *ServerSample, rank int) (uint64, bool) {
	for _, r := range s.Steps.Ranks {
		if r.Rank == rank {
			return r.Step, true
		}
	}
	return 0, false
}
