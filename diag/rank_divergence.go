package diag

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func rankDivergence(c Config) Rule {
	return Rule{
		Name:     "rank-divergence",
		Doc:      "The TP ranks of a server disagree on their step or on a communicator's sequence number (control or forward), or one waits in a collective while a peer is elsewhere: in no collective, in another call of that communicator or in a call of the other one (incident 2, the overlap-schedule desync), which hangs the server while every rank is alive; the finding gives each rank's loop, step, phase and the call (communicator, seq, op) it waits in, and the fault switches on.",
		Severity: Critical,
		Check:    func(w Window) []Finding { return checkRankDivergence(c, w) },
	}
}

// loopName is the rank loop named when a step record names none (a
// server from before steps carried it): the engine has one, the
// lock-step loop, and publishes no other.
const loopName = "lockstep"

// faultEvidence is one line per fault switch on: a rank held on purpose
// explains a divergence.
func faultEvidence(s ServerSample) []Evidence {
	docs := map[string]string{}
	if s.Faults != nil {
		for _, f := range s.Faults.Faults {
			docs[f.Name] = f.Doc
		}
	}
	var out []Evidence
	for _, n := range faultsOn(&s) {
		if d := docs[n]; d != "" {
			out = append(out, ev("fault switch", "%s on: %s", n, d))
		} else {
			out = append(out, ev("fault switch", "%s on", n))
		}
	}
	return out
}

// desyncRemedy says what to do about ranks of s that parted: switch off
// the stall-last-rank fault when it holds them on purpose (the ranks meet
// again), else keep the evidence and restart the server, switching off
// any fault switch on first.
func desyncRemedy(s ServerSample) string {
	names := faultsOn(&s)
	bundle := "capture a bundle (pdctl bundle -o FILE.tar.gz) with the flight recorders and stacks"
	if slices.Contains(names, "stall-last-rank") {
		return fmt.Sprintf("the fault stall-last-rank holds the highest TP rank before its next collective on purpose: "+
			"switch it off (pdctl fault off stall-last-rank --server %s) and the ranks meet again; to keep the evidence, %s first.", s.URL, bundle)
	}
	var offs []string
	for _, n := range names {
		offs = append(offs, fmt.Sprintf("pdctl fault off %s --server %s", n, s.URL))
	}
	fault := ""
	if len(offs) > 0 {
		fault = ", switch off the fault switches on (" + strings.Join(offs, "; ") + ")"
	}
	return "the ranks took different branches before a collective, or one rank is stuck outside the collectives: " +
		bundle + fault + ", then restart the server (the group does not recover in place)."
}

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
	// A communicator broken (a collective mismatch: the ranks took
	// different branches), or a rank waiting in a collective too long
	// while a peer is not in it.
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.Collectives == nil {
			continue
		}
		ws := collectiveWaits(c.LimitsOf(&s).CollectiveWait, s)
		if f, ok := brokenGroup(s); ok && len(ws) == 0 {
			out = append(out, f) // a wait's finding names the broken communicator too
		}
		out = append(out, ws...)
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
			Evidence: append([]Evidence{
				at,
				ev("steps", "%s", stepList(rs)),
				ev("spread", "%d (at most 1 mid-iteration)", hi.Step-lo.Step),
			}, faultEvidence(s)...),
			Remedy: desyncRemedy(s),
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
				Evidence: append([]Evidence{
					at,
					ev("steps", "%s", stepList(rs)),
					ev(fmt.Sprintf("rank %d", a.Rank), "%s loop, step %d (%s), control_seq %d, forward_seq %d, digest %s, not in a collective", loopOf(a), a.Step, a.Phase, a.ControlSeq, a.ForwardSeq, a.Digest),
					ev(fmt.Sprintf("rank %d", b.Rank), "%s loop, step %d (%s), control_seq %d, forward_seq %d, digest %s, not in a collective", loopOf(b), b.Step, b.Phase, b.ControlSeq, b.ForwardSeq, b.Digest),
				}, faultEvidence(s)...),
				Remedy: desyncRemedy(s),
			}, true
		}
	}
	return Finding{}, false
}

// loopOf is the loop rank r's step record names.
func loopOf(r debug.Step) string {
	if r.Loop != "" {
		return r.Loop
	}
	return loopName
}

func stepList(rs []debug.Step) string {
	var parts []string
	for _, r := range rs {
		parts = append(parts, fmt.Sprintf("rank %d %s loop step %d (%s) control seq %d forward seq %d", r.Rank, loopOf(r), r.Step, r.Phase, r.ControlSeq, r.ForwardSeq))
	}
	return listSep(parts, len(parts), "; ")
}

// wait is a call a rank waits in, with its communicator.
type wait struct {
	comm string
	call *debug.Collective
}

// String names the call with its communicator, whose seq it is, and the
// rank loop's phase it is for when the server says: "control seq 41
// AllReduceMin (poll)". Two ranks parted at one seq are in different
// phases of their loop's table (engine/rankcore): the phases say how.
func (w wait) String() string {
	s := fmt.Sprintf("%s seq %d %s", w.comm, w.call.Seq, w.call.Op)
	if w.call.Phase != "" {
		s += " (" + w.call.Phase + ")"
	}
	return s
}

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
// of the communicator, or in a call of the other communicator. Each
// finding gives every rank of the server: its loop, step and phase, and
// the call it waits in (communicator, seq, op) or where it stopped.
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
			var names []string
			for _, p := range comm.Ranks {
				if p.Rank == r.Rank || p.Waiting != nil && p.Waiting.Seq == wt.call.Seq {
					continue // the rank itself, or a peer that arrived
				}
				if pw := waitsOf(col, p.Rank); len(pw) > 0 {
					var in []string
					for _, w := range pw {
						in = append(in, w.String())
					}
					names = append(names, fmt.Sprintf("rank %d waits in %s", p.Rank, strings.Join(in, " and ")))
					continue
				}
				names = append(names, fmt.Sprintf("rank %d is not in a collective (last %s seq %d)", p.Rank, comm.Name, p.LastEntered))
			}
			if len(names) == 0 {
				continue
			}
			var evidence []Evidence
			for _, p := range comm.Ranks {
				key := fmt.Sprintf("rank %d", p.Rank)
				where := ""
				switch pw := waitsOf(col, p.Rank); {
				case p.Rank == r.Rank:
					where = fmt.Sprintf("waits in %v for %s (threshold %v)", wt, ms(wt.call.DurationMS), limit)
					for _, w := range pw {
						if w.comm != wt.comm {
							where += fmt.Sprintf(" and in %v for %s", w, ms(w.call.DurationMS))
						}
					}
				case len(pw) > 0:
					where = waitsText(pw)
				default:
					where = fmt.Sprintf("not in a collective (%s)", lastSeqs(col, p.Rank))
				}
				evidence = append(evidence, ev(key, "%s", rankWhere(s.Steps, p.Rank)+where))
			}
			for _, g := range col.Comms {
				if g.Broken {
					evidence = append(evidence, ev(g.Name+" communicator", "broken: %s", g.BrokenReason))
				}
			}
			evidence = append(evidence, faultEvidence(s)...)
			out = append(out, Finding{
				Rule: "rank-divergence", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
				Summary:  fmt.Sprintf("rank %d waits in %v for %s while %s", r.Rank, wt, ms(wt.call.DurationMS), listSep(names, 3, "; ")),
				Evidence: evidence,
				Remedy:   desyncRemedy(s),
			})
		}
	}
	return out
}

// brokenGroup names a server whose TP group broke on a communicator (the
// collective layer's mismatch when ranks enter different calls at one
// seq, as in the overlap-schedule desync): each rank's loop, step and
// phase and where it stopped, the broken communicators with the mismatch,
// and the fault switches on. A server that recovers in place
// (--collective-timeout) rebuilds its group at once, so one still broken
// when sampled has stopped.
func brokenGroup(s ServerSample) (Finding, bool) {
	col := s.Collectives
	var broken []string
	var evidence []Evidence
	for _, g := range col.Comms {
		if g.Broken {
			broken = append(broken, g.Name)
			evidence = append(evidence, ev(g.Name+" communicator", "broken: %s", g.BrokenReason))
		}
	}
	if len(broken) == 0 {
		return Finding{}, false
	}
	var ranks []int
	if s.Steps != nil {
		for _, r := range s.Steps.Ranks {
			ranks = append(ranks, r.Rank)
		}
	} else if len(col.Comms) > 0 {
		for _, r := range col.Comms[0].Ranks {
			ranks = append(ranks, r.Rank)
		}
	}
	var where []Evidence
	for _, r := range ranks {
		at := "not in a collective (" + lastSeqs(col, r) + ")"
		if ws := waitsOf(col, r); len(ws) > 0 {
			at = waitsText(ws)
		}
		where = append(where, ev(fmt.Sprintf("rank %d", r), "%s", rankWhere(s.Steps, r)+at))
	}
	what := "communicator is"
	if len(broken) > 1 {
		what = "communicators are"
	}
	remedy := strings.TrimSuffix(desyncRemedy(s), " (the group does not recover in place).") +
		"; a server started with --collective-timeout above 0 (pdserve's default) rebuilds a broken group itself and serves on."
	return Finding{
		Rule: "rank-divergence", Severity: Critical, Server: s.URL,
		Summary:  fmt.Sprintf("the rank group of the %s server is broken: its %s %s broken (the ranks entered different collectives)", s.Role, strings.Join(broken, " and "), what),
		Evidence: append(append(where, evidence...), faultEvidence(s)...),
		Remedy:   remedy,
	}, true
}

// rankWhere is a rank's loop, step and phase, as its evidence line
// starts: "lockstep loop, step 7311 (decode), ".
func rankWhere(st *debug.StepsResponse, rank int) string {
	if st != nil {
		for _, r := range st.Ranks {
			if r.Rank == rank {
				if r.Phase == "" {
					return fmt.Sprintf("%s loop, step %d, ", loopOf(r), r.Step)
				}
				return fmt.Sprintf("%s loop, step %d (%s), ", loopOf(r), r.Step, r.Phase)
			}
		}
	}
	return loopName + " loop, "
}
