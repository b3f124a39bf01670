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

// partition is a silent prefill that is not gone: it answers HTTP, its
// ranks' receive loops are alive and it did not restart over the window.
type partition struct {
	server    string
	direction string
	evidence  []Evidence
}

// partitionOf says whether the prefill ranks at peers (endpoints a decode
// rank lost the heartbeats of) belong to a server that is up and has not
// restarted: a partition of the PD link. The direction comes from the
// prefill's own socket: messages still arriving (the decode's probes
// reach it) mean its answers are what is lost; none, that nothing from
// the decode arrives either (or the link is cut both ways).
func partitionOf(w Window, peers []string) *partition {
	if len(w.Samples) < 2 {
		return nil // one sample shows neither a restart nor traffic
	}
	first, last := w.First(), w.Last()
	for _, p := range last.Servers {
		if !p.Reachable || p.PD == nil || p.PD.Role != "prefill" {
			continue
		}
		for _, r := range p.PD.Ranks {
			own := r.Socket.Advertised
			if own == "" {
				own = r.Socket.Endpoint
			}
			if !slices.ContainsFunc(peers, func(e string) bool { return sameEndpoint(e, own) }) || !r.Socket.Alive {
				continue
			}
			was := first.Server(p.URL)
			if was == nil || !was.Reachable {
				return nil // not seen up the whole window: no judgement
			}
			if restarted(was, &p) {
				return nil
			}
			part := &partition{server: p.URL, evidence: []Evidence{
				ev("prefill", "%s answers HTTP, rank %d's receive loop is alive, no restart over the window", p.URL, r.Rank),
			}}
			var before uint64
			for _, br := range was.PD.Ranks {
				if br.Rank == r.Rank {
					before = br.Socket.Messages
				}
			}
			if grew := r.Socket.Messages - min(r.Socket.Messages, before); grew > 0 {
				part.direction = "the prefill still receives from the decode, its answers do not arrive"
				part.evidence = append(part.evidence, ev("prefill receives", "%d messages over the window on %s", grew, own))
			} else {
				part.direction = "the prefill receives nothing from the decode, so at least that way is cut"
				part.evidence = append(part.evidence, ev("prefill receives", "no message over the window on %s", own))
			}
			return part
		}
	}
	return nil
}

// restarted says whether a prefill server's bootstrap registry lists a
// new instance of any rank between two samples.
func restarted(a, b *ServerSample) bool {
	if a.Registry == nil || b.Registry == nil {
		return false
	}
	for _, x := range a.Registry.Ranks {
		for _, y := range b.Registry.Ranks {
			if x.Rank == y.Rank && x.InstanceID != y.InstanceID {
				return true
			}
		}
	}
	return false
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
			evidence := []Evidence{
				ev("peers", "%s", list(peers, 10)),
				ev("rooms", "%s", list(rooms, 10)),
				ev("error", "%s", listSep(errs, 3, "; ")),
			}
			if part := partitionOf(w, peers); part != nil {
				out = append(out, Finding{
					Rule: "peer-unreachable", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
					Summary: fmt.Sprintf("the PD link between prefill %s and decode rank %d is cut (%s failed): %s",
						part.server, r.Rank, nRooms(len(rooms)), part.direction),
					Evidence: append(evidence, part.evidence...),
					Remedy: fmt.Sprintf("a network partition, not a restart: check the network between this decode server and %s on the PD ports "+
						"(firewall rules, a network policy, a lossy or saturated link: ping, and the ports of the sockets above); "+
						"restarting either server does not mend it.", part.server),
				})
				continue
			}
			out = append(out, Finding{
				Rule: "peer-unreachable", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
				Summary:  fmt.Sprintf("decode rank %d lost the heartbeats of prefill %s (%s failed)", r.Rank, listSep(peers, 3, ", "), nRooms(len(rooms))),
				Evidence: evidence,
				Remedy:   "the prefill ranks named stopped answering heartbeats: check that their server runs and its control loop is alive (control-loop-dead); restart it, and route around it meanwhile.",
			})
		}
	}
	return out
}
