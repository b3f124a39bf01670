package server

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/serve"
)

// HealthResponse is the body of GET /health. Status is "ok", "busy" (200:
// a request has waited longer than Options.MaxQueueAge; the server works,
// routers should send it no new work) or "unhealthy" (503: the engine
// failed, its loop stalled or a communicator of its TP group broke).
// Queued is the work the server holds and has not started: the scheduler's
// waiting and pending requests and, on a PD server, the PD queue where
// requests wait their turn (bootstrap on a prefill: waiting for the
// decode's transfer info; prealloc on a decode: waiting for KV pages).
// PDQueues has every PD queue's length (rank 0's).
//
// An unhealthy answer says why: Reason in words, and Ranks, Stalls and
// Broken as data. A loop that stalls is one whose ranks do not meet: the
// reason names the collective (communicator, seq, op) ranks wait in and
// each peer that is elsewhere (in another call, or in none), so that a
// hung group (every rank alive, only waiting) is not green.
type HealthResponse struct {
	Status          string           `json:"status"`
	Reason          string           `json:"reason,omitempty"`
	Step            uint64           `json:"step"`
	LoopAgeMS       float64          `json:"loop_age_ms"`
	Waiting         int              `json:"waiting"`
	Running         int              `json:"running"`
	Pending         int              `json:"pending"`
	Queued          int              `json:"queued"`
	PDQueues        map[string]int64 `json:"pd_queues,omitempty"`
	OldestWaitingMS float64          `json:"oldest_waiting_ms"`
	// Ranks say where each TP rank is; only in an unhealthy answer.
	Ranks []HealthRank `json:"ranks,omitempty"`
	// Stalls are the collectives ranks wait in while a peer has not
	// arrived, each with the ranks that wait and where the others are (as
	// GET /debug/v1/collectives lists them, at any wait); only when the
	// loop has stalled.
	Stalls []debug.Stall `json:"stalls,omitempty"`
	// Broken names each communicator of the TP group that broke (a
	// collective mismatch, a rank that left a call) and why; the server is
	// unhealthy while one is.
	Broken []HealthBroken `json:"broken,omitempty"`
}

// HealthRank is one TP rank in an unhealthy /health answer: its last
// finished step and the collectives it waits in.
type HealthRank struct {
	Rank  int    `json:"rank"`
	Step  uint64 `json:"step"`
	Phase string `json:"phase"` // idle, prefill, decode or mixed
	// Waiting are the calls the rank waits in, at most one per
	// communicator; empty when it is in no collective.
	Waiting []HealthWait `json:"waiting"`
}

// HealthWait is a collective call a rank waits in.
type HealthWait struct {
	Comm     string  `json:"comm"` // debug.CommControl or debug.CommForward: the seq's communicator
	Seq      uint64  `json:"seq"`
	Op       string  `json:"op"`
	WaitedMS float64 `json:"waited_ms"`
}

// HealthBroken is a communicator that broke, and why.
type HealthBroken struct {
	Comm   string `json:"comm"`
	Reason string `json:"reason"`
}

// Health statuses of GET /health.
const (
	HealthOK        = "ok"
	HealthBusy      = "busy"
	HealthUnhealthy = "unhealthy"
)

// pdWaitQueue is the PD queue of each role in which requests wait for
// their turn rather than move.
var pdWaitQueue = map[string]string{pdproto.RolePrefill: "bootstrap", pdproto.RoleDecode: "prealloc"}

func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	resp, status := s.judge(time.Now())
	writeJSON(w, status, resp)
}

// judge is the /health verdict at now: the answer and its status.
func (s *Server) judge(now time.Time) (HealthResponse, int) {
	h := s.eng.View().Health(now)
	resp := HealthResponse{Status: HealthOK, Step: h.Step, LoopAgeMS: ms(h.LoopAge), Waiting: h.Waiting,
		Running: h.Running, Pending: h.Pending, Queued: h.Waiting + h.Pending, OldestWaitingMS: ms(h.OldestWaiting)}
	if pq := s.eng.PD().Queues(); pq != nil {
		resp.PDQueues = pq
		resp.Queued += int(pq[pdWaitQueue[s.eng.Config().Role]])
	}
	groups := s.eng.View().Collectives()
	var stalls []dist.Stall
	if h.LoopAge > s.opts.StallAfter {
		stalls = s.eng.View().Stalls(now, 0)
	}
	status := http.StatusOK
	if judgeHealth(&resp, h, s.opts.StallAfter, groups, stalls, s.eng.View().RankSteps(), now) {
		status = http.StatusServiceUnavailable
	} else if s.opts.MaxQueueAge > 0 && h.OldestWaiting > s.opts.MaxQueueAge {
		// Busy is not dead: the loop iterates, requests wait their turn.
		resp.Status, resp.Reason = HealthBusy, fmt.Sprintf("a request has waited %v for admission (limit %v)", h.OldestWaiting.Round(time.Millisecond), s.opts.MaxQueueAge)
	}
	return resp, status
}

// judgeHealth fills in resp's status, reason, ranks, stalls and broken
// communicators when the engine is unhealthy, and reports whether it is:
// the engine failed (h.Err), a communicator broke, or the loop has not
// iterated for longer than stallAfter. groups are the communicators'
// snapshots (View.Collectives), stalls the calls waiting at now
// (View.Stalls, read when the loop has stalled), steps every rank's last
// step record.
func judgeHealth(resp *HealthResponse, h serve.Health, stallAfter time.Duration, groups []dist.Snapshot, stalls []dist.Stall, steps []serve.StepRecord, now time.Time) bool {
	var reasons []string
	if h.Err != "" {
		reasons = append(reasons, "engine failed: "+h.Err)
	}
	for _, g := range groups {
		if g.Broken != "" {
			resp.Broken = append(resp.Broken, HealthBroken{Comm: g.Name, Reason: g.Broken})
			reasons = append(reasons, fmt.Sprintf("the %s communicator is broken: %s", g.Name, g.Broken))
		}
	}
	if h.LoopAge > stallAfter {
		reasons = append(reasons, fmt.Sprintf("engine loop has not iterated for %v (limit %v): %s",
			h.LoopAge.Round(time.Millisecond), stallAfter, stallText(stalls, groups, now)))
		for _, st := range stalls {
			resp.Stalls = append(resp.Stalls, debugStall(st))
		}
	}
	if len(reasons) == 0 {
		return false
	}
	resp.Status, resp.Reason = HealthUnhealthy, strings.Join(reasons, "; ")
	for _, st := range steps {
		hr := HealthRank{Rank: st.Rank, Step: st.Step, Phase: st.Phase, Waiting: []HealthWait{}}
		for _, g := range groups {
			if w := waitingIn(g, st.Rank); w != nil {
				hr.Waiting = append(hr.Waiting, HealthWait{Comm: g.Name, Seq: w.Seq, Op: w.Op.String(), WaitedMS: ms(now.Sub(w.Start))})
			}
		}
		resp.Ranks = append(resp.Ranks, hr)
	}
	return true
}

// stallText says where the ranks of a stalled loop are: for each call
// ranks wait in, who waits and where each peer that has not arrived is
// ("rank 0 waits in control seq 41 Broadcast for 5.2s; rank 1 is not in a
// collective (last control seq 40 AllReduceMax)"), or that no rank waits
// in one.
func stallText(stalls []dist.Stall, groups []dist.Snapshot, now time.Time) string {
	if len(stalls) == 0 {
		return "no rank waits in a collective"
	}
	var parts []string
	for _, st := range stalls {
		who := "rank"
		if len(st.Arrived) > 1 {
			who = "ranks"
		}
		verb := "waits"
		if len(st.Arrived) > 1 {
			verb = "wait"
		}
		arrived := make([]string, len(st.Arrived))
		for i, r := range st.Arrived {
			arrived[i] = fmt.Sprint(r)
		}
		p := fmt.Sprintf("%s %s %s in %s seq %d %v for %v", who, strings.Join(arrived, ", "), verb, st.Comm, st.Seq, st.Op, now.Sub(st.Since).Round(time.Millisecond))
		for _, m := range st.Missing {
			p += "; " + peerText(st.Comm, m, groups)
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, "; ")
}

// peerText says where peer m, which has not arrived at a call of the
// communicator comm, is: in another call of comm, in a call of another
// communicator, or in none.
func peerText(comm string, m dist.Peer, groups []dist.Snapshot) string {
	if m.InCollective {
		return fmt.Sprintf("rank %d waits in %s seq %d %v instead", m.Rank, comm, m.Seq, m.Op)
	}
	for _, g := range groups {
		if g.Name == comm {
			continue
		}
		if w := waitingIn(g, m.Rank); w != nil {
			return fmt.Sprintf("rank %d waits in %s seq %d %v instead", m.Rank, g.Name, w.Seq, w.Op)
		}
	}
	if m.Seq == 0 {
		return fmt.Sprintf("rank %d is not in a collective (none entered on %s yet)", m.Rank, comm)
	}
	return fmt.Sprintf("rank %d is not in a collective (last %s seq %d %v)", m.Rank, comm, m.Seq, m.Op)
}

// waitingIn is the call rank waits in on communicator g, or nil.
func waitingIn(g dist.Snapshot, rank int) *dist.Record {
	i := slices.IndexFunc(g.Ranks, func(r dist.RankState) bool { return r.Rank == rank })
	if i < 0 {
		return nil
	}
	return g.Ranks[i].Waiting
}

// debugStall is a stall as the debug API writes it.
func debugStall(st dist.Stall) debug.Stall {
	ds := debug.Stall{Comm: st.Comm, Seq: st.Seq, Op: st.Op.String(), Since: st.Since, WaitedMS: ms(st.Waited),
		Arrived: append([]int{}, st.Arrived...), Missing: make([]debug.Peer, len(st.Missing))}
	for j, p := range st.Missing {
		ds.Missing[j] = debug.Peer{Rank: p.Rank, InCollective: p.InCollective, Seq: p.Seq, Op: p.Op.String()}
	}
	return ds
}
