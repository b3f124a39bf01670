package diag

import (
	"fmt"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func engineRestarts(c Config) Rule {
	return Rule{
		Name: "engine-restarts",
		Doc: "A server rebuilt its rank group (a collective waited past --collective-timeout, or the group broke) " +
			"inside the window or shortly before it, failing what was in flight: the failed group's last error says " +
			"which ranks parted in which calls, so the rank desync of incident 2 is named even after the group " +
			"was rebuilt; several rebuilds in a minute are a restart loop.",
		Severity: Critical,
		Basis:    LastSample,
		Check:    func(w Window) []Finding { return checkEngineRestarts(c, w) },
	}
}

// RestartLoop is the rebuilds within a minute that make a restart loop.
const RestartLoop = 3

// checkEngineRestarts reads, per server, the rebuild count at the first
// and the last sample where it answered and its last failure: rebuilds in
// the window, or a last failure within Config.RecentRestart before the
// last sample (evidence from state: a window that opens after the storm
// still names it).
func checkEngineRestarts(c Config, w Window) []Finding {
	last := w.Last()
	var out []Finding
	for _, s := range last.Servers {
		if !s.Reachable || s.Collectives == nil {
			continue
		}
		first := firstAnswer(w, s.URL)
		grew := s.Collectives.Restarts
		span := time.Duration(0)
		if first != nil && first.sample.Collectives.Restarts <= s.Collectives.Restarts {
			grew -= first.sample.Collectives.Restarts
			span = last.Taken.Sub(first.taken)
		}
		lf := s.Collectives.LastFailure
		recent := lf != nil && last.Taken.Sub(lf.At) <= c.RecentRestart
		if grew == 0 && !recent {
			continue
		}
		if first == nil || first.sample.Collectives.Restarts > s.Collectives.Restarts {
			grew = 0 // a restarted process counts from zero: the window saw none of its own
		}
		loop := grew >= RestartLoop || (grew >= 2 && span <= time.Minute)
		sev := Warning
		summary := "the server rebuilt its rank group"
		switch {
		case loop:
			sev = Critical
			summary = fmt.Sprintf("the server is in a restart loop: it rebuilt its rank group %d times in %s, failing what was in flight each time", grew, span.Round(time.Millisecond))
		case grew > 0:
			summary = fmt.Sprintf("the server rebuilt its rank group %s during the window, failing what was in flight", times(grew))
		default:
			summary = fmt.Sprintf("the server rebuilt its rank group %s before the last sample, failing what was in flight", last.Taken.Sub(lf.At).Round(time.Millisecond))
		}
		evidence := []Evidence{ev("rebuilds", "%d since the server started, %d in the window (%s)", s.Collectives.Restarts, grew, span.Round(time.Millisecond))}
		if lf != nil {
			summary += ": " + lf.Reason
			evidence = append(evidence,
				ev("last failure", "%s before the last sample, boot %s: %s", last.Taken.Sub(lf.At).Round(time.Millisecond), lf.Boot, lf.Reason))
			evidence = append(evidence, failedGroup(lf)...)
		}
		evidence = append(evidence, faultEvidence(s)...)
		f := Finding{Rule: "engine-restarts", Severity: sev, Server: s.URL, Summary: summary,
			Evidence: evidence, Remedy: restartRemedy(s, loop)}
		if grew == 0 && lf != nil {
			f.Seen = "the last rebuild, " + before(w, lf.At)
		}
		out = append(out, f)
	}
	return out
}

// answer is a server's sample that answered with its collectives, and
// when it was taken.
type answer struct {
	sample ServerSample
	taken  time.Time
}

// firstAnswer is url's first sample in w that answered with its
// collectives; nil when none did.
func firstAnswer(w Window, url string) *answer {
	for _, smp := range w.Samples {
		if s := smp.Server(url); s != nil && s.Reachable && s.Collectives != nil {
			return &answer{*s, smp.Taken}
		}
	}
	return nil
}

// failedGroup says where each rank of a failed group was on each of its
// communicators when the group gave up: the call it waited in, or where it
// stopped.
func failedGroup(lf *debug.GroupFailure) []Evidence {
	col := &debug.CollectivesResponse{Comms: lf.Comms}
	var out []Evidence
	seen := map[int]bool{}
	for _, g := range lf.Comms {
		if g.Broken {
			out = append(out, ev(g.Name+" communicator", "broken: %s", g.BrokenReason))
		}
		for _, r := range g.Ranks {
			if seen[r.Rank] {
				continue
			}
			seen[r.Rank] = true
			at := "in no collective (" + lastSeqs(col, r.Rank) + ")"
			if ws := waitsOf(col, r.Rank); len(ws) > 0 {
				at = waitsText(ws)
			}
			out = append(out, ev(fmt.Sprintf("failed group rank %d", r.Rank), "%s", at))
		}
	}
	return out
}

func restartRemedy(s ServerSample, loop bool) string {
	var offs []string
	for _, n := range faultsOn(&s) {
		offs = append(offs, fmt.Sprintf("pdctl fault off %s --server %s", n, s.URL))
	}
	if len(offs) > 0 {
		return "a fault switch is on and is the likely cause: " + strings.Join(offs, "; ") + "; then the group stays up."
	}
	r := "the ranks parted in different collectives (the failed group's ranks above) or one waited past --collective-timeout: " +
		"capture a bundle (pdctl bundle -o FILE.tar.gz) with the flight recorders"
	if loop {
		r += "; a loop means the cause outlives each rebuild: if the calls above are the same op and seq on every rank, the group is only slow, " +
			"and a longer --collective-timeout lets it finish; otherwise the ranks branch differently, which a restart of the server does not mend"
	}
	return r + "."
}

// times says n as "once", "twice" or "N times".
func times(n uint64) string {
	switch n {
	case 1:
		return "once"
	case 2:
		return "twice"
	}
	return fmt.Sprintf("%d times", n)
}
