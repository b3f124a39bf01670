package server

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/pd/mailbox"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/procstat"
)

// The debug handlers read only the engine's lock-free accessors (atomics
// the loops publish, the pools' counters, the group's flight recorders), so
// they answer while a loop is stuck. They never call into the loop or take
// the engine's inbox lock.

func (s *Server) steps(w http.ResponseWriter, _ *http.Request) {
	recs := s.eng.View().RankSteps()
	resp := debug.StepsResponse{Agree: true, Ranks: make([]debug.Step, len(recs))}
	lo, hi := ^uint64(0), uint64(0)
	for i, r := range recs {
		resp.Ranks[i] = debugStep(r)
		lo, hi = min(lo, r.Step), max(hi, r.Step)
		if r.Step != recs[0].Step || r.Digest != recs[0].Digest || r.ControlSeq != recs[0].ControlSeq || r.ForwardSeq != recs[0].ForwardSeq {
			resp.Agree = false
		}
	}
	if len(recs) > 0 {
		resp.Spread = hi - lo
	}
	for _, r := range s.eng.View().StepRates() {
		resp.Rates = append(resp.Rates, debug.StepRate{Phase: r.Phase, Tokens: r.Tokens, Steps: r.Steps,
			RecentMS: ms(r.Recent), BaselineMS: ms(r.Baseline), Cycles: r.Cycles, CycleRecentMS: ms(r.CycleRecent), CycleBaselineMS: ms(r.CycleBaseline)})
	}
	if c, err := procstat.CPUOf(); err == nil {
		resp.Process = &debug.ProcessCPU{Taken: time.Now(), CPUMS: ms(c.Used), Periods: c.Periods, Throttled: c.Throttled,
			ThrottledMS: ms(c.ThrottledTime), Cgroup: c.Cgroup}
	}
	writeJSON(w, http.StatusOK, resp)
}

func debugStep(r serve.StepRecord) debug.Step {
	return debug.Step{
		Rank: r.Rank, Loop: r.Loop, Step: r.Step, Phase: r.Phase, BatchSize: r.BatchSize, BatchTokens: r.BatchTokens,
		Retracted: r.Retracted, Finished: r.Finished, Digest: fmt.Sprintf("%016x", r.Digest),
		ControlSeq: r.ControlSeq, ForwardSeq: r.ForwardSeq, Start: r.Start, End: r.End, DurationMS: ms(r.End.Sub(r.Start)),
	}
}

func (s *Server) collectives(w http.ResponseWriter, r *http.Request) {
	threshold := s.opts.StallAfter
	if v := r.URL.Query().Get("stall"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			openai.InvalidRequest("stall", fmt.Sprintf("stall %q is not a duration (like 500ms or 2s)", v)).WriteJSON(w)
			return
		}
		threshold = d
	}
	now := time.Now()
	resp := debug.CollectivesResponse{StallThresholdMS: ms(threshold), Comms: []debug.Communicator{}, Restarts: s.eng.View().Restarts()}
	for _, g := range s.eng.View().Collectives() {
		resp.Comms = append(resp.Comms, s.debugComm(g, now))
	}
	for _, st := range s.eng.View().Stalls(now, threshold) {
		if c := resp.Comm(st.Comm); c != nil {
			c.Stalls = append(c.Stalls, debugStall(st))
		}
	}
	if f := s.eng.View().LastFailure(); f != nil {
		lf := &debug.GroupFailure{At: f.At, Reason: f.Reason, Boot: strconv.FormatUint(f.Boot, 10), Comms: []debug.Communicator{}}
		for _, g := range f.Collectives {
			lf.Comms = append(lf.Comms, s.debugComm(g, f.At))
		}
		resp.LastFailure = lf
	}
	writeJSON(w, http.StatusOK, resp)
}

// debugComm is one communicator's state, its stalls left empty.
func (s *Server) debugComm(g dist.Snapshot, now time.Time) debug.Communicator {
	c := debug.Communicator{Name: g.Name, Size: g.Size, Closed: g.Closed, Broken: g.Broken != "", BrokenReason: g.Broken,
		Stalls: []debug.Stall{}, Ranks: make([]debug.CollectiveRank, len(g.Ranks))}
	for i, rs := range g.Ranks {
		cr := debug.CollectiveRank{
			Rank: rs.Rank, LastEntered: rs.LastEntered, LastCompleted: rs.LastCompleted,
			WaitMS: ms(s.eng.View().CollectiveWait(g.Name, rs.Rank)), Records: make([]debug.Collective, len(rs.Records)),
		}
		if rs.Waiting != nil {
			wc := debugCollective(*rs.Waiting, now)
			cr.Waiting = &wc
		}
		for j, rec := range rs.Records {
			cr.Records[j] = debugCollective(rec, now)
		}
		c.Ranks[i] = cr
	}
	return c
}

func debugCollective(r dist.Record, now time.Time) debug.Collective {
	c := debug.Collective{Seq: r.Seq, Op: r.Op.String(), Phase: r.Tag, Elem: r.Elem.String(), Bytes: r.Bytes, Start: r.Start,
		Waiting: r.Waiting(), Outcome: r.Outcome}
	if r.Waiting() {
		c.DurationMS = ms(now.Sub(r.Start))
	} else {
		end := r.End
		c.End = &end
		c.DurationMS = ms(end.Sub(r.Start))
	}
	return c
}

func (s *Server) requests(w http.ResponseWriter, r *http.Request) {
	filter := r.URL.Query().Get("queue")
	if filter != "" && !slices.Contains(debug.Queues, filter) {
		openai.InvalidRequest("queue", fmt.Sprintf("unknown queue %q: want waiting, prefilling, running or aborting", filter)).WriteJSON(w)
		return
	}
	now := time.Now()
	snap := s.eng.View().Snapshot()
	q := snap.Queue
	since := now.Sub(snap.Taken)
	resp := debug.RequestsResponse{
		Taken: snap.Taken, Step: snap.Step.Step, Queue: filter,
		Counts: map[string]int{
			debug.QueueWaiting: len(q.Waiting), debug.QueuePrefilling: len(q.Prefilling),
			debug.QueueRunning: len(q.Running), debug.QueueAborting: len(q.Aborting),
		},
		Pending: s.eng.View().Health(now).Pending, StepInFlight: q.StepInFlight, HeldPages: q.HeldPages, TotalPages: q.TotalPages,
		ForwardSteps: snap.Totals.Steps, Finished: snap.Totals.Finished,
		Requests: []debug.RequestInfo{}, KV: make([]debug.KVPages, s.eng.View().Ranks()),
	}
	for _, name := range debug.Queues {
		if filter != "" && filter != name {
			continue
		}
		for _, ri := range queueOf(q, name) {
			resp.Requests = append(resp.Requests, debug.RequestInfo{
				ID: debug.ID(ri.ID), ClientRequestID: s.tagOf(ri.ID), Queue: name, AgeMS: ms(ri.Age + since), InStateMS: ms(ri.InState + since),
				PromptTokens: ri.PromptLen, MaxTokens: ri.MaxTokens, Generated: ri.Generated, Fed: ri.Fed,
				InFlight: ri.InFlight, Cached: ri.Cached, Pages: ri.Pages, Retractions: ri.Retractions,
			})
		}
	}
	for rank := range resp.KV {
		used, cached, total := s.eng.View().KVPages(rank)
		resp.KV[rank] = debug.KVPages{Rank: rank, Used: used, Cached: cached, Total: total}
	}
	writeJSON(w, http.StatusOK, resp)
}

// queueOf is the snapshot's queue called name.
func queueOf(q sched.Snapshot, name string) []sched.ReqInfo {
	switch name {
	case debug.QueueWaiting:
		return q.Waiting
	case debug.QueuePrefilling:
		return q.Prefilling
	case debug.QueueRunning:
		return q.Running
	case debug.QueueAborting:
		return q.Aborting
	}
	return nil
}

// parseID reads a request id: N, cmpl-N or chatcmpl-N.
func parseID(s string) (uint64, bool) {
	for _, p := range []string{"chatcmpl-", "cmpl-"} {
		if len(s) > len(p) && s[:len(p)] == p {
			s = s[len(p):]
			break
		}
	}
	if i := strings.LastIndexByte(s, '-'); i >= 0 {
		s = s[i+1:] // the server's instance tag before it (see idOf)
	}
	id, err := strconv.ParseUint(s, 10, 64)
	return id, err == nil
}

// idOf is the response id of engine request id under prefix ("cmpl-",
// "chatcmpl-"): the server's instance tag (random at start) and the id,
// so that the ids of the servers behind one router never collide.
func (s *Server) idOf(prefix string, id uint64) string {
	return prefix + s.instance + "-" + strconv.FormatUint(id, 10)
}

// ownID reports whether a response id names this server's instance (an
// id with another tag is another server's); a bare N or cmpl-N is taken.
func (s *Server) ownID(raw string) bool {
	for _, p := range []string{"chatcmpl-", "cmpl-"} {
		if strings.HasPrefix(raw, p) {
			rest := raw[len(p):]
			i := strings.LastIndexByte(rest, '-')
			return i < 0 || rest[:i] == s.instance
		}
	}
	return !strings.Contains(raw, "-")
}

// pd serves GET /debug/v1/pd: every rank's PD socket and queues, read from
// the engine's lock-free PD accessors (the queues each rank published
// after its last iteration, the sockets' atomic counters).
func (s *Server) pd(w http.ResponseWriter, r *http.Request) {
	role := s.eng.Config().Role
	if role != pdproto.RolePrefill && role != pdproto.RoleDecode {
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest,
			Message: fmt.Sprintf("not a PD server: this server's role is %s", role)}).WriteJSON(w)
		return
	}
	filter := r.URL.Query().Get("queue")
	if filter != "" && !slices.Contains(debug.PDQueues, filter) {
		openai.InvalidRequest("queue", fmt.Sprintf("unknown queue %q: want one of %s", filter, strings.Join(debug.PDQueues, ", "))).WriteJSON(w)
		return
	}
	links := s.eng.PD().Links()
	entries := s.eng.PD().QueueEntries()
	resp := debug.PDResponse{Role: role, Queue: filter, FailedRequests: s.eng.PD().Failures(),
		FailuresByReason: nonNil(s.eng.PD().FailuresByReason()), FailuresByQueue: nonNil(s.eng.PD().FailuresByQueue()),
		TransferBytes: s.eng.PD().TransferBytes(), Ranks: make([]debug.PDRank, max(len(links), len(entries)))}
	for i := range resp.Ranks {
		resp.Ranks[i] = debug.PDRank{Rank: i, Counts: map[string]int{}, Entries: []debug.PDEntry{}}
	}
	for _, l := range links {
		if l.Rank >= 0 && l.Rank < len(resp.Ranks) {
			rr := &resp.Ranks[l.Rank]
			rr.Socket, rr.Boot, rr.Peers, rr.PendingKVBytes = debugPDSocket(l), strconv.FormatUint(l.Boot, 10), debugPDPeers(l.Peers), l.PendingKV
		}
	}
	for rank, es := range entries {
		rr := &resp.Ranks[rank]
		for _, e := range es {
			rr.Counts[e.Queue]++
			if filter != "" && e.Queue != filter {
				continue
			}
			en := debug.PDEntry{ID: debug.ID(e.ID), ClientRequestID: s.tagOf(e.ID), Room: debug.ID(e.Room), Queue: e.Queue, InQueueMS: ms(e.InQueue), Peer: e.Peer,
				Tokens: e.Tokens, Chunks: e.Chunks, Bytes: e.Bytes, AbortSent: e.AbortSent, Acked: e.Acked,
				Poll: e.Poll.String(), Agreed: e.Agreed.String(), Error: e.Error, Leased: e.Leased, Position: e.Position}
			if e.HasDeadline {
				d := ms(e.DeadlineIn)
				en.DeadlineInMS = &d
			}
			rr.Entries = append(rr.Entries, en)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

// nonNil is m, or an empty map for nil, so that the JSON has {} rather
// than null.
func nonNil(m map[string]uint64) map[string]uint64 {
	if m == nil {
		return map[string]uint64{}
	}
	return m
}

// debugPDPeers is a decode rank's peer table in the debug API's shape.
func debugPDPeers(ps []mailbox.PeerState) []debug.PDPeer {
	if ps == nil {
		return nil
	}
	at := func(t time.Time) *time.Time {
		if t.IsZero() {
			return nil
		}
		return &t
	}
	out := make([]debug.PDPeer, len(ps))
	for i, p := range ps {
		out[i] = debug.PDPeer{Endpoint: p.Endpoint, LastWord: at(p.Heard), LastProbe: at(p.Probed), SilentMS: ms(p.Silent),
			LostRooms: p.Lost, LastLost: at(p.LostAt)}
		if p.Boot != 0 {
			out[i].Boot = strconv.FormatUint(p.Boot, 10)
		}
		if p.LostBoot != 0 {
			out[i].BootAtLoss = strconv.FormatUint(p.LostBoot, 10)
		}
	}
	return out
}

func debugPDSocket(l serve.PDLink) debug.PDSocket {
	in, out := l.Inbox, l.Outbox
	sock := debug.PDSocket{Endpoint: in.Endpoint, Advertised: l.Advertised, AuthDenied: in.AuthDenied, AuthAdmitted: in.AuthAdmitted, LastAuthDenied: in.LastAuthDenied,
		Connections: in.Connections, ConnectionsPending: in.ConnectionsPending, ConnectionsRefused: in.ConnectionsRefused,
		ConnectionsShed: in.ConnectionsShed, LastShed: in.LastShed, Alive: in.Alive, ExitReason: in.ExitReason, Messages: in.Messages, Bytes: in.Bytes,
		HandlerErrors: in.HandlerErrors, HandlerPanics: in.HandlerPanics, RecvErrors: in.RecvErrors, Disconnects: in.Disconnects, LastError: in.LastError,
		Late: l.Late, Misplaced: l.Misplaced, Faulted: l.Faulted, OverQuota: l.OverQuota, RepliesDropped: l.RepliesDropped,
		Outbox: debug.PDOutbox{Alive: out.Alive, Peers: out.Peers, Queued: out.Queued, Backlog: out.Backlog, Sent: out.Sent,
			Bytes: out.Bytes, SendErrors: out.SendErrors, Dropped: out.Dropped, QueueFull: out.QueueFull, Evicted: out.Evicted,
			IdleClosed: out.IdleClosed, LastError: out.LastError}}
	if !in.LastMessage.IsZero() {
		t := in.LastMessage
		sock.LastMessage = &t
	}
	return sock
}
