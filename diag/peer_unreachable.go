package diag

import (
	"fmt"
	"slices"
	"strings"

	"github.com/pdkit/pdkit/api/debug"
)

func peerUnreachable() Rule {
	return Rule{
		Name:     "peer-unreachable",
		Doc:      "A server does not answer its debug API, or a decode rank reports its prefill peer silent past the heartbeat timeout, so requests routed there fail or hang.",
		Severity: Critical,
		Check:    checkPeerUnreachable,
	}
}

func checkPeerUnreachable(w Window) []Finding {
	var out []Finding
	first := w.First()
	for _, s := range w.Last().Servers {
		if !s.Reachable {
			since := "unreachable in the first sample too"
			if f := first.Server(s.URL); f != nil && f.Reachable {
				since = "reachable in the first sample"
			}
			errText := s.Error
			if errText == "" {
				errText = "(none given)"
			}
			out = append(out, Finding{
				Rule: "peer-unreachable", Severity: Critical, Server: s.URL, Rank: nil,
				Summary: fmt.Sprintf("the %s server does not answer: %s", s.Role, errText),
				Evidence: []Evidence{
					ev("role", "%s", s.Role),
					ev("error", "%s", errText),
					ev("history", "%s", since),
					ev("took", "%s", ms(s.TookMS)),
				},
				Remedy: fmt.Sprintf("check that the %s server process at %s runs and its port is reachable from here and from its peers; restart it if it is gone (its rooms fail on the peers' heartbeat timeout).", s.Role, s.URL),
			})
			continue
		}
		if s.PD == nil || s.PD.Role != "decode" {
			continue
		}
		for _, r := range s.PD.Ranks {
			var rooms []debug.ID
			var peers, errs []string
			for _, e := range r.Entries {
				if !strings.Contains(e.Error, "silent") {
					continue
				}
				rooms = append(rooms, e.Room)
				if e.Peer != "" && !slices.Contains(peers, e.Peer) {
					peers = append(peers, e.Peer)
				}
				if !slices.Contains(errs, e.Error) {
					errs = append(errs, e.Error)
				}
			}
			if len(rooms) == 0 {
				continue
			}
			slices.Sort(rooms)
			slices.Sort(peers)
			out = append(out, Finding{
				Rule: "peer-unreachable", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
				Summary: fmt.Sprintf("decode rank %d lost the heartbeats of prefill %s (%s failed)", r.Rank, listSep(peers, 3, ", "), nRooms(len(rooms))),
				Evidence: []Evidence{
					ev("peers", "%s", list(peers, 10)),
					ev("rooms", "%s", list(rooms, 10)),
					ev("error", "%s", listSep(errs, 3, "; ")),
				},
				Remedy: "the prefill ranks named stopped answering heartbeats: check that their server runs and its control loop is alive (control-loop-dead); restart it, and route around it meanwhile.",
			})
		}
	}
	return out
}
