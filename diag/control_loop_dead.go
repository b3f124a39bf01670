package diag

import (
	"fmt"

	"github.com/pdkit/pdkit/api/debug"
)

// faultBootstrapAbortCrash is the fault switch that kills a prefill
// bootstrap loop on ABORT (incident 1 of ARCHITECTURE.md).
const faultBootstrapAbortCrash = "bootstrap-abort-crash"

func controlLoopDead() Rule {
	return Rule{
		Name:     "control-loop-dead",
		Doc:      "A PD rank's socket receive loop has exited, so the rank no longer hears its peers (prefill: transfer info and ABORTs; decode: KV chunks) and every room on it waits forever.",
		Severity: Critical,
		Basis:    LastSample,
		Check:    checkControlLoopDead,
	}
}

func checkControlLoopDead(w Window) []Finding {
	var out []Finding
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.PD == nil {
			continue
		}
		for _, r := range s.PD.Ranks {
			if r.Socket.Alive {
				continue
			}
			loop := "control"
			if s.PD.Role == "decode" {
				loop = "KV"
			}
			reason := r.Socket.ExitReason
			if reason == "" {
				reason = "(none given)"
			}
			last := "never"
			if r.Socket.LastMessage != nil {
				last = r.Socket.LastMessage.UTC().Format("2006-01-02T15:04:05.000Z07:00")
			}
			evidence := []Evidence{
				ev("role", "%s", s.PD.Role),
				ev("endpoint", "%s", r.Socket.Endpoint),
				ev("alive", "false"),
				ev("exit_reason", "%s", reason),
				ev("last_message", "%s", last),
				ev("messages", "%d", r.Socket.Messages),
				ev("handler_errors", "%d", r.Socket.HandlerErrors),
				ev("handler_panics", "%d", r.Socket.HandlerPanics),
				ev("recv_errors", "%d", r.Socket.RecvErrors),
				ev("queues", "%s", counts(r.Counts, debug.PDQueues)),
			}
			if r.Socket.LastError != "" {
				evidence = append(evidence, ev("last_error", "%s", r.Socket.LastError))
			}
			if waiting := peerRooms(w.Last(), r.Socket.Endpoint); len(waiting) > 0 {
				evidence = append(evidence, ev("peer_rooms", "%s", listSep(waiting, 10, "; ")))
			}
			remedy := fmt.Sprintf("restart the %s server %s; its rooms cannot progress until then. ", s.PD.Role, s.URL)
			if f := faultNamed(reason); f != "" {
				remedy += fmt.Sprintf("The exit reason names the fault %s: switch it off (pdctl fault off %s --server %s) before the restart.", f, f, s.URL)
			} else {
				remedy += fmt.Sprintf("Check the fault switches (pdctl fault list --server %s), notably %s, which kills the prefill bootstrap loop on ABORT.", s.URL, faultBootstrapAbortCrash)
			}
			out = append(out, Finding{
				Rule: "control-loop-dead", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
				Summary:  fmt.Sprintf("the %s %s loop of rank %d is dead: %s", s.PD.Role, loop, r.Rank, reason),
				Evidence: evidence,
				Remedy:   remedy,
			})
		}
	}
	return out
}

// peerRooms lists the rooms that other servers' ranks hold with endpoint
// as their peer (a decode waiting for KV from a dead prefill loop, or for
// the ack of its ABORT), grouped as "queue on server rank N: rooms", the
// decode's ABORT named when it sent one.
func peerRooms(s Sample, endpoint string) []string {
	if endpoint == "" {
		return nil
	}
	var groups []string
	rooms := map[string][]debug.ID{}
	for _, o := range s.Servers {
		if !o.Reachable || o.PD == nil {
			continue
		}
		for _, r := range o.PD.Ranks {
			for _, e := range r.Entries {
				if e.Peer != endpoint {
					continue
				}
				g := fmt.Sprintf("%s on %s rank %d", e.Queue, o.URL, r.Rank)
				switch {
				case e.Acked:
					g += " (ABORT acked)"
				case e.AbortSent:
					g += " (ABORT not acked)"
				}
				if rooms[g] == nil {
					groups = append(groups, g)
				}
				rooms[g] = append(rooms[g], e.Room)
			}
		}
	}
	out := make([]string, len(groups))
	for i, g := range groups {
		out[i] = g + ": " + list(rooms[g], 10)
	}
	return out
}
