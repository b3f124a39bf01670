package diag

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func peerUnreachable() Rule {
	return Rule{
		Name:     "peer-unreachable",
		Doc:      "A server does not answer its debug API, or a decode rank reports its prefill peer silent past the heartbeat timeout, so requests routed there fail or hang.",
		Severity: Critical,
		Basis:    LastSample,
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
		judged := map[int][]string{}
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
			judged[r.Rank] = peers
			evidence := []Evidence{
				ev("peers", "%s", list(peers, 10)),
				ev("rooms", "%s", list(rooms, 10)),
				ev("error", "%s", listSep(errs, 3, "; ")),
			}
			if part := partitionOf(w, peers); part != nil {
				out = append(out, Finding{
					Rule: "peer-unreachable", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank), Seen: seen(w, OverWindow),
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
		out = append(out, lostPeers(w, s, judged)...)
	}
	return out
}

// LostRecent is how long before the last sample a decode rank's loss of
// a prefill peer (rooms failed on the heartbeat timeout, from its peer
// table) still counts: the rooms are gone from the queues by then, and
// the loss is named from state even when the window saw no traffic.
const LostRecent = 2 * time.Minute

// lostPeers judges the prefill peers decode server s's ranks lost
// recently by their peer tables (judged: the ones its queues already
// named): a partition when the prefill answers HTTP with the boot the
// decode last heard, a restart when its boot changed or its endpoint is
// gone.
func lostPeers(w Window, s ServerSample, judged map[int][]string) []Finding {
	last := w.Last()
	var out []Finding
	for _, r := range s.PD.Ranks {
		for _, p := range r.Peers {
			if p.LastLost == nil || last.Taken.Sub(*p.LastLost) > LostRecent || slices.ContainsFunc(judged[r.Rank], func(e string) bool { return sameEndpoint(e, p.Endpoint) }) {
				continue
			}
			if f := judgeLost(w, s.URL, r.Rank, p); f != nil {
				out = append(out, *f)
			}
		}
	}
	return out
}

// judgeLost names what became of peer p, which decode rank rank of the
// server at url lost; nil when the prefill it belongs to does not answer
// (the server-level finding names that).
func judgeLost(w Window, url string, rank int, p debug.PDPeer) *Finding {
	last := w.Last()
	ago := last.Taken.Sub(*p.LastLost).Round(time.Second)
	lost := ev("lost", "%s failed on the heartbeat timeout, the last %s before the last sample (%s)", nRooms(int(p.LostRooms)), ago, p.LastLost.UTC().Format(time.TimeOnly))
	heard := ev("last word", "never")
	if p.LastWord != nil {
		heard = ev("last word", "%s (%s before the last sample)", p.LastWord.UTC().Format(time.TimeOnly), last.Taken.Sub(*p.LastWord).Round(time.Second))
	}
	owner, prefillRank := prefillOf(last, p.Endpoint)
	f := judgeLostPeer(w, url, rank, p, owner, prefillRank, lost, heard, ago)
	if f != nil {
		f.Seen = "the last loss, " + before(w, *p.LastLost)
	}
	return f
}

// judgeLostPeer is judgeLost's verdict once the peer's owner (nil: no
// reachable prefill advertises it) is found.
func judgeLostPeer(w Window, url string, rank int, p debug.PDPeer, owner *ServerSample, prefillRank *debug.PDRank, lost, heard Evidence, ago time.Duration) *Finding {
	last := w.Last()
	heardSince := p.LastWord != nil && p.LastWord.After(*p.LastLost)
	if owner == nil {
		for _, x := range last.Servers {
			if x.Role == "prefill" && (!x.Reachable || x.PD == nil) {
				return nil // perhaps the unreachable one's: no judgement
			}
		}
		return &Finding{Rule: "peer-unreachable", Severity: Warning, Server: url, Rank: AtRank(rank),
			Summary:  fmt.Sprintf("decode rank %d lost prefill rank %s, which no prefill of the cluster advertises now: the prefill restarted on new ports, or left", rank, p.Endpoint),
			Evidence: []Evidence{lost, heard},
			Remedy:   "the rooms in flight then failed and their clients got errors; read the prefill's log for why it restarted, and pdctl status for the servers now in the cluster."}
	}
	// The boot the peer had when it was lost: a restart on the same
	// endpoint answers the decode's later probes with its new one.
	bootThen := or(p.BootAtLoss, p.Boot)
	if bootThen != "" && prefillRank.Boot != "" && bootThen != prefillRank.Boot {
		return &Finding{Rule: "peer-unreachable", Severity: Warning, Server: url, Rank: AtRank(rank),
			Summary:  fmt.Sprintf("prefill %s restarted under decode rank %d (boot %s, now %s): %s in flight failed", owner.URL, rank, bootThen, prefillRank.Boot, nRooms(int(p.LostRooms))),
			Evidence: []Evidence{lost, heard, ev("prefill", "%s rank %d answers with boot %s; before the loss the decode heard boot %s", owner.URL, prefillRank.Rank, prefillRank.Boot, bootThen)},
			Remedy: "a restart, not a partition: the prefill's log says why it restarted (pdctl diagnose names an engine restart loop as engine-restarts); " +
				"its rooms in flight failed and their clients got errors."}
	}
	evidence := []Evidence{lost, heard,
		ev("prefill", "%s answers HTTP and its rank %d still has boot %s, the one the decode heard before the loss: no restart", owner.URL, prefillRank.Rank, or(bootThen, "(none heard)"))}
	direction := ""
	if first := w.First().Server(owner.URL); len(w.Samples) > 1 && first != nil && first.Reachable && first.PD != nil {
		if br := pdRank(first.PD, prefillRank.Rank); br != nil {
			switch grew := prefillRank.Socket.Messages - min(prefillRank.Socket.Messages, br.Socket.Messages); {
			case grew > 0 && !heardSince:
				direction = ": the prefill still receives from the decode, its answers do not arrive"
				evidence = append(evidence, ev("prefill receives", "%d messages over the window", grew))
			case p.LastProbe != nil && !p.LastProbe.Before(w.First().Taken) && !heardSince:
				direction = ": nothing from the decode reaches the prefill either"
				evidence = append(evidence, ev("prefill receives", "no message over the window, though the decode probed it at %s", p.LastProbe.UTC().Format(time.TimeOnly)))
			}
		}
	}
	if got := received(w, url, rank); got > 0 && !heardSince {
		evidence = append(evidence, ev("decode receives", "%s over the window's %s", bytesText(int(got)), w.Span().Round(time.Millisecond)))
		return &Finding{Rule: "peer-unreachable", Severity: Critical, Server: url, Rank: AtRank(rank),
			Summary:  fmt.Sprintf("the PD link between prefill %s and decode rank %d is too slow or lossy: %s failed on the heartbeat timeout while KV still arrived", owner.URL, rank, nRooms(int(p.LostRooms))),
			Evidence: evidence,
			Remedy: fmt.Sprintf("not a partition nor a restart: the link carries so little that no word of the prefill arrived within the heartbeat timeout; check the network between this decode server and %s "+
				"(its bandwidth and loss: ip -s link on both hosts, the NICs' drop and error counters), and meanwhile raise --heartbeat-timeout and --transfer-timeout on the decode.", owner.URL)}
	}
	if heardSince {
		return &Finding{Rule: "peer-unreachable", Severity: Warning, Server: url, Rank: AtRank(rank),
			Summary:  fmt.Sprintf("the PD link between prefill %s and decode rank %d was cut %s ago (%s failed); the decode has heard the prefill since", owner.URL, rank, ago, nRooms(int(p.LostRooms))),
			Evidence: evidence,
			Remedy:   "a network partition that mended, not a restart: check the network between the two servers on the PD ports for what dropped it (a flapping link, a firewall or network policy change); pdctl diagnose names it again if it recurs."}
	}
	return &Finding{Rule: "peer-unreachable", Severity: Critical, Server: url, Rank: AtRank(rank),
		Summary:  fmt.Sprintf("the PD link between prefill %s and decode rank %d is cut (%s failed)%s", owner.URL, rank, nRooms(int(p.LostRooms)), direction),
		Evidence: evidence,
		Remedy: fmt.Sprintf("a network partition, not a restart: check the network between this decode server and %s on the PD ports "+
			"(firewall rules, a network policy, routes, a lossy or saturated link: ping, and the peer endpoint above); restarting either server does not mend it.", owner.URL)}
}

// prefillOf is the reachable prefill server, and its rank, that
// advertises endpoint in s; nil when none does.
func prefillOf(s Sample, endpoint string) (*ServerSample, *debug.PDRank) {
	for i := range s.Servers {
		x := &s.Servers[i]
		if !x.Reachable || x.PD == nil || x.PD.Role != "prefill" {
			continue
		}
		for j := range x.PD.Ranks {
			r := &x.PD.Ranks[j]
			own := r.Socket.Advertised
			if own == "" {
				own = r.Socket.Endpoint
			}
			if sameEndpoint(own, endpoint) {
				return x, r
			}
		}
	}
	return nil, nil
}

// received is how many bytes decode rank rank of the server at url
// received over w; 0 without two samples of it.
func received(w Window, url string, rank int) uint64 {
	a, b := pdRank(pdOf(w.First().Server(url)), rank), pdRank(pdOf(w.Last().Server(url)), rank)
	if len(w.Samples) < 2 || a == nil || b == nil {
		return 0
	}
	return b.Socket.Bytes - min(b.Socket.Bytes, a.Socket.Bytes)
}
