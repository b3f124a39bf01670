package rooms

import (
	"fmt"
	"slices"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// rankBits is how many low bits of a vote carry the voter's rank.
const rankBits = 16

const maxRank = 1<<rankBits - 1

// Vote packs a rank's judgement of a room: the MIN over the ranks is the
// lowest state, a Failed nobody asked for below one asked for (an abort),
// and, among the ranks in it, the lowest rank. So every rank learns from
// the agreed vote whether the failure was an abort, also a rank that has
// not heard the abort itself yet.
func Vote(st pdproto.KVPoll, rank int) int64 { return vote(st, false, rank) }

// vote is Vote for a Failed that was asked for when asked is set.
func vote(st pdproto.KVPoll, asked bool, rank int) int64 {
	v := int64(st)<<(rankBits+1) | int64(rank)
	if asked && st == pdproto.Failed {
		v |= 1 << rankBits
	}
	return v
}

// Unvote splits an agreed vote.
func Unvote(v int64) (pdproto.KVPoll, int) {
	return pdproto.KVPoll(v >> (rankBits + 1)), int(v & maxRank)
}

// askedVote says an agreed Failed vote was an abort on every rank that
// voted Failed.
func askedVote(v int64) bool { return v>>rankBits&1 == 1 }

// room is one bootstrap room on this rank. The fields up to local move
// only on agreed events and are the same on every rank (but a decode's
// chunks, counted as they land on this rank); the rest is this rank's own
// knowledge, which shapes only its vote and its messages.
type room struct {
	req    Request
	phase  Phase
	since  time.Duration // entered the phase, on the agreed clock
	agreed pdproto.KVPoll
	failed bool   // agreed Failed (prefill Active: waiting for the scheduler's finish)
	reason Reason // the agreed failure, as this rank tells it
	owner  bool   // this rank's vote decided the failure
	sent   int    // prompt tokens whose chunks were handed out (prefill) or landed (decode)
	chunks int    // chunks handed out (prefill) or landed (decode)
	held   bool   // decode: a sequence is reserved for the room

	admitted time.Duration // when the request arrived: its request deadline counts from here
	lastWord time.Duration // prefill: the decode's last word (admission, QUEUED, TRANSFER_INFO)
	queuedAt time.Duration // decode: the last QUEUED sent, once queued
	queued   bool          // decode: a QUEUED went out
	position int           // the room's place in the decode's queue

	local    Reason // this rank's own failure, its vote from now on
	peer     string // the peer rank's endpoint
	info     *pdproto.TransferInfo
	abort    *pdproto.Abort
	status   *pdproto.Status
	acked    bool
	resolved bool
	first    *pdproto.ChunkFinal
	boot     uint64 // decode: the prefill peer's boot number when first heard
	bytes    int
	vote     pdproto.KVPoll
	abortTx  bool // decode: ABORT sent
}

// Machine is one rank's PD rooms. It is not safe for concurrent use: the
// rank's loop owns it.
type Machine struct {
	cfg   Config
	rooms map[uint64]*room
	order []uint64 // room ids, ascending: the order of the votes
	peers map[string]Liveness
	stats Stats

	// Checked by Check.
	reserves, releases, arrivals int
	violation                    error
}

// New returns an empty machine; it refuses a configuration Validate refuses.
func New(cfg Config) (*Machine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Machine{cfg: cfg, rooms: map[uint64]*room{}, peers: map[string]Liveness{}}, nil
}

// SetIndexKDType changes the pool's index-K precision the machine checks
// handshakes against (a live precision switch). Only rooms still in the
// handshake may span it (see Handshaking): a room past it has KV, or pages
// for KV, in the old precision.
func (m *Machine) SetIndexKDType(dt string) error {
	if n := len(m.order) - m.Handshaking(); n != 0 {
		return fmt.Errorf("rooms: index-K precision switch with %d rooms past the handshake", n)
	}
	m.cfg.IndexKDType = dt
	return nil
}

// Handshaking counts the rooms still in the handshake: on a prefill in
// Bootstrap (no KV computed, nothing sent; the decode's TRANSFER_INFO is
// judged against the precision of the moment at every vote), on a decode
// in Prealloc (no pages; TRANSFER_INFO not sent). They hold nothing in
// any precision, so a switch need not wait for them, and must not: a
// prefill room in Bootstrap may wait for decode pages that only requests
// the switch's drain holds back would free.
func (m *Machine) Handshaking() int {
	n := 0
	for id := range m.rooms {
		if m.InHandshake(id) {
			n++
		}
	}
	return n
}

// InHandshake reports whether request id has a room here that is still in
// the handshake (see Handshaking).
func (m *Machine) InHandshake(id uint64) bool {
	q := m.rooms[id]
	return q != nil && (q.phase == Bootstrap || q.phase == Prealloc)
}

// Finishing reports whether request id has a room here whose work on this
// side is done and which waits only for its peer's word or its deadline:
// a prefill room in Inflight, a decode room in Aborting. Abort does not
// change it (see Abort).
func (m *Machine) Finishing(id uint64) bool {
	q := m.rooms[id]
	return q != nil && (q.phase == Inflight || q.phase == Aborting)
}

// Len is the number of rooms, the length of the vote vector.
func (m *Machine) Len() int { return len(m.order) }

// Has reports whether request id has a room here.
func (m *Machine) Has(id uint64) bool { return m.rooms[id] != nil }

// Stats returns the counters.
func (m *Machine) Stats() Stats { return m.stats }

// Admit takes in a new PD request: Bootstrap on a prefill, Prealloc on a
// decode. An agreed event.
func (m *Machine) Admit(now time.Duration, r Request) error {
	if r.PromptLen < 1 || r.MaxTokens < 1 || (m.cfg.Role == Decode) != (r.URL != "") {
		return fmt.Errorf("%w: %+v", ErrInvalid, r)
	}
	if m.rooms[r.ID] != nil {
		return fmt.Errorf("%w: request %d", ErrDuplicate, r.ID)
	}
	q := &room{req: r, phase: Bootstrap, since: now, admitted: now, lastWord: now, agreed: pdproto.Bootstrapping, vote: pdproto.Bootstrapping}
	if m.cfg.Role == Decode {
		q.phase = Prealloc
	}
	m.rooms[r.ID] = q
	i, _ := slices.BinarySearch(m.order, r.ID)
	m.order = slices.Insert(m.order, i, r.ID)
	m.check()
	return nil
}

// File records the mail this rank received for request id, filed at the
// agreed time now. A decode's chunks for a room in transfer come back as
// ApplyChunk actions; mail that makes no sense in the room's phase is
// counted and dropped.
func (m *Machine) File(now time.Duration, id uint64, mail Mail) []Action {
	q := m.rooms[id]
	if q == nil || mail.Empty() {
		return nil
	}
	prefill := m.cfg.Role == Prefill
	if mail.Info != nil {
		if prefill && q.phase == Bootstrap && q.info == nil {
			q.info, q.lastWord = mail.Info, max(q.lastWord, now)
		} else {
			m.stats.Misplaced++
		}
	}
	switch {
	case mail.Queued == nil:
	case !prefill:
		m.stats.Misplaced++
	case q.phase == Bootstrap:
		q.lastWord, q.position = max(q.lastWord, now), int(mail.Queued.Position)
		// Later, a QUEUED sent before TRANSFER_INFO overtook it: nothing to do.
	}
	if mail.Abort != nil {
		if prefill {
			q.abort = mail.Abort
		} else {
			m.stats.Misplaced++
		}
	}
	if mail.Status != nil {
		q.status = mail.Status
	}
	if mail.Acked {
		if prefill {
			m.stats.Misplaced++
		} else {
			q.acked = true
		}
	}
	var acts []Action
	for _, ch := range mail.Chunks {
		switch {
		case prefill || q.phase == Prealloc:
			m.stats.Misplaced++
		case q.phase != Transfer || !q.local.IsZero():
			// Late chunks of a failed room: nothing is written.
		case ch.Prompt != q.req.Prompt:
			q.local = because(KindPromptMismatch, "KV chunk %d is for another prompt (fingerprint %v, this request's %v): is the room shared?", ch.Chunk, ch.Prompt, q.req.Prompt)
		case int(ch.Chunk) != q.chunks || int(ch.Start) != q.sent || ch.Start > ch.End || int(ch.End) > q.req.PromptLen:
			q.local = because(KindBadChunk, "bad KV chunk %d [%d,%d) for %d prompt tokens (expected chunk %d from token %d)", ch.Chunk, ch.Start, ch.End, q.req.PromptLen, q.chunks, q.sent)
		case ch.Final != nil && (int(ch.End) != q.req.PromptLen || int(ch.Final.PromptTokens) != q.req.PromptLen):
			q.local = because(KindBadChunk, "last chunk ends at %d of %d prompt tokens", ch.End, q.req.PromptLen)
		default:
			q.chunks, q.sent = q.chunks+1, int(ch.End)
			q.bytes += ch.PayloadBytes()
			if ch.Final != nil {
				q.first = ch.Final
			}
			acts = append(acts, ApplyChunk{ID: id, Chunk: ch})
		}
	}
	m.check()
	return acts
}

// Resolve records a decode room's registry lookup on this rank.
func (m *Machine) Resolve(id uint64, r Resolution) {
	q := m.rooms[id]
	if q == nil || q.phase != Prealloc || q.resolved {
		return
	}
	q.resolved = true
	if r.Err != nil {
		q.local = Reason{Kind: KindRefused, Text: r.Err.Error()}
		return
	}
	q.peer = r.Endpoint
}

// Resolving lists the decode rooms whose registry lookup this rank has not
// had yet, in id order.
func (m *Machine) Resolving() []Request {
	var out []Request
	for _, id := range m.order {
		if q := m.rooms[id]; q.phase == Prealloc && !q.resolved {
			out = append(out, q.req)
		}
	}
	return out
}

// Peer records what heartbeats tell of a prefill peer on this rank.
func (m *Machine) Peer(endpoint string, l Liveness) { m.peers[endpoint] = l }

// Peers lists the prefill peers this rank's decode rooms wait on, to probe
// (none on a prefill: the decode watches its prefill, and tells it of the
// rooms it queues).
func (m *Machine) Peers() []string {
	if m.cfg.Role != Decode {
		return nil
	}
	var out []string
	for _, id := range m.order {
		if q := m.rooms[id]; q.peer != "" && !slices.Contains(out, q.peer) {
			out = append(out, q.peer)
		}
	}
	return out
}

// SendFailed records that a message for request id could not be handed to
// the transport on this rank: the rank's vote of Failed in the next poll,
// with the error as the reason, so every rank fails the room at once. It
// reports false when that changes nothing (the room is gone or failing
// already): the caller logs the error instead.
func (m *Machine) SendFailed(id uint64, what string, err error) bool {
	return m.Failed(id, Reason{Kind: KindSend, Text: fmt.Sprintf("sending %s: %v", what, err)})
}

// Failed records a failure this rank alone saw (a chunk it could not
// write): its vote from now on. It reports false when the room is gone or
// failing already.
func (m *Machine) Failed(id uint64, r Reason) bool {
	q := m.rooms[id]
	if q == nil || !q.local.IsZero() || q.failed || q.phase == Aborting {
		return false
	}
	q.local = r
	return true
}

// Moved adds KV payload bytes sent for request id (prefill).
func (m *Machine) Moved(id uint64, bytes int) {
	if q := m.rooms[id]; q != nil {
		q.bytes += bytes
	}
}

// Votes returns this rank's poll, to be MIN-reduced across the ranks: its
// vote for every room in id order, then the first token its decode rank
// received for each room, then that token negated (so the MIN gives the
// smallest and the largest token: the ranks must agree on it before a
// room joins the scheduler). Its length is three times the number of
// rooms, which every rank agrees on.
func (m *Machine) Votes(now time.Duration) []int64 {
	n := len(m.order)
	out := make([]int64, 3*n)
	for i, id := range m.order {
		q := m.rooms[id]
		st := m.judge(now, q)
		q.vote = st
		asked := q.local.Asked || (q.failed && q.reason.Asked)
		out[i] = vote(st, asked, m.cfg.Rank)
		if q.first != nil {
			out[n+i], out[2*n+i] = int64(q.first.FirstToken), -int64(q.first.FirstToken)
		}
	}
	return out
}

// judge is this rank's KVPoll of q (in Aborting: whether its pages may go).
func (m *Machine) judge(now time.Duration, q *room) pdproto.KVPoll {
	c := &m.cfg
	age := now - q.since
	if q.phase == Aborting {
		lost := m.lost(q)
		if q.acked || (q.status != nil && q.status.State == pdproto.Failed) || age > c.AbortAckTimeout || !lost.IsZero() {
			return pdproto.Success
		}
		return pdproto.Transferring
	}
	fail := func(r Reason) pdproto.KVPoll {
		if q.local.IsZero() {
			q.local = r
		}
		return pdproto.Failed
	}
	if q.failed || !q.local.IsZero() {
		return pdproto.Failed
	}
	if r := m.peerWord(q); !r.IsZero() {
		return fail(r)
	}
	if c.RequestTimeout > 0 && now-q.admitted > c.RequestTimeout {
		return fail(because(KindTimeout, "request timeout %v passed in %v", c.RequestTimeout, q.phase))
	}
	switch q.phase {
	case Bootstrap:
		switch {
		case q.info != nil:
			if r := m.checkInfo(q); !r.IsZero() {
				return fail(r)
			}
			return pdproto.WaitingForInput
		case now-q.lastWord > c.BootstrapTimeout:
			return fail(because(KindTimeout, "no word from the decode within %v", c.BootstrapTimeout))
		}
		return pdproto.Bootstrapping
	case Active:
		switch {
		case age > c.TransferTimeout:
			return fail(because(KindTimeout, "KV not sent within %v", c.TransferTimeout))
		case q.chunks == 0:
			return pdproto.WaitingForInput
		}
		return pdproto.Transferring
	case Inflight:
		switch {
		case q.status != nil && q.status.State == pdproto.Success:
			return pdproto.Success
		case age > c.InflightTimeout:
			return fail(because(KindTimeout, "no acknowledgement from the decode within %v", c.InflightTimeout))
		}
		return pdproto.Transferring
	case Prealloc:
		switch {
		case !q.resolved && age > c.BootstrapTimeout:
			return fail(because(KindTimeout, "prefill registry %s not resolved within %v", q.req.URL, c.BootstrapTimeout))
		case !q.resolved:
			return pdproto.Bootstrapping
		}
		// Waiting for pages: alive while the prefill is (heartbeats),
		// within the request timeout.
		if r := m.lost(q); !r.IsZero() {
			return fail(r)
		}
		return pdproto.WaitingForInput
	case Transfer:
		if r := m.lost(q); !r.IsZero() {
			return fail(r)
		}
		switch {
		case q.first != nil:
			return pdproto.Success
		case age > c.TransferTimeout:
			return fail(because(KindTimeout, "KV not received within %v", c.TransferTimeout))
		case q.chunks == 0:
			return pdproto.WaitingForInput
		}
		return pdproto.Transferring
	}
	return pdproto.Failed
}

// lost says why a decode room's prefill peer counts as gone on this rank.
func (m *Machine) lost(q *room) Reason {
	if q.peer == "" {
		return Reason{}
	}
	l := m.peers[q.peer]
	switch {
	case l.Silent > m.cfg.HeartbeatTimeout:
		return because(KindPeerLost, "prefill rank %s silent for %v (heartbeat timeout %v)", q.peer, l.Silent, m.cfg.HeartbeatTimeout)
	case l.Boot != 0 && q.boot == 0:
		q.boot = l.Boot
	case l.Boot != 0 && l.Boot != q.boot:
		return because(KindPeerRestarted, "prefill rank %s restarted", q.peer)
	}
	return Reason{}
}

// checkInfo checks a decode rank's TRANSFER_INFO against the request: why
// it does not fit, if it does not.
func (m *Machine) checkInfo(q *room) Reason {
	i := q.info
	switch {
	case int(i.Tokens) != q.req.PromptLen:
		return because(KindRefused, "the decode expects %d prompt tokens, the prefill has %d", i.Tokens, q.req.PromptLen)
	case i.Prompt != q.req.Prompt:
		return because(KindPromptMismatch, "the decode's prompt is not this request's (fingerprint %v, this request's %v): is the room shared?", i.Prompt, q.req.Prompt)
	case i.Rank != uint32(m.cfg.Rank):
		return because(KindRefused, "transfer info from decode rank %d reached prefill rank %d", i.Rank, m.cfg.Rank)
	case i.IndexKDType != m.cfg.IndexKDType:
		return because(KindRefused, "decode index-K %q, prefill %q", i.IndexKDType, m.cfg.IndexKDType)
	}
	return Reason{}
}

// Apply moves every room by its agreed vote (the MIN of every rank's), at
// the agreed time now. Decode rooms ready for pages wait for Grant.
func (m *Machine) Apply(now time.Duration, agreed []int64) ([]Action, error) {
	n := len(m.order)
	if len(agreed) != 3*n {
		return nil, fmt.Errorf("%w: a poll of %d values for %d rooms", ErrVotes, len(agreed), n)
	}
	var acts []Action
	for i, id := range slices.Clone(m.order) {
		q := m.rooms[id]
		st, owner := Unvote(agreed[i])
		if !st.Valid() {
			return acts, fmt.Errorf("%w: vote %d for request %d", ErrVotes, agreed[i], id)
		}
		if lo, hi := agreed[n+i], -agreed[2*n+i]; q.phase == Transfer && st == pdproto.Success && lo != hi {
			// Every rank has its KV, but not the same first token: the
			// ranks would go on from different tokens. The agreed values
			// show it to every rank alike.
			st, owner = pdproto.Failed, 0
			q.local = because(KindBadChunk, "the ranks received different first tokens (%d to %d)", lo, hi)
		}
		if q.phase == Aborting {
			if st == pdproto.Success {
				acts = m.release(acts, q)
				acts = m.forget(acts, q)
			}
			continue
		}
		if q.failed && st != pdproto.Failed {
			m.violate("request %d agreed %v after Failed", id, st)
		}
		q.agreed = st
		if st == pdproto.Failed {
			acts = m.fail(now, acts, q, owner == m.cfg.Rank, askedVote(agreed[i]))
			continue
		}
		switch {
		case q.phase == Bootstrap && st >= pdproto.WaitingForInput:
			q.peer = q.info.Endpoint
			m.move(now, q, Active)
			acts = append(acts, Admit{ID: id})
		case q.phase == Inflight && st == pdproto.Success:
			acts = append(acts, End{ID: id, Outcome: Outcome{OK: true, Phase: Inflight, Peer: q.peer}})
			acts = m.forget(acts, q)
		case q.phase == Transfer && st == pdproto.Success:
			m.arrivals++
			q.held = false
			acts = append(acts, Arrived{ID: id, First: *q.first, Bytes: q.bytes, Took: now - q.since},
				SendStatus{ID: id, Room: q.req.Room, Peer: q.peer, State: pdproto.Success})
			acts = m.forget(acts, q)
		}
	}
	m.check()
	if m.violation == nil {
		for _, id := range m.order {
			q := m.rooms[id]
			if d, _ := m.deadline(q); !q.failed && now > d {
				m.violate("request %d in %v past its deadline %v at %v", id, q.phase, d, now)
			}
		}
	}
	return acts, nil
}

// fail ends q after the ranks agreed it failed, telling the peer: a prefill
// answers an ABORT with ABORT_ACK (nothing of the room is in flight: chunks
// are sent from the loop) or reports STATUS Failed; a decode that reserved
// pages sends ABORT (unless the prefill failed the room itself: nothing
// follows STATUS Failed) and holds them until acknowledged.
func (m *Machine) fail(now time.Duration, acts []Action, q *room, owner, asked bool) []Action {
	if q.failed {
		return acts
	}
	q.failed, q.owner, q.reason = true, owner, q.local
	if q.reason.IsZero() {
		q.reason = m.otherRank(q)
	}
	q.reason.Asked = asked // as agreed: every rank that failed the room heard an abort
	id, rm := q.req.ID, q.req.Room
	end := End{ID: id, Outcome: Outcome{Reason: q.reason, Phase: q.phase, Owner: owner, Peer: q.peer}}
	if m.cfg.Role == Prefill {
		acts = m.tellPrefillPeer(acts, q, q.reason)
		if q.phase == Active {
			return append(acts, Cut{ID: id, Reason: q.reason}) // its End comes with the scheduler's finish
		}
		acts = append(acts, end)
		return m.forget(acts, q)
	}
	peerFailed := q.status != nil && q.status.State == pdproto.Failed
	if q.phase == Prealloc {
		if q.peer != "" && !peerFailed {
			acts = append(acts, SendAbort{ID: id, Room: rm, Peer: q.peer, Reason: q.reason.Text, Asked: q.reason.Asked})
		}
		acts = append(acts, end)
		return m.forget(acts, q)
	}
	acts = append(acts, end)
	if !peerFailed {
		acts = append(acts, SendAbort{ID: id, Room: rm, Peer: q.peer, Reason: q.reason.Text, Asked: q.reason.Asked})
		q.abortTx = true
	}
	m.move(now, q, Aborting)
	return acts
}

// tellPrefillPeer is how a failing prefill room tells its decode rank:
// ABORT_ACK to an ABORT, else STATUS Failed to whoever sent TRANSFER_INFO.
func (m *Machine) tellPrefillPeer(acts []Action, q *room, why Reason) []Action {
	switch {
	case q.abort != nil:
		return append(acts, SendAbortAck{ID: q.req.ID, Room: q.req.Room, To: q.abort.Endpoint})
	case q.info != nil:
		return append(acts, SendStatus{ID: q.req.ID, Room: q.req.Room, Peer: q.info.Endpoint, State: pdproto.Failed, Error: why.Text, Asked: why.Asked})
	}
	return acts
}

// peerWord is the failure the other side sent this rank for q, if any: an
// ABORT (to a prefill) or STATUS Failed.
func (m *Machine) peerWord(q *room) Reason {
	switch s := q.status; {
	case q.abort != nil:
		r := because(KindPeerAborted, "aborted by the decode: %s", q.abort.Reason)
		r.Asked = q.abort.Asked
		return r
	case s != nil && s.State == pdproto.Failed && m.cfg.Role == Prefill:
		return because(KindPeerFailed, "the decode failed: %s", s.Error)
	case s != nil && s.State == pdproto.Failed:
		r := because(KindPeerFailed, "the prefill failed: %s", s.Error)
		r.Asked = s.Asked
		return r
	}
	return Reason{}
}

// otherRank names why a room failed when another rank voted Failed and
// this one did not: from this rank's mail when it holds the other side's
// word by now, else by the side whose word it must have been.
func (m *Machine) otherRank(q *room) Reason {
	if r := m.peerWord(q); !r.IsZero() {
		return r
	}
	if m.cfg.Role == Prefill {
		return because(KindOtherRank, "another rank failed the room: its decode aborted, failed or went silent")
	}
	return because(KindOtherRank, "another rank failed the room: its prefill peer failed or went away")
}

// Grant gives pages to the decode rooms ready for them (agreed
// WaitingForInput in Prealloc), in id order, within budget b, keeping the
// room for growth (Config.ReservedDecodeTokens) of everything held. It
// returns the pages left for the scheduler.
func (m *Machine) Grant(now time.Duration, b Budget) (int, []Action) {
	if m.cfg.Role != Decode {
		return b.FreePages, nil
	}
	reserve := 0
	if m.cfg.ReservedDecodeTokens >= 0 {
		reserve = b.SchedGrowth
		for _, id := range m.order {
			if q := m.rooms[id]; q.phase == Transfer {
				reserve += m.growth(q)
			}
		}
	}
	free, rows, taken, position := b.FreePages-reserve, b.FreeRows, 0, 0
	var acts []Action
	for _, id := range m.order {
		q := m.rooms[id]
		if q.phase != Prealloc || q.agreed < pdproto.WaitingForInput || q.failed {
			continue
		}
		need, grow := m.pages(q.req.PromptLen), 0
		if m.cfg.ReservedDecodeTokens >= 0 {
			grow = m.growth(q)
		}
		// With nothing else held the reserve is zero, so one request
		// always goes; the scheduler's free slots keep a row each (a
		// retracted request restarts on a fresh one).
		if need+grow > free && (reserve > 0 || need > free) || rows-1 < b.SchedSlots {
			// It waits its turn: the prefill hears so, often enough to
			// keep the room's lease there.
			q.position = position
			position++
			if !q.queued || now-q.queuedAt >= m.cfg.QueuedInterval {
				q.queued, q.queuedAt = true, now
				acts = append(acts, SendQueued{ID: id, Room: q.req.Room, Peer: q.peer, Position: q.position})
			}
			continue
		}
		free, rows, taken = free-need-grow, rows-1, taken+need
		reserve += grow
		m.reserves++
		q.held = true
		m.move(now, q, Transfer)
		acts = append(acts, Reserve{ID: id, Tokens: q.req.PromptLen},
			SendTransferInfo{ID: id, Room: q.req.Room, Peer: q.peer, Tokens: q.req.PromptLen})
	}
	m.check()
	return b.FreePages - taken, acts
}

// growth is the pages a decode room may need beyond its prompt's, for its
// first ReservedDecodeTokens of output.
func (m *Machine) growth(q *room) int {
	n := q.req.PromptLen
	peak := n + q.req.MaxTokens - 1
	return m.pages(min(peak, n+m.cfg.ReservedDecodeTokens)) - m.pages(n)
}

func (m *Machine) pages(tokens int) int { return (tokens + m.cfg.PageSize - 1) / m.cfg.PageSize }

// Abort ends request id on an agreed abort (the client, the router, an
// operator). handled is false when the room is not the machine's to end:
// unknown, or a prefill room in the scheduler, which the caller aborts
// there (its finish comes back through SchedFinished).
func (m *Machine) Abort(now time.Duration, id uint64, why string) (acts []Action, handled bool) {
	q := m.rooms[id]
	if q == nil || q.phase == Active {
		return nil, false
	}
	if q.phase == Inflight || q.phase == Aborting || q.failed {
		return nil, true // the prefill's work is done, or the abort is under way
	}
	r := Reason{Kind: KindAborted, Text: why, Asked: true}
	q.local = r
	defer m.check()
	if m.cfg.Role == Prefill {
		acts = m.tellPrefillPeer(acts, q, Reason{Kind: KindAborted, Text: "aborted on the prefill: " + why, Asked: true})
		acts = append(acts, End{ID: id, Outcome: Outcome{Reason: r, Phase: q.phase, Owner: m.cfg.Rank == 0}})
		q.failed = true
		return m.forget(acts, q), true
	}
	return m.fail(now, nil, q, m.cfg.Rank == 0, true), true
}

// SchedAborted is the scheduler's reason for a request someone aborted:
// SchedFinished's why, telling the decode it was an abort.
const SchedAborted = "abort"

// SchedFinished tells the machine the prefill's scheduler finished request
// id: produced (its token is out) or not (aborted, timed out). handled says
// the machine owns the request's end: it waits in Inflight for the decode's
// word, or it ends now by an End among acts. Otherwise the caller ends the
// request by the scheduler's reason.
func (m *Machine) SchedFinished(now time.Duration, id uint64, produced bool, why string) (acts []Action, handled bool) {
	q := m.rooms[id]
	if q == nil || q.phase != Active {
		return nil, false
	}
	defer m.check()
	switch {
	case q.failed:
		acts = append(acts, End{ID: id, Outcome: Outcome{Reason: q.reason, Phase: Active, Owner: q.owner, Peer: q.peer}})
		return m.forget(acts, q), true
	case produced:
		m.move(now, q, Inflight)
		return nil, true
	}
	acts = append(acts, SendStatus{ID: id, Room: q.req.Room, Peer: q.peer, State: pdproto.Failed, Error: "prefill " + why, Asked: why == SchedAborted})
	return m.forget(acts, q), false
}

// Sent plans the chunk of a prefill step: request id's sequence now holds
// the KV of its first end prompt tokens; final carries the first token when
// the step sampled it. Tokens recomputed after a retraction are not sent
// again.
func (m *Machine) Sent(id uint64, end int, final *pdproto.ChunkFinal) []Action {
	q := m.rooms[id]
	if q == nil || q.phase != Active || q.failed || (end <= q.sent && final == nil) {
		return nil
	}
	a := SendChunk{ID: id, Room: q.req.Room, Peer: q.peer, Index: q.chunks, Start: q.sent, End: max(end, q.sent), Final: final}
	q.sent, q.chunks = a.End, q.chunks+1
	return []Action{a}
}

func (m *Machine) move(now time.Duration, q *room, p Phase) { q.phase, q.since = p, now }

func (m *Machine) release(acts []Action, q *room) []Action {
	if !q.held {
		m.violate("request %d released without pages", q.req.ID)
	}
	q.held = false
	m.releases++
	return append(acts, Release{ID: q.req.ID})
}

func (m *Machine) forget(acts []Action, q *room) []Action {
	if q.held {
		m.violate("request %d forgotten holding pages", q.req.ID)
	}
	delete(m.rooms, q.req.ID)
	if i, ok := slices.BinarySearch(m.order, q.req.ID); ok {
		m.order = slices.Delete(m.order, i, i+1)
	}
	why := q.reason.Text
	if why == "" {
		why = q.local.Text
	}
	return append(acts, Forget{ID: q.req.ID, Room: q.req.Room, Why: why, Asked: q.reason.Asked || q.local.Asked})
}

// deadline is when q's phase times out on this rank, on the agreed clock,
// and whether that is the end of a lease the peer's word renews. A decode
// room waiting for pages has no fixed deadline but the request timeout:
// its lease is its prefill's liveness (heartbeats).
func (m *Machine) deadline(q *room) (d time.Duration, leased bool) {
	c := &m.cfg
	d = NoDeadline
	switch q.phase {
	case Bootstrap:
		leased = true
		if q.info == nil {
			d = q.lastWord + c.BootstrapTimeout
		} // else this rank's peer has spoken; it waits for the others' leases
	case Prealloc:
		if !q.resolved {
			d = q.since + c.BootstrapTimeout
		} else {
			leased = true
		}
	case Active, Transfer:
		d = q.since + c.TransferTimeout
	case Inflight:
		d = q.since + c.InflightTimeout
	case Aborting:
		return q.since + c.AbortAckTimeout, false
	}
	if c.RequestTimeout > 0 {
		d = min(d, q.admitted+c.RequestTimeout)
	}
	return d, leased
}

// Entries returns every room, in id order.
func (m *Machine) Entries() []Entry {
	out := make([]Entry, 0, len(m.order))
	for _, id := range m.order {
		q := m.rooms[id]
		e := Entry{ID: id, Room: q.req.Room, Phase: q.phase, Since: q.since, Peer: q.peer, PromptLen: q.req.PromptLen,
			Chunks: q.chunks, Bytes: q.bytes, AbortSent: q.abortTx, Acked: q.acked, Vote: q.vote, Agreed: q.agreed, Reason: q.local,
			Position: q.position}
		e.Deadline, e.Leased = m.deadline(q)
		if q.failed {
			e.Reason = q.reason
		}
		if q.phase == Aborting {
			e.Vote, e.Agreed = pdproto.Failed, pdproto.Failed // the transfer failed; the votes now are on the ack
		}
		out = append(out, e)
	}
	return out
}
