package diag

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// criticalShare is the share of the requests the router finished over the
// window, failed, from which requests-failing is critical.
const criticalShare = 0.10

func requestsFailing() Rule {
	return Rule{
		Name: "requests-failing",
		Doc: "Requests failed over the window: the router ended them with an error of the cluster's (an upstream error, no server), or a PD server " +
			"failed them (a timeout, a lost or failing peer, ...), so clients see errors even while every queue drains and every loop turns.",
		Severity: Critical,
		Check:    checkRequestsFailing,
	}
}

// FailedOutcome reports whether a router outcome (the outcome label of
// pdkit_router_requests_total) is a request the cluster failed: every
// outcome but ok, invalid (the router refused the body), aborted (POST
// /abort_request) and those of the client (an outcome beginning with
// "client_": client_error, a server's 4xx; client_gone). upstream_error,
// no_server, overloaded (429 at the admission bound), starting and
// shutdown are failures: the client got an error instead of its answer.
// An outcome the router adds later counts as a failure until it is named
// here, so that a cluster failing requests is never called healthy.
func FailedOutcome(outcome string) bool {
	switch outcome {
	case "ok", "invalid", "aborted":
		return false
	}
	return !strings.HasPrefix(outcome, "client_")
}

// RouterFailures is the number of requests the router counted as failed in
// outcomes (FailedOutcome).
func RouterFailures(outcomes map[string]uint64) uint64 {
	var n uint64
	for o, v := range outcomes {
		if FailedOutcome(o) {
			n += v
		}
	}
	return n
}

// ServerFailures is the number of PD requests a server failed, as
// requests-failing counts them: every failure but those of kind
// peer-aborted, a prefill's rooms that the decode aborted (because its
// client left, or because the decode failed them, which the decode counts
// itself).
func ServerFailures(p *debug.PDResponse) uint64 {
	if p == nil {
		return 0
	}
	return p.FailedRequests - min(p.FailedRequests, p.FailuresByReason[debug.PDFailPeerAborted])
}

func checkRequestsFailing(w Window) []Finding {
	if len(w.Samples) < 2 {
		return nil // a counter needs two samples to show a change
	}
	first, last := w.First(), w.Last()
	window := fmt.Sprintf("%v, %d samples", w.Span().Round(100*time.Millisecond), len(w.Samples))
	var out []Finding

	// The router: how the requests it finished over the window ended.
	severity := Critical
	if rf, rl := first.Router, last.Router; rf != nil && rl != nil && rf.Reachable && rl.Reachable {
		d := growth(rf.Outcomes, rl.Outcomes)
		var failed, total uint64
		for o, n := range d {
			total += n
			if FailedOutcome(o) {
				failed += n
			}
		}
		share := 0.0
		if total > 0 {
			share = float64(failed) / float64(total)
		}
		if total > 0 && share < criticalShare {
			severity = Warning
		}
		// Shedding load at the edge (429 past the admission bound, 503
		// while the router starts) is the cluster protecting the
		// requests it admitted, not failing them: the clients were told
		// at once to retry. Busy is not broken: named as a note (info)
		// when it is all.
		edge := d["overloaded"] + d["starting"]
		shedding := failed > 0 && failed == edge
		if shedding {
			severity = Info
		}
		if failed > 0 {
			evidence := []Evidence{
				ev("window", "%s", window),
				ev("failed", "%d of %d (%s)", failed, total, percent(share)),
				ev("outcomes", "%s", countList(d, nil)),
			}
			if up := growth(rf.UpstreamErrors, rl.UpstreamErrors); len(up) > 0 {
				evidence = append(evidence, ev("upstream errors", "%s", countList(up, nil)))
			}
			summary := fmt.Sprintf("%d of %d requests the router finished over %v failed (%s)", failed, total, w.Span().Round(100*time.Millisecond), percent(share))
			if shedding {
				summary = fmt.Sprintf("the router shed %d of %d requests at the edge over %v (%s): answered at once to retry later, nothing failed inside the cluster",
					failed, total, w.Span().Round(100*time.Millisecond), percent(share))
			}
			out = append(out, Finding{
				Rule: "requests-failing", Severity: severity, Server: rl.URL, Rank: nil,
				Summary:  summary,
				Evidence: evidence,
				Remedy:   routerRemedy(d),
			})
		}
	}

	// The router's readiness: its recent requests, older than the window
	// (a cluster that fails every request is named even when the window
	// holds none).
	if rl := last.Router; len(out) == 0 && rl != nil && rl.Reachable && rl.Ready != nil && rl.Ready.RecentFailed > 0 {
		rd := rl.Ready
		share := float64(rd.RecentFailed) / float64(max(1, rd.RecentRequests))
		sev := Warning
		if rd.Status != "ok" || share >= criticalShare {
			sev = Critical
		}
		out = append(out, Finding{
			Rule: "requests-failing", Severity: sev, Server: rl.URL, Rank: nil,
			Summary: fmt.Sprintf("%d of the router's %d recent requests failed upstream (%s), before this window: none failed in it",
				rd.RecentFailed, rd.RecentRequests, percent(share)),
			Evidence: []Evidence{
				ev("window", "%s", window),
				ev("readiness", "%s%s", rd.Status, map[bool]string{true: ": " + rd.Reason, false: ""}[rd.Reason != ""]),
			},
			Seen: "the router's readiness window (--ready-window) before the last sample, " + clock(last.Taken),
			Remedy: "the servers' requests-failing and config-mismatch findings, when any, say why; send a request through the router " +
				"(or pdctl diagnose --canaries 1) to see whether it still fails, and read pdctl status for each server's health.",
		})
	}

	// The PD servers: the failures each counted over the window.
	for _, s := range last.Servers {
		if !s.Reachable || s.PD == nil {
			continue
		}
		var from *debug.PDResponse
		for _, smp := range w.Samples[:len(w.Samples)-1] {
			if fs := smp.Server(s.URL); fs != nil && fs.Reachable && fs.PD != nil {
				from = fs.PD
				break
			}
		}
		if from == nil {
			continue
		}
		total := grown(from.FailedRequests, s.PD.FailedRequests)
		byReason := growth(from.FailuresByReason, s.PD.FailuresByReason)
		byQueue := growth(from.FailuresByQueue, s.PD.FailuresByQueue)
		peerAborted := byReason[debug.PDFailPeerAborted]
		counted := total - min(total, peerAborted)
		if counted == 0 {
			continue
		}
		delete(byReason, debug.PDFailPeerAborted)
		reasons := countList(byReason, debug.PDFailureKinds)
		if len(byReason) == 0 {
			reasons = "not published by the server"
		}
		evidence := []Evidence{
			ev("window", "%s", window),
			ev("failed", "%d over the window, %d since the server started", counted, ServerFailures(s.PD)),
			ev("by reason", "%s", reasons),
		}
		if len(byQueue) > 0 {
			key := "by queue"
			if peerAborted > 0 {
				key = "by queue (peer-aborted included)"
			}
			evidence = append(evidence, ev(key, "%s", countList(byQueue, debug.PDQueues)))
		}
		if peerAborted > 0 {
			evidence = append(evidence, ev("not counted", "peer-aborted=%d (the decode aborted them: its client left, or it failed them and counts them itself)", peerAborted))
		}
		out = append(out, Finding{
			Rule: "requests-failing", Severity: severity, Server: s.URL, Rank: nil,
			Summary:  fmt.Sprintf("the %s server failed %s over %v: %s", s.PD.Role, nRequests(counted), w.Span().Round(100*time.Millisecond), reasons),
			Evidence: evidence,
			Remedy:   failureRemedy(byReason),
		})
	}
	return out
}

// routerRemedy says what to do about the router's failed outcomes in d,
// most frequent first.
func routerRemedy(d map[string]uint64) string {
	var parts []string
	for _, o := range byCount(d, nil) {
		if !FailedOutcome(o) {
			continue
		}
		var p string
		switch o {
		case "upstream_error":
			p = "upstream_error: a server failed or cut the requests (the upstream errors above name the servers; " +
				"the servers' requests-failing findings give the reasons by kind and queue)"
		case "no_server":
			p = "no_server: no healthy prefill or decode server (pdctl status shows each server's health and why)"
		case "overloaded":
			p = "overloaded: every server of a role was at the router's admission bound (--max-queued) and the requests were answered 429; " +
				"add servers or lower the load"
		case "starting":
			p = "starting: requests came before the router's first round of health checks ended"
		case "shutdown":
			p = "shutdown: the router's shutdown deadline (--shutdown-timeout) cut the requests"
		default:
			p = o + ": see the router's log"
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, "; ") + "."
}

// failureRemedy says what to do about failures of the kinds in byReason,
// most frequent first.
func failureRemedy(byReason map[string]uint64) string {
	if len(byReason) == 0 {
		return "the server's log names each failed request's reason; GET /debug/v1/pd counts them by reason on a server that publishes it."
	}
	var parts []string
	for _, k := range byCount(byReason, debug.PDFailureKinds) {
		var p string
		switch k {
		case debug.PDFailTimeout:
			p = "timeout: requests waited past their queue's timeout (bootstrap and prealloc: --bootstrap-timeout; active and transfer: " +
				"--transfer-timeout; inflight: --inflight-timeout; GET /debug/v1/settings shows the values in force): a decode short of KV pages " +
				"holds new rooms in its prealloc queue, so add decode servers or lower the load; a silent peer is named by peer-unreachable"
		case debug.PDFailPeerLost, debug.PDFailPeerRestarted:
			p = k + ": a prefill server stopped answering heartbeats or restarted; see peer-unreachable and control-loop-dead, and pdctl status"
		case debug.PDFailPeerFailed:
			p = "peer-failed: the peer server failed the requests; its own requests-failing finding says why"
		case debug.PDFailSend:
			p = "send: handing messages to a peer failed; check that the peers' endpoints (pdctl queues dump, PEER) are reachable from this server"
		case debug.PDFailRefused:
			p = "refused: the peer's registry or transfer info does not fit this server; run prefill and decode with the same model, TP size, " +
				"page size and index-K precision (pdctl status)"
		case debug.PDFailBadChunk:
			p = "bad-chunk: KV chunks arrived out of order or range; run the same pdserve build on both sides"
		case debug.PDFailScheduler:
			p = "scheduler: the prefill's scheduler ended the requests (its --waiting-timeout or --prefill-timeout, or an engine error in its log)"
		case debug.PDFailOtherRank:
			p = "other-rank: another rank of the server decided the failure; the findings about its ranks say why"
		default:
			p = k + ": see the server's log"
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, "; ") + "."
}

// growth is how much each counter of to grew since from, zeros left out;
// a counter lower than before (the process restarted) grew by its value.
func growth(from, to map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range to {
		if d := grown(from[k], v); d > 0 {
			out[k] = d
		}
	}
	return out
}

// grown is how much a counter grew from a to b; b itself when it went
// down (its process restarted).
func grown(a, b uint64) uint64 {
	if b < a {
		return b
	}
	return b - a
}

// byCount orders the keys of m by count, largest first; ties in the order
// of names, then by name.
func byCount(m map[string]uint64, names []string) []string {
	keys := slices.Collect(maps.Keys(m))
	pos := func(k string) int {
		if i := slices.Index(names, k); i >= 0 {
			return i
		}
		return len(names)
	}
	slices.SortFunc(keys, func(a, b string) int {
		return cmp.Or(cmp.Compare(m[b], m[a]), cmp.Compare(pos(a), pos(b)), cmp.Compare(a, b))
	})
	return keys
}

// countList writes m as "k=v" pairs, largest first; "none" when empty.
func countList(m map[string]uint64, names []string) string {
	if len(m) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range byCount(m, names) {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

// percent writes a share as a percentage: whole above 10%, one decimal
// below.
func percent(share float64) string {
	if share >= 0.1 {
		return fmt.Sprintf("%.0f%%", 100*share)
	}
	return fmt.Sprintf("%.1f%%", 100*share)
}

// nRequests is "1 request" or "n requests".
func nRequests(n uint64) string {
	if n == 1 {
		return "1 request"
	}
	return fmt.Sprintf("%d requests", n)
}
