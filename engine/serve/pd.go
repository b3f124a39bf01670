package serve

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/engine/sched"
)

// PD disaggregation: the prefill and decode roles of the engine.
//
// A PD request carries a bootstrap room. On a prefill server it waits in the
// bootstrap queue until every rank has the TRANSFER_INFO of its decode
// peer, then runs as a one-token request; after each forward step every
// rank sends the KV of the step's tokens of its shard (rows copied out of
// its pool, so the pages are released as usual) to its decode peer, the
// last chunk with the first token; it then waits in the inflight queue for
// the decode's STATUS Success. On a decode server it waits in the prealloc
// queue until the prefill's registry is resolved and its pages are
// reserved, sends TRANSFER_INFO to every prefill rank (each rank to its
// peer), waits in the transfer queue while the chunks land, and then joins
// the scheduler holding its transferred KV, with the prefill's first token
// as the last prompt token.
//
// Every transition is taken from agreed values: each iteration every rank
// computes a KVPoll state for each PD request it knows (the same list on
// every rank) from what its own sockets received, and the ranks MIN-reduce
// the vector, so a request moves on when all ranks are ready and fails when
// any rank failed (Failed is 0, the minimum). Timeouts are judged on rank
// 0's broadcast clock.
//
// Not yet here: heartbeats (a dead prefill is found by the transfer
// timeout), fault switches, and per-room page holds beyond the abort-ack
// deadline.

// PDConfig configures the PD roles. Zero values take the defaults noted.
type PDConfig struct {
	// Host is the address the ranks' ZeroMQ sockets bind (default
	// 127.0.0.1).
	Host string
	// BootstrapTimeout bounds the bootstrap (prefill: waiting for the
	// decode's TRANSFER_INFO; decode: resolving the prefill's registry and
	// reserving pages). Default 10s.
	BootstrapTimeout time.Duration
	// TransferTimeout bounds a decode request's wait for its KV once
	// TRANSFER_INFO is sent. Default 30s.
	TransferTimeout time.Duration
	// InflightTimeout bounds a prefill request's wait for the decode's
	// acknowledgement of the last chunk. Default 10s.
	InflightTimeout time.Duration
	// AbortAckTimeout is how long a decode keeps an aborted room's pages
	// reserved waiting for ABORT_ACK from every prefill rank. Default 5s.
	AbortAckTimeout time.Duration
	// SendTimeout bounds handing one message to the transport. Default 2s.
	SendTimeout time.Duration
	// HeartbeatInterval is how often a decode rank probes each prefill
	// rank it waits on (default 500ms); HeartbeatTimeout is how long a
	// probe may go unanswered before the rooms on that peer fail (default
	// 3s).
	HeartbeatInterval, HeartbeatTimeout time.Duration
	// ReservedDecodeTokens is the decode's room for growth: it reserves
	// pages for a transfer only while the pages left cover, for every
	// request it holds (running, parked, retracted, in transfer), the next
	// this many tokens of its output (fewer when its max_tokens ends
	// sooner), and a retracted request's whole recompute. Without it,
	// transfers take the pages running requests grow into, those are
	// retracted, and a retracted request can wait for ever behind the
	// parked transfers. Default 512; negative: no reserve.
	ReservedDecodeTokens int
}

func (c *PDConfig) setDefaults() {
	if c.Host == "" {
		c.Host = "127.0.0.1"
	}
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{{&c.BootstrapTimeout, 10 * time.Second}, {&c.TransferTimeout, 30 * time.Second},
		{&c.InflightTimeout, 10 * time.Second}, {&c.AbortAckTimeout, 5 * time.Second}, {&c.SendTimeout, 2 * time.Second},
		{&c.HeartbeatInterval, 500 * time.Millisecond}, {&c.HeartbeatTimeout, 3 * time.Second}} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if c.ReservedDecodeTokens == 0 {
		c.ReservedDecodeTokens = 512
	}
}

func (c PDConfig) validate() error {
	if c.BootstrapTimeout < 0 || c.TransferTimeout < 0 || c.InflightTimeout < 0 || c.AbortAckTimeout < 0 || c.SendTimeout < 0 {
		return errors.New("PD timeouts must not be negative")
	}
	if c.HeartbeatInterval <= 0 || c.HeartbeatTimeout <= c.HeartbeatInterval {
		return fmt.Errorf("PD heartbeat timeout %v must exceed its interval %v", c.HeartbeatTimeout, c.HeartbeatInterval)
	}
	return nil
}

// PDRequest is the PD part of a Request.
type PDRequest struct {
	Room uint64
	// BootstrapURL is the prefill server's registry (decode role only).
	BootstrapURL string
}

// pdPhase is where a PD request is on one rank.
type pdPhase uint8

const (
	phaseBootstrap pdPhase = iota // prefill: waiting for TRANSFER_INFO
	phaseActive                   // prefill: in the scheduler
	phaseInflight                 // prefill: chunks sent, waiting for the decode's ack
	phasePrealloc                 // decode: registry, pages
	phaseTransfer                 // decode: waiting for the chunks
	phaseAborting                 // decode: ABORT sent, pages held until acked
)

var phaseNames = [...]string{"bootstrap", "active", "inflight", "prealloc", "transfer", "aborting"}

func (p pdPhase) String() string { return phaseNames[p] }

// pdReq is one PD request on one rank.
type pdReq struct {
	id     uint64
	room   uint64
	url    string
	phase  pdPhase
	since  time.Duration // entered the phase, on the broadcast clock
	add    addMsg        // the request as it arrived
	info   *pdproto.TransferInfo
	sent   int     // prefill: prompt tokens whose KV was sent
	chunks int     // prefill: chunks sent; decode: chunks applied
	slots  []int32 // decode: destination slots of the prompt
	boot   uint64  // decode: the prefill peer's boot number when first heard
	first  *pdproto.ChunkFinal
	bytes  int    // KV payload bytes moved
	why    string // why it failed
	abort  bool   // decode: ABORT sent
	acked  bool   // decode: the prefill rank acknowledged the ABORT
	peer   string // the peer rank's endpoint
	// poll is this rank's own judgement of the request in the last
	// iteration, agreed the MIN over the ranks that every rank acted on.
	poll, agreed pdproto.KVPoll
}

// mailbox is what a rank's socket received, per room, for its loop. The
// receive goroutine writes it, the loop drains it; mu guards everything.
type mailbox struct {
	mu      sync.Mutex
	rooms   map[uint64]*mail
	known   map[uint64]bool // rooms the loop has (decode: others are late)
	late    atomic.Uint64   // messages for rooms nobody has, dropped
	faulted atomic.Uint64   // messages a drop-* fault switch dropped
	bad     atomic.Uint64   // messages that made no sense here, dropped
	prefill bool
	rank    uint32    // the rank's TP rank, in the acks it sends
	wake    func()    // tells the loops that mail arrived
	faults  *faultSet // the engine's fault switches
	reply   func(endpoint string, m pdproto.Message)
	self    *pdproto.Heartbeat // a prefill's reply template: Sender and Boot
	peers   map[string]*peerState
}

// peerState is a decode rank's view of one prefill rank's liveness.
type peerState struct {
	probe      uint64    // last probe sequence number sent
	probedAt   time.Time // when that probe went out
	unanswered time.Time // the first probe not answered since the last reply; zero when none
	boot       uint64    // the peer's boot number from its last reply
}

type mail struct {
	at     time.Time
	info   *pdproto.TransferInfo
	abort  *pdproto.Abort
	chunks []*pdproto.KVChunk
	status *pdproto.Status
	acked  bool
}

const maxUnknownRooms = 4096

// handle is the receive goroutine's handler: it files each message under
// its room. It never blocks on the loop.
func (mb *mailbox) handle(frames [][]byte) error {
	m, err := pdproto.Decode(frames)
	if err != nil {
		return err
	}
	switch exit, drop, delay := mb.faults.receiving(m.Type()); {
	case exit:
		return fmt.Errorf("receive loop: fault %s at a %s: %w", FaultPDLoopExit, m.Type(), zmqlink.ErrExitLoop)
	case drop:
		mb.faulted.Add(1)
		return nil
	case delay:
		time.Sleep(faultDelay) // the receive loop is the slow link
	}
	mb.mu.Lock()
	defer mb.mu.Unlock()
	if hb, ok := m.(*pdproto.Heartbeat); ok {
		mb.heartbeat(hb)
		return nil
	}
	room, _ := pdproto.RoomOf(m)
	if !mb.known[room] && (!mb.prefill || len(mb.rooms) >= maxUnknownRooms) {
		// A decode has every room it expects messages for; a prefill
		// may hear from a decode before the router's request arrives,
		// within a bound.
		mb.late.Add(1)
		return nil
	}
	x := mb.rooms[room]
	if x == nil {
		x = &mail{at: time.Now()}
		mb.rooms[room] = x
	}
	switch m := m.(type) {
	case *pdproto.TransferInfo:
		if !mb.prefill || x.info != nil {
			mb.bad.Add(1)
			return nil
		}
		x.info = m
	case *pdproto.Abort:
		if !mb.prefill {
			mb.bad.Add(1)
			return nil
		}
		if mb.faults.onAt(idxBootstrapAbortCrash) {
			// The reference system's bootstrap thread knew no ABORT
			// and died on it; so does this loop with the fault on.
			return fmt.Errorf("control loop: unknown message type %s (fault %s): %w", m.Type(), FaultBootstrapAbortCrash, zmqlink.ErrExitLoop)
		}
		if !mb.known[room] {
			// The loop does not have the room: it has not arrived yet,
			// or it ended. Nothing is written for a room the loop does
			// not have, so the ack goes now; the ABORT stays filed, and
			// a request for the room that arrives later fails on it.
			mb.reply(m.Endpoint, &pdproto.AbortAck{Room: room, Rank: mb.rank})
		}
		x.abort = m
	case *pdproto.KVChunk:
		if mb.prefill {
			mb.bad.Add(1)
			return nil
		}
		// zmqlink lends the frames only until handle returns, and the
		// chunk's payload points into them: keep a copy, in one buffer.
		buf := make([]byte, 0, m.PayloadBytes())
		for i := range m.Layers {
			l := &m.Layers[i]
			for _, p := range [...]*[]byte{&l.K, &l.V, &l.IndexK, &l.IndexKScales} {
				if n := len(*p); n > 0 {
					buf = append(buf, *p...)
					*p = buf[len(buf)-n : len(buf) : len(buf)]
				}
			}
		}
		x.chunks = append(x.chunks, m)
	case *pdproto.Status:
		x.status = m
	case *pdproto.AbortAck:
		if mb.prefill {
			mb.bad.Add(1)
			return nil
		}
		x.acked = true
	}
	mb.wake()
	return nil
}

// heartbeat answers a probe (prefill) or records a reply (decode). mu is
// held.
func (mb *mailbox) heartbeat(hb *pdproto.Heartbeat) {
	switch {
	case mb.prefill && !hb.Reply:
		r := *mb.self
		r.Seq, r.UnixNano, r.Reply = hb.Seq, time.Now().UnixNano(), true
		mb.reply(hb.Sender, &r)
	case !mb.prefill && hb.Reply:
		p := mb.peers[hb.Sender]
		if p == nil {
			mb.late.Add(1)
			return
		}
		p.unanswered, p.boot = time.Time{}, hb.Boot
		mb.wake()
	default:
		mb.bad.Add(1)
	}
}

// probe sends a heartbeat to peer when the interval has passed since the
// last one; called by the decode loop for every peer it waits on.
func (mb *mailbox) probe(peer, self string, boot uint64, every time.Duration, send func(string, pdproto.Message)) {
	mb.mu.Lock()
	p := mb.peers[peer]
	if p == nil {
		p = &peerState{}
		mb.peers[peer] = p
	}
	now := time.Now()
	if now.Sub(p.probedAt) < every {
		mb.mu.Unlock()
		return
	}
	p.probe++
	p.probedAt = now
	if p.unanswered.IsZero() {
		p.unanswered = now
	}
	seq := p.probe
	mb.mu.Unlock()
	send(peer, &pdproto.Heartbeat{Sender: self, Boot: boot, Seq: seq, UnixNano: now.UnixNano()})
}

// peer reports a prefill rank's liveness: how long its oldest unanswered
// probe has waited, and its boot number (0 before its first reply).
func (mb *mailbox) peer(endpoint string) (silent time.Duration, boot uint64) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	p := mb.peers[endpoint]
	if p == nil {
		return 0, 0
	}
	if !p.unanswered.IsZero() {
		silent = time.Since(p.unanswered)
	}
	return silent, p.boot
}

// take returns the room's mail, leaving the room's entry in place (chunks
// are moved out).
func (mb *mailbox) take(room uint64) mail {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	x := mb.rooms[room]
	if x == nil {
		return mail{}
	}
	out := *x
	x.chunks = nil
	return out
}

func (mb *mailbox) setKnown(room uint64, known bool) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	if known {
		mb.known[room] = true
		return
	}
	delete(mb.known, room)
	delete(mb.rooms, room)
}

// expire forgets mail for rooms the loop never took up.
func (mb *mailbox) expire(older time.Time) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	for room, x := range mb.rooms {
		if !mb.known[room] && x.at.Before(older) {
			delete(mb.rooms, room)
			mb.late.Add(1)
		}
	}
}

// rankPD is one rank's PD machinery.
type rankPD struct {
	inbox  *zmqlink.Inbox
	outbox *zmqlink.Outbox
	mb     *mailbox
	reqs   map[uint64]*pdReq
	snap   atomic.Pointer[[]PDEntry] // published after every iteration
	boot   uint64                    // this server's boot number, in heartbeats
	cfg    *PDConfig
	bytes  atomic.Uint64 // KV payload bytes this rank sent or applied
	// reserve is the decode's room for growth in the iteration's pdStep:
	// pages kept from the transfers, given back to the scheduler after.
	reserve int
}

// PDEntry is one PD request on one rank as the rank last published it.
type PDEntry struct {
	ID        uint64
	Room      uint64
	Queue     string        // bootstrap, active, inflight (prefill); prealloc, transfer, aborting (decode)
	InQueue   time.Duration // on the engine's clock, as of the rank's last iteration
	Peer      string        // the peer rank's endpoint, once known
	Tokens    int           // prompt tokens
	Chunks    int           // KV chunks sent (prefill) or applied (decode)
	Bytes     int           // KV payload bytes moved
	AbortSent bool          // decode: ABORT sent to the prefill rank
	Acked     bool          // decode: the prefill rank acknowledged it
	// Poll is the rank's own KVPoll judgement in its last iteration and
	// Agreed the MIN over the ranks that every rank acted on: a rank whose
	// Poll stays above Agreed waits for another rank.
	Poll, Agreed pdproto.KVPoll
	Error        string // why it is failing, if it is
}

// publishPD stores the rank's PD queues for readers.
func (l *rankLoop) publishPD() {
	if l.pd == nil {
		return
	}
	out := make([]PDEntry, 0, len(l.pd.reqs))
	for _, id := range slices.Sorted(maps.Keys(l.pd.reqs)) {
		q := l.pd.reqs[id]
		out = append(out, PDEntry{ID: q.id, Room: q.room, Queue: q.phase.String(), InQueue: l.now - q.since, Peer: q.peer,
			Tokens: len(q.add.prompt), Chunks: q.chunks, Bytes: q.bytes, AbortSent: q.abort, Acked: q.acked, Poll: q.poll, Agreed: q.agreed, Error: q.why})
	}
	l.pd.snap.Store(&out)
}

// newRankPD binds the rank's socket: control on a prefill rank, KV on a
// decode rank. The KV path (a prefill rank's Outbox, a decode rank's
// Inbox) uses zmqlink's zero-copy backend; the control path (a prefill
// rank's Inbox, a decode rank's Outbox) uses pebbe/zmq4.
func newRankPD(cfg *Config, rank int, boot uint64, wake func(), faults *faultSet) (*rankPD, error) {
	pd := &rankPD{mb: &mailbox{rooms: map[uint64]*mail{}, known: map[uint64]bool{}, prefill: cfg.Role == pdproto.RolePrefill,
		rank: uint32(rank), wake: wake, faults: faults, peers: map[string]*peerState{}}, reqs: map[uint64]*pdReq{}, boot: boot, cfg: &cfg.PD}
	kvOut := pd.mb.prefill // the prefill rank sends KV; the decode rank receives it
	out, err := zmqlink.NewOutbox(&zmqlink.OutboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: kvOut}})
	if err != nil {
		return nil, err
	}
	pd.outbox = out
	pd.mb.reply = func(endpoint string, m pdproto.Message) { pd.send(endpoint, m) }
	pd.mb.mu.Lock()
	pd.mb.self = &pdproto.Heartbeat{Boot: boot}
	pd.mb.mu.Unlock()
	in, err := zmqlink.Listen("tcp://"+cfg.PD.Host+":0", pd.mb.handle, &zmqlink.InboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: !kvOut}})
	if err != nil {
		out.Close()
		return nil, err
	}
	pd.inbox = in
	pd.mb.mu.Lock()
	pd.mb.self.Sender = in.Endpoint()
	pd.mb.mu.Unlock()
	return pd, nil
}

// send hands m to the transport for endpoint, within the send timeout.
func (pd *rankPD) send(endpoint string, m pdproto.Message) error {
	frames, err := pdproto.Encode(m)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), pd.cfg.SendTimeout)
	defer cancel()
	return pd.outbox.Send(ctx, endpoint, frames)
}

// heartbeats probes every prefill rank this decode rank waits on.
func (l *rankLoop) heartbeats() {
	if l.pd.mb.prefill {
		return
	}
	probed := map[string]bool{}
	for _, q := range l.pd.reqs {
		if q.peer != "" && !probed[q.peer] {
			probed[q.peer] = true
			l.pd.mb.probe(q.peer, l.pd.inbox.Endpoint(), l.pd.boot, l.pd.cfg.HeartbeatInterval, func(ep string, m pdproto.Message) { l.pd.send(ep, m) })
		}
	}
}

// peerLost says why a decode room's prefill peer counts as gone: silent
// past the heartbeat timeout, or restarted since the room began.
func (l *rankLoop) peerLost(q *pdReq) string {
	if q.peer == "" {
		return ""
	}
	silent, boot := l.pd.mb.peer(q.peer)
	switch {
	case silent > l.pd.cfg.HeartbeatTimeout:
		return fmt.Sprintf("prefill rank %s silent for %v (heartbeat timeout %v)", q.peer, silent.Round(time.Millisecond), l.pd.cfg.HeartbeatTimeout)
	case boot != 0 && q.boot == 0:
		q.boot = boot
	case boot != 0 && boot != q.boot:
		return fmt.Sprintf("prefill rank %s restarted", q.peer)
	}
	return ""
}

func (pd *rankPD) close() error {
	return errors.Join(pd.inbox.Close(), pd.outbox.Close())
}

func (l *rankLoop) send(endpoint string, m pdproto.Message) error { return l.pd.send(endpoint, m) }

// pdAdmit takes in a new PD request on this rank.
func (l *rankLoop) pdAdmit(a addMsg) {
	q := &pdReq{id: a.id, room: a.room, url: a.url, add: a, since: l.now, poll: pdproto.Bootstrapping, agreed: pdproto.Bootstrapping}
	if l.e.cfg.Role == pdproto.RolePrefill {
		q.phase = phaseBootstrap
	} else {
		q.phase = phasePrealloc
	}
	l.pd.reqs[a.id] = q
	l.pd.mb.setKnown(a.room, true)
	if l.r == 0 {
		l.e.pdCount(q.phase, 1)
	}
}

// pdStep runs the PD part of an iteration, before scheduling: every rank
// judges each PD request it knows, the ranks MIN-reduce the judgements, and
// every rank applies the same transitions. free is the agreed number of
// pages free for new work and rows the agreed number of free sequence
// rows; it returns what is left of the pages.
func (l *rankLoop) pdStep(free, rows int) (int, error) {
	if l.pd == nil {
		return free, nil
	}
	l.pd.mb.expire(time.Now().Add(-l.e.cfg.PD.BootstrapTimeout))
	if len(l.pd.reqs) == 0 {
		return free, nil
	}
	l.heartbeats()
	ids := slices.Sorted(maps.Keys(l.pd.reqs))
	states := make([]int64, len(ids))
	for i, id := range ids {
		q := l.pd.reqs[id]
		st := l.judge(q)
		if q.phase != phaseAborting { // there the vote is on the ack; the transfer stays Failed
			q.poll = st
		}
		states[i] = int64(st)
	}
	if err := l.comm().AllReduceMinInt(ctx, states); err != nil {
		return free, fmt.Errorf("serve: rank %d: pd poll: %w", l.r, err)
	}
	// The decode's room for growth is out of the transfers' reach while
	// they reserve; the scheduler and the transfer queue are the same on
	// every rank, so is the reserve.
	l.pd.reserve = l.growthReserve()
	free -= l.pd.reserve
	for i, id := range ids {
		var err error
		q := l.pd.reqs[id]
		st := pdproto.KVPoll(states[i])
		if q.phase != phaseAborting {
			q.agreed = st
		}
		free, rows, err = l.transition(q, st, free, rows)
		if err != nil {
			return free + l.pd.reserve, err
		}
	}
	return free + l.pd.reserve, nil
}

// growthReserve is the decode's room for growth (PDConfig.
// ReservedDecodeTokens): what the scheduler's requests may still need, and
// the first growth of the requests in transfer. Zero on a prefill.
func (l *rankLoop) growthReserve() int {
	g := l.e.cfg.PD.ReservedDecodeTokens
	if l.pd.mb.prefill || g < 0 {
		return 0
	}
	n := l.sched.Reserve(g)
	for _, q := range l.pd.reqs {
		if q.phase == phaseTransfer {
			n += l.transferGrowth(q)
		}
	}
	return n
}

// transferGrowth is the pages a request in transfer may need beyond its
// prompt's, for its first ReservedDecodeTokens of output.
func (l *rankLoop) transferGrowth(q *pdReq) int {
	n := len(q.add.prompt)
	peak := n + q.add.maxTokens - 1
	return l.e.cfg.pagesFor(min(peak, n+l.e.cfg.PD.ReservedDecodeTokens)) - l.e.cfg.pagesFor(n)
}

// judge is this rank's KVPoll of q, from its own mail and the agreed clock.
func (l *rankLoop) judge(q *pdReq) pdproto.KVPoll {
	c := &l.e.cfg.PD
	age := l.now - q.since
	m := l.pd.mb.take(q.room)
	switch q.phase {
	case phaseBootstrap:
		switch {
		case m.abort != nil:
			q.why = "aborted by the decode: " + m.abort.Reason
			return pdproto.Failed
		case m.info != nil:
			if err := l.checkInfo(q, m.info); err != nil {
				q.why = err.Error()
				return pdproto.Failed
			}
			q.info = m.info
			return pdproto.WaitingForInput
		case age > c.BootstrapTimeout:
			q.why = fmt.Sprintf("no transfer info from the decode within %v", c.BootstrapTimeout)
			return pdproto.Failed
		}
		return pdproto.Bootstrapping
	case phaseActive:
		switch {
		case m.abort != nil:
			q.why = "aborted by the decode: " + m.abort.Reason
			return pdproto.Failed
		case q.chunks == 0:
			return pdproto.WaitingForInput // the forward has not sent a chunk yet
		}
		return pdproto.Transferring
	case phaseInflight:
		switch {
		case m.abort != nil:
			q.why = "aborted by the decode: " + m.abort.Reason
			return pdproto.Failed
		case m.status != nil && m.status.State == pdproto.Success:
			return pdproto.Success
		case m.status != nil:
			q.why = "the decode failed: " + m.status.Error
			return pdproto.Failed
		case age > c.InflightTimeout:
			q.why = fmt.Sprintf("no acknowledgement from the decode within %v", c.InflightTimeout)
			return pdproto.Failed
		}
		return pdproto.Transferring
	case phasePrealloc:
		infos, err, done := l.e.resolved(q.url)
		switch {
		case m.status != nil && m.status.State == pdproto.Failed:
			q.why = "the prefill failed: " + m.status.Error
			return pdproto.Failed
		case done && err != nil:
			q.why = err.Error()
			return pdproto.Failed
		case done:
			if l.r >= len(infos) {
				q.why = fmt.Sprintf("the prefill has %d ranks", len(infos))
				return pdproto.Failed
			}
			q.peer = infos[l.r].Endpoint
			return pdproto.WaitingForInput
		case age > c.BootstrapTimeout:
			q.why = fmt.Sprintf("prefill registry %s not resolved within %v", q.url, c.BootstrapTimeout)
			return pdproto.Failed
		}
		return pdproto.Bootstrapping
	case phaseTransfer:
		if m.status != nil && m.status.State == pdproto.Failed {
			q.why = "the prefill failed: " + m.status.Error
			return pdproto.Failed
		}
		if why := l.peerLost(q); why != "" {
			q.why = why
			return pdproto.Failed
		}
		for _, ch := range m.chunks {
			if err := l.applyChunk(q, ch); err != nil {
				q.why = err.Error()
				return pdproto.Failed
			}
		}
		switch {
		case q.why != "":
			return pdproto.Failed
		case q.first != nil:
			return pdproto.Success
		case age > c.TransferTimeout:
			q.why = fmt.Sprintf("KV not received within %v", c.TransferTimeout)
			return pdproto.Failed
		case q.chunks == 0:
			return pdproto.WaitingForInput // no chunk has landed yet
		}
		return pdproto.Transferring
	case phaseAborting:
		// A lost peer acknowledges nothing; and were it only slow, its
		// late chunks could not land: the loop applies chunks only to
		// rooms in transfer, and mail for rooms it dropped is counted late.
		q.acked = m.acked
		if m.acked || (m.status != nil && m.status.State == pdproto.Failed) || age > c.AbortAckTimeout || l.peerLost(q) != "" {
			return pdproto.Success
		}
		return pdproto.Transferring
	}
	return pdproto.Failed
}

// checkInfo checks a decode rank's TRANSFER_INFO against the request.
func (l *rankLoop) checkInfo(q *pdReq, m *pdproto.TransferInfo) error {
	switch {
	case int(m.Tokens) != len(q.add.prompt):
		return fmt.Errorf("the decode expects %d prompt tokens, the prefill has %d", m.Tokens, len(q.add.prompt))
	case m.Rank != uint32(l.r):
		return fmt.Errorf("transfer info from decode rank %d reached prefill rank %d", m.Rank, l.r)
	case m.IndexKDType != l.e.indexKName():
		return fmt.Errorf("decode index-K %q, prefill %q", m.IndexKDType, l.e.indexKName())
	}
	return nil
}

// applyChunk writes a received chunk into the room's reserved slots.
func (l *rankLoop) applyChunk(q *pdReq, ch *pdproto.KVChunk) error {
	pool := l.rk.Pool()
	if int(ch.Chunk) != q.chunks || ch.Start > ch.End || int(ch.End) > len(q.slots) || len(ch.Layers) != l.e.m.Config.Layers {
		return fmt.Errorf("bad KV chunk %d [%d,%d) with %d layers for %d tokens", ch.Chunk, ch.Start, ch.End, len(ch.Layers), len(q.slots))
	}
	slots := q.slots[ch.Start:ch.End]
	for layer, kv := range ch.Layers {
		if err := pool.PutKV(layer, slots, kv.K, kv.V); err != nil {
			return err
		}
		if err := pool.PutIndexK(layer, slots, kv.IndexK, kv.IndexKScales); err != nil {
			return err
		}
	}
	q.chunks++
	q.bytes += ch.PayloadBytes()
	if ch.Final != nil {
		if int(ch.End) != len(q.slots) || int(ch.Final.PromptTokens) != len(q.slots) {
			return fmt.Errorf("last chunk ends at %d of %d prompt tokens", ch.End, len(q.slots))
		}
		q.first = ch.Final
	}
	return nil
}

// transition applies the agreed state of q.
func (l *rankLoop) transition(q *pdReq, st pdproto.KVPoll, free, rows int) (int, int, error) {
	if st == pdproto.Failed && q.phase != phaseAborting {
		return free, rows, l.pdFail(q)
	}
	switch q.phase {
	case phaseBootstrap:
		if st < pdproto.WaitingForInput {
			return free, rows, nil
		}
		q.peer = q.info.Endpoint
		l.pdMove(q, phaseActive)
		return free, rows, l.admit([]addMsg{q.add})
	case phaseInflight:
		if st == pdproto.Success {
			l.pdDone(q, nil)
		}
	case phasePrealloc:
		if st < pdproto.WaitingForInput {
			return free, rows, nil
		}
		need := l.e.cfg.pagesFor(len(q.add.prompt))
		grow := 0
		if l.e.cfg.PD.ReservedDecodeTokens > 0 {
			grow = l.transferGrowth(q)
		}
		// The scheduler may have to start a sequence for each of its
		// free slots (a retracted request is recomputed from 0), so
		// those rows stay out of reach of the transfers; and free is
		// what is left after the room for growth (pdStep), which this
		// request's own growth joins once it is reserved. With nothing
		// else held the reserve is zero, so one request always goes.
		if need+grow > free && (l.pd.reserve > 0 || need > free) || rows-1 < l.e.cfg.MaxRunning-l.sched.Admitted() {
			return free, rows, nil // waits for room
		}
		if err := l.reserve(q); err != nil {
			return free, rows, err
		}
		free, rows = free-need-grow, rows-1
		l.pd.reserve += grow
		info := &pdproto.TransferInfo{Room: q.room, Endpoint: l.pd.inbox.Endpoint(), Rank: uint32(l.r),
			Tokens: uint32(len(q.slots)), IndexKDType: l.e.indexKName(), RequestID: strconv.FormatUint(q.id, 10)}
		pageSize := int32(l.e.cfg.PageSize)
		for i := 0; i < len(q.slots); i += int(pageSize) {
			info.Pages = append(info.Pages, uint32(q.slots[i]/pageSize))
		}
		if err := l.send(q.peer, info); err != nil {
			q.why = "sending transfer info: " + err.Error()
			// Judged Failed by every rank next iteration? No: this is
			// rank-local. Keep the request and let the transfer timeout
			// fail it on every rank alike.
		}
		l.pdMove(q, phaseTransfer)
		q.why = ""
	case phaseTransfer:
		if st == pdproto.Success {
			return free, rows, l.pdArrived(q)
		}
	case phaseAborting:
		if st == pdproto.Success {
			l.pdRelease(q)
			l.pdForget(q)
		}
	}
	return free, rows, nil
}

// reserve starts the decode sequence of q with room for its prompt.
func (l *rankLoop) reserve(q *pdReq) error {
	pool := l.rk.Pool()
	if short := l.e.cfg.pagesFor(len(q.add.prompt)) - pool.FreePages(); short > 0 && l.cache != nil {
		l.cache.Evict(short)
	}
	seq, err := pool.NewSeq(q.id)
	if err == nil {
		if err = pool.Reserve(seq, len(q.add.prompt)); err != nil {
			pool.Release(seq)
		}
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: reserve KV for room %d: %w", l.r, q.room, err)
	}
	q.slots = slices.Clone(seq.Slots()[:len(q.add.prompt)])
	return nil
}

// pdArrived ends a decode request's transfer: the prompt's KV is committed
// and the request joins the scheduler with the prefill's first token.
func (l *rankLoop) pdArrived(q *pdReq) error {
	pool := l.rk.Pool()
	seq, ok := pool.Seq(q.id)
	if !ok {
		return fmt.Errorf("serve: rank %d: room %d lost its sequence", l.r, q.room)
	}
	if err := pool.Commit(seq, len(q.slots)); err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	l.send(q.peer, &pdproto.Status{Room: q.room, Rank: uint32(l.r), State: pdproto.Success})
	l.pd.bytes.Add(uint64(q.bytes))
	if o, ok := l.e.cfg.Observer.(PDObserver); ok {
		o.KVTransferred(l.r, q.bytes, l.now-q.since)
	}
	l.pdForget(q)
	a := q.add
	tok := q.first.FirstToken
	if l.r == 0 {
		l.e.pdBytes(q.bytes)
	}
	s := &seqState{all: append(append(make([]int32, 0, len(a.prompt)+a.maxTokens), a.prompt...), tok),
		maxTokens: a.maxTokens, ignoreEOS: a.ignoreEOS, stop: a.stop, decoding: true}
	stop := (!a.ignoreEOS && l.e.m.Tokenizer.IsEOG(tok)) || slices.Contains(a.stop, tok)
	if l.r == 0 {
		l.e.emitFirst(a.id, tok)
	}
	if stop || a.maxTokens == 1 {
		if err := pool.Release(seq); err != nil {
			return fmt.Errorf("serve: rank %d: %w", l.r, err)
		}
		if l.r == 0 {
			reason := sched.ReasonLength
			if stop {
				reason = sched.ReasonStop
			}
			l.e.finishFront(sched.Finish{ID: a.id, Reason: reason}, nil)
		}
		return nil
	}
	l.seqs[a.id] = s
	err := l.sched.Add(sched.Request{ID: a.id, PromptLen: len(a.prompt) + 1, MaxTokens: a.maxTokens - 1, Transferred: len(a.prompt)}, l.now)
	if err != nil {
		delete(l.seqs, a.id)
		pool.Release(seq)
		if l.r == 0 {
			l.e.finishFront(sched.Finish{ID: a.id, Reason: sched.ReasonError}, err)
		}
	}
	return nil
}

// pdFail ends q on this rank after the ranks agreed it failed, telling the
// peer: a prefill answers an ABORT with ABORT_ACK (nothing of the room is in
// flight: chunks are sent from the loop) or reports STATUS Failed; a decode
// that reserved pages sends ABORT and holds them until acknowledged.
func (l *rankLoop) pdFail(q *pdReq) error {
	m := l.pd.mb.take(q.room)
	why := q.why
	if why == "" {
		why = l.peerWhy(m)
	}
	if l.r == 0 && why != "aborted" {
		l.e.pd.fails.Add(1)
		l.e.pd.failsIn[q.phase].Add(1)
	}
	if q.url != "" && why != "aborted" {
		l.e.forgetResolution(q.url) // a restarted prefill has new endpoints
	}
	switch {
	case l.e.cfg.Role == pdproto.RolePrefill:
		if q.phase == phaseActive {
			if l.r == 0 {
				if r := l.e.front[q.id]; r != nil && r.cut == "" {
					r.cut = "error: pd: " + why
				}
			}
			q.why = why
			if err := l.cut(q.id); err != nil {
				return err
			}
		}
		if m.abort != nil {
			l.send(m.abort.Endpoint, &pdproto.AbortAck{Room: q.room, Rank: uint32(l.r)})
		} else if q.peer != "" {
			l.send(q.peer, &pdproto.Status{Room: q.room, Rank: uint32(l.r), State: pdproto.Failed, Error: why})
		}
		if q.phase != phaseActive {
			l.pdDone(q, errors.New("pd: "+why))
		} else {
			q.why = why // its finish, from the cut, ends it
		}
	case q.phase == phaseTransfer:
		// Every rank holds the pages until its prefill peer can write no
		// more: it acknowledged the ABORT, or had failed the room itself
		// (nothing follows STATUS Failed), or the deadline passed. Which
		// of these a rank saw is its own business; the move is agreed.
		l.pdEnd(q, errors.New("pd: "+why))
		if m.status == nil || m.status.State != pdproto.Failed {
			l.send(q.peer, &pdproto.Abort{Room: q.room, Endpoint: l.pd.inbox.Endpoint(), Rank: uint32(l.r), Reason: why})
			q.abort = true
		}
		q.poll, q.agreed = pdproto.Failed, pdproto.Failed // the transfer failed; the votes now are on the ack
		l.pdMove(q, phaseAborting)
	default: // prealloc: no pages yet
		if q.peer != "" {
			l.send(q.peer, &pdproto.Abort{Room: q.room, Endpoint: l.pd.inbox.Endpoint(), Rank: uint32(l.r), Reason: why})
		}
		l.pdEnd(q, errors.New("pd: "+why))
		l.pdForget(q)
	}
	return nil
}

// peerWhy names why a room failed when another rank judged it Failed and
// this one did not (its peer rank heard the other side first). It shapes
// only the text of the failure (rank 0's stream finish, the reason sent to
// the peer), never a move, which the MIN reduction agreed already: this
// rank's own mail may hold the same word from the other side by now, and
// if not, the text still names the side whose word failed the room, where
// it said only "another rank failed the room" before.
func (l *rankLoop) peerWhy(m mail) string {
	prefill := l.e.cfg.Role == pdproto.RolePrefill
	switch {
	case prefill && m.abort != nil:
		return "aborted by the decode: " + m.abort.Reason
	case m.status != nil && m.status.State == pdproto.Failed && prefill:
		return "the decode failed: " + m.status.Error
	case m.status != nil && m.status.State == pdproto.Failed:
		return "the prefill failed: " + m.status.Error
	case prefill:
		return "another rank failed the room: the decode aborted or failed it"
	}
	return "another rank failed the room: its prefill peer failed or went away"
}

// pdAbort handles an abort (client, operator, timeout) of a PD request that
// is not in the scheduler. It reports whether it did.
func (l *rankLoop) pdAbort(id uint64) (bool, error) {
	if l.pd == nil {
		return false, nil
	}
	q := l.pd.reqs[id]
	if q == nil || q.phase == phaseActive {
		return false, nil
	}
	switch q.phase {
	case phaseInflight, phaseAborting:
		return true, nil // the prefill work is done, or the abort is under way
	}
	q.why = "aborted"
	if l.r == 0 {
		if r := l.e.front[id]; r != nil {
			r.cut = ReasonAbort
		}
	}
	if l.e.cfg.Role == pdproto.RolePrefill {
		// The decode learns it from STATUS Failed when it sent its info.
		m := l.pd.mb.take(q.room)
		if m.info != nil {
			l.send(m.info.Endpoint, &pdproto.Status{Room: q.room, Rank: uint32(l.r), State: pdproto.Failed, Error: "aborted on the prefill"})
		}
		l.pdDone(q, nil)
		return true, nil
	}
	return true, l.pdFail(q)
}

// pdMove moves q to another phase.
func (l *rankLoop) pdMove(q *pdReq, p pdPhase) {
	if l.r == 0 {
		l.e.pdCount(q.phase, -1)
		l.e.pdCount(p, 1)
	}
	q.phase, q.since = p, l.now
}

// pdForget drops q from this rank's PD queues.
func (l *rankLoop) pdForget(q *pdReq) {
	if l.pd.reqs[q.id] == nil {
		return
	}
	delete(l.pd.reqs, q.id)
	l.pd.mb.setKnown(q.room, false)
	if l.r == 0 {
		l.e.pdCount(q.phase, -1)
	}
}

// pdRelease frees a decode request's reserved sequence.
func (l *rankLoop) pdRelease(q *pdReq) {
	pool := l.rk.Pool()
	if seq, ok := pool.Seq(q.id); ok {
		pool.Release(seq)
	}
}

// pdEnd finishes q's stream on rank 0 (abort if it was cut, else the error).
func (l *rankLoop) pdEnd(q *pdReq, err error) {
	if l.r != 0 {
		return
	}
	r := l.e.front[q.id]
	if r == nil {
		return
	}
	if r.cut != "" {
		l.e.finishFront(sched.Finish{ID: q.id, Reason: sched.ReasonAbort}, nil)
		return
	}
	l.e.finishFront(sched.Finish{ID: q.id, Reason: sched.ReasonError}, err)
}

// pdDone ends a prefill request: its stream gets the finish it had (err
// nil) or the error.
func (l *rankLoop) pdDone(q *pdReq, err error) {
	l.pdForget(q)
	if l.r != 0 {
		return
	}
	if err != nil {
		l.pdEnd(q, err)
		return
	}
	if r := l.e.front[q.id]; r != nil {
		l.e.totals.Finished++
		reason := ReasonLength
		if r.cut != "" {
			reason = r.cut
			l.e.totals.Aborts++
		}
		delete(l.e.front, q.id)
		l.e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
	}
}

// pdFinished is told of a prefill request the scheduler finished: one that
// produced its token goes to the inflight queue (its stream waits for the
// decode's ack); it reports whether the request is held there.
func (l *rankLoop) pdFinished(f sched.Finish) bool {
	if l.pd == nil || l.e.cfg.Role != pdproto.RolePrefill {
		return false
	}
	q := l.pd.reqs[f.ID]
	if q == nil {
		return false
	}
	if f.Reason == sched.ReasonStop || f.Reason == sched.ReasonLength {
		l.pdMove(q, phaseInflight)
		return true
	}
	// A failure the ranks agreed on (pdFail) has told the peer already;
	// an abort or timeout of the prefill itself tells it now.
	if q.why == "" && q.peer != "" {
		l.send(q.peer, &pdproto.Status{Room: q.room, Rank: uint32(l.r), State: pdproto.Failed, Error: "prefill " + f.Reason.String()})
	}
	l.pdForget(q)
	return false
}

// sendChunks sends, after a prefill step, the KV of each PD request's new
// tokens to its decode peer; the chunk of an item that sampled carries the
// first token. toks maps the step's sampled tokens by request.
func (l *rankLoop) sendChunks(items []sched.Item, toks map[uint64]int32) {
	if l.pd == nil || l.e.cfg.Role != pdproto.RolePrefill {
		return
	}
	pool := l.rk.Pool()
	for _, it := range items {
		q := l.pd.reqs[it.ID]
		s := l.seqs[it.ID]
		if q == nil || s == nil || s.cut {
			continue
		}
		seq, ok := pool.Seq(it.ID)
		if !ok {
			continue
		}
		end := it.Start + it.Tokens
		tok, final := toks[it.ID]
		if end <= q.sent && !final {
			continue // recomputed after a retraction: sent already
		}
		slots := seq.Slots()[q.sent:max(end, q.sent)]
		ch := &pdproto.KVChunk{Room: q.room, Chunk: uint32(q.chunks), Start: uint32(q.sent), End: uint32(end)}
		for layer := range l.e.m.Config.Layers {
			var kv pdproto.LayerKV
			kv.K, kv.V = pool.AppendKV(layer, slots, nil, nil)
			kv.IndexK, kv.IndexKScales = pool.AppendIndexK(layer, slots, nil, nil)
			ch.Layers = append(ch.Layers, kv)
		}
		if final {
			ch.Final = &pdproto.ChunkFinal{FirstToken: tok, PromptTokens: uint32(len(q.add.prompt)), CachedTokens: uint32(it.Cached)}
		}
		q.sent, q.chunks = end, q.chunks+1
		q.bytes += ch.PayloadBytes()
		l.pd.bytes.Add(uint64(ch.PayloadBytes()))
		if err := l.send(q.peer, ch); err != nil {
			q.why = "sending KV: " + err.Error()
		}
		if l.r == 0 && ch.Final != nil {
			l.e.pdBytes(q.bytes)
		}
	}
}
