package diag

import (
	"fmt"
	"slices"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// SlowLinkAfter is how long the KV of a room may have left its prefill
// (the prefill's room is inflight, every chunk sent) without reaching the
// decode before pd-link-slow names the link: on a working link the KV
// lands within milliseconds, however busy the servers.
const SlowLinkAfter = time.Second

func pdLinkSlow() Rule {
	return Rule{
		Name: "pd-link-slow",
		Doc: "KV a prefill has sent has not reached its decode for seconds while the decode still receives: the PD link between them " +
			"is slow or lossy (a saturated or thinned link, packet loss and retransmits), so time to first token grows with the KV's size.",
		Severity: Warning,
		Check:    checkPDLinkSlow,
	}
}

// inTransit is one room whose KV is on the wire: sent by a prefill rank,
// not all landed on the decode rank.
type inTransit struct {
	room       debug.ID
	sent, got  int
	since      time.Duration // seen in transit for this long over the window
	prefill    string
	prefillRnk int
}

func checkPDLinkSlow(w Window) []Finding {
	if len(w.Samples) < 2 {
		return nil // one sample shows no time passing
	}
	last := w.Last()
	var out []Finding
	for _, s := range last.Servers {
		if !s.Reachable || s.PD == nil || s.PD.Role != "decode" {
			continue
		}
		for _, r := range s.PD.Ranks {
			stuck := transitRooms(w, s.URL, r.Rank)
			if len(stuck) == 0 {
				continue
			}
			// The decode rank still receives: a silent link is a
			// partition (peer-unreachable), not a slow one.
			got := received(w, s.URL, r.Rank)
			if got == 0 {
				continue
			}
			span := w.Span().Seconds()
			var rooms []debug.ID
			var missing int
			var longest time.Duration
			for _, t := range stuck {
				rooms = append(rooms, t.room)
				missing += t.sent - t.got
				longest = max(longest, t.since)
			}
			// KV the rank received and its loop has not applied is not
			// in transit: a busy or stalled decode loop, not the link.
			if missing -= int(r.PendingKVBytes); missing <= 0 {
				continue
			}
			slices.Sort(rooms)
			p := stuck[0]
			out = append(out, Finding{Rule: "pd-link-slow", Severity: Warning, Server: s.URL, Rank: AtRank(r.Rank),
				Summary: fmt.Sprintf("the KV of %s left prefill %s and has not reached decode rank %d for up to %s: the PD link between them is slow or lossy",
					nRooms(len(rooms)), p.prefill, r.Rank, longest.Round(100*time.Millisecond)),
				Evidence: []Evidence{
					ev("rooms", "%s", list(rooms, 10)),
					ev("in transit", "%s sent by prefill rank %d, not yet landed", bytesText(missing), p.prefillRnk),
					ev("decode receives", "%s over the window's %s (%s/s)", bytesText(int(got)), w.Span().Round(time.Millisecond), bytesText(int(float64(got)/span))),
				},
				Remedy: fmt.Sprintf("check the network between %s and this decode server on the PD ports: its bandwidth and loss (ip -s link on both hosts, "+
					"the NICs' drop and error counters, ping under load); meanwhile a slow link needs a longer --transfer-timeout, and fewer requests at once (--max-running) keep each transfer within it.", p.prefill)})
		}
	}
	return out
}

// transitRooms are the rooms decode rank rank of the server at url has
// been receiving for at least SlowLinkAfter, over the window, while their
// prefill rank had sent all of its KV: every sample that shows the room
// shows it in transit, the first at least SlowLinkAfter before the last.
func transitRooms(w Window, url string, rank int) []inTransit {
	seen := map[debug.ID]time.Time{}
	var last map[debug.ID]inTransit
	for _, smp := range w.Samples {
		now := map[debug.ID]inTransit{}
		s := smp.Server(url)
		if s == nil || !s.Reachable || s.PD == nil {
			continue
		}
		for _, e := range entries(pdRank(s.PD, rank), "transfer") {
			if e.Peer == "" || e.Error != "" {
				continue
			}
			owner, pr := prefillOf(smp, e.Peer)
			if owner == nil {
				continue
			}
			for _, pe := range entries(pr, "inflight") {
				if pe.Room == e.Room && pe.Bytes > e.Bytes {
					now[e.Room] = inTransit{room: e.Room, sent: pe.Bytes, got: e.Bytes, prefill: owner.URL, prefillRnk: pr.Rank}
				}
			}
		}
		for room := range seen {
			if _, ok := now[room]; !ok {
				delete(seen, room) // landed, or gone: the clock starts again
			}
		}
		for room, t := range now {
			if _, ok := seen[room]; !ok {
				seen[room] = smp.Taken
			}
			t.since = smp.Taken.Sub(seen[room])
			now[room] = t
		}
		last = now
	}
	var out []inTransit
	for _, t := range last {
		if t.since >= SlowLinkAfter {
			out = append(out, t)
		}
	}
	slices.SortFunc(out, func(a, b inTransit) int { return int(b.since - a.since) })
	return out
}

// pdOf is s's PD answer; nil for no sample or no answer.
func pdOf(s *ServerSample) *debug.PDResponse {
	if s == nil || !s.Reachable {
		return nil
	}
	return s.PD
}

// bytesText writes a byte count in the unit that fits it.
func bytesText(n int) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
