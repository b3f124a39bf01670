package serve

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
)

// mailbox is what a rank's socket received, per room, for its loop: the
// one structure of the PD path that two goroutines share. The receive
// goroutine files messages into it and the loop takes them out; mu guards
// everything but the counters. Replies (ABORT_ACK, heartbeat answers) are
// posted after mu is released, to the rank's reply queue (pdlimits.go),
// which never waits: a slow or dead peer holds neither the lock nor the
// receive goroutine.
type mailbox struct {
	mu      sync.Mutex
	rooms   map[uint64]*mail
	known   map[uint64]bool // rooms the loop has (decode: others are late)
	late    atomic.Uint64   // messages for rooms nobody has, dropped
	faulted atomic.Uint64   // messages a drop-* fault switch dropped
	bad     atomic.Uint64   // messages that made no sense here, dropped
	// filed counts the messages filed under a room for the loop: the
	// rank-local signal the fault overlap-local-decision branches on.
	filed   atomic.Uint64
	prefill bool
	rank    uint32    // the rank's TP rank, in the acks it sends
	wake    func()    // tells the loops that mail arrived
	faults  *faultSet // the engine's fault switches
	reply   func(endpoint string, m pdproto.Message)
	self    pdproto.Heartbeat // a prefill's reply template: Sender and Boot
	peers   map[string]*peerState
	// ended remembers why a prefill's recent rooms failed (a bounded
	// FIFO): a decode that still asks about one (TRANSFER_INFO, QUEUED)
	// hears STATUS Failed at once, instead of waiting out its timeout.
	ended      map[uint64]string
	endedOrder []uint64
	early      int // rooms with mail the loop does not have yet
	// earlyFrom counts the early rooms by their sender, which perSender
	// bounds (0: only the table's bound): one sender cannot fill the table
	// and starve the others' rooms.
	earlyFrom map[string]int
	perSender int
	overQuota atomic.Uint64 // messages past a quota, dropped: a new room past its sender's, a room's chunks past roomBytes
	// roomBytes bounds the KV bytes filed for one room and not yet taken
	// by the loop (0: no bound): a whole context's KV for the rank, which
	// no legal transfer exceeds, so that a peer replaying chunks for a
	// room, while the loop is held, cannot grow the heap without end.
	roomBytes int64
}

// peerState is a decode rank's view of one prefill rank's liveness.
type peerState struct {
	probe      uint64    // last probe sequence number sent
	probedAt   time.Time // when that probe went out
	unanswered time.Time // the first probe not answered since the last reply; zero when none
	boot       uint64    // the peer's boot number from its last reply
}

// mail is one room's messages waiting for the loop.
type mail struct {
	at       time.Time
	infoSeen bool   // a TRANSFER_INFO was filed: a second one is refused
	from     string // the sender of the room's first mail, while the room is early
	kvBytes  int64  // the KV payload of the chunks filed and not yet taken
	rooms.Mail
}

// maxUnknownRooms bounds the rooms a prefill keeps mail for before their
// request arrived, and the failed rooms it remembers.
const maxUnknownRooms = 4096

func newMailbox(prefill bool, rank int, wake func(), faults *faultSet) *mailbox {
	return &mailbox{rooms: map[uint64]*mail{}, known: map[uint64]bool{}, prefill: prefill, rank: uint32(rank), wake: wake,
		faults: faults, peers: map[string]*peerState{}, ended: map[uint64]string{}, earlyFrom: map[string]int{}}
}

// handle is the receive goroutine's handler: it files each message under
// its room. It never waits for the loop.
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
	if a, ok := m.(*pdproto.Abort); ok && mb.prefill && mb.faults.onAt(idxBootstrapAbortCrash) {
		// The reference system's bootstrap thread knew no ABORT and
		// died on it; so does this loop with the fault on.
		return fmt.Errorf("control loop: unknown message type %s (fault %s): %w", a.Type(), FaultBootstrapAbortCrash, zmqlink.ErrExitLoop)
	}
	to, answer, err := mb.file(m)
	if answer != nil {
		mb.reply(to, answer)
	}
	return err
}

// file files m under its room, or records a heartbeat; it returns the
// answer to send, if any, once mu is released.
func (mb *mailbox) file(m pdproto.Message) (to string, answer pdproto.Message, err error) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	if hb, ok := m.(*pdproto.Heartbeat); ok {
		return mb.heartbeat(hb)
	}
	room, _ := pdproto.RoomOf(m)
	if why, ok := mb.ended[room]; ok && !mb.known[room] {
		return mb.endedAnswer(room, why, m)
	}
	if !mb.known[room] && (!mb.prefill || (mb.rooms[room] == nil && mb.early >= maxUnknownRooms)) {
		// A decode has every room it expects messages for; a prefill
		// may hear from a decode before the router's request arrives,
		// within a bound.
		mb.late.Add(1)
		return "", nil, nil
	}
	if !mb.placed(m) {
		mb.bad.Add(1)
		return "", nil, nil
	}
	x := mb.rooms[room]
	if x == nil {
		from := senderOf(m)
		if !mb.known[room] && mb.perSender > 0 && mb.earlyFrom[from] >= mb.perSender {
			mb.overQuota.Add(1)
			return "", nil, nil
		}
		x = &mail{at: time.Now()}
		mb.rooms[room] = x
		if !mb.known[room] {
			mb.addEarly(x, from)
		}
	}
	switch m := m.(type) {
	case *pdproto.TransferInfo:
		if x.infoSeen {
			mb.bad.Add(1)
			return "", nil, nil
		}
		x.Info, x.infoSeen = m, true
	case *pdproto.Abort:
		if !mb.known[room] {
			// The loop does not have the room: it has not arrived yet,
			// or it ended. Nothing is written for a room the loop does
			// not have, so the ack goes now; the ABORT stays filed, and
			// a request for the room that arrives later fails on it.
			to, answer = m.Endpoint, &pdproto.AbortAck{Room: room, Rank: mb.rank}
		}
		x.Abort = m
	case *pdproto.KVChunk:
		n := int64(m.PayloadBytes())
		if mb.roomBytes > 0 && x.kvBytes+n > mb.roomBytes {
			mb.overQuota.Add(1) // the room then fails on the missing chunk
			return "", nil, nil
		}
		x.kvBytes += n
		x.Chunks = append(x.Chunks, ownChunk(m))
	case *pdproto.Status:
		x.Status = m
	case *pdproto.AbortAck:
		x.Acked = true
	case *pdproto.Queued:
		x.Queued = m
	}
	mb.filed.Add(1)
	mb.wake()
	return to, answer, nil
}

// senderOf is who m says sent it: the endpoint it names for answers
// ("" for a message that names none).
func senderOf(m pdproto.Message) string {
	switch m := m.(type) {
	case *pdproto.TransferInfo:
		return m.Endpoint
	case *pdproto.Queued:
		return m.Endpoint
	case *pdproto.Abort:
		return m.Endpoint
	}
	return ""
}

// addEarly counts x, a room the loop does not have, against from's quota.
func (mb *mailbox) addEarly(x *mail, from string) {
	mb.early++
	x.from = from
	mb.earlyFrom[from]++
}

// dropEarly uncounts x, an early room that the loop took up or that went.
func (mb *mailbox) dropEarly(x *mail) {
	mb.early--
	if mb.earlyFrom[x.from]--; mb.earlyFrom[x.from] <= 0 {
		delete(mb.earlyFrom, x.from)
	}
}

// endedAnswer answers mail about a room this prefill failed and forgot:
// TRANSFER_INFO and QUEUED get STATUS Failed with the reason, an ABORT its
// ack; anything else is late.
func (mb *mailbox) endedAnswer(room uint64, why string, m pdproto.Message) (string, pdproto.Message, error) {
	failed := &pdproto.Status{Room: room, Rank: mb.rank, State: pdproto.Failed, Error: "the prefill ended the room: " + why}
	switch m := m.(type) {
	case *pdproto.TransferInfo:
		return m.Endpoint, failed, nil
	case *pdproto.Queued:
		return m.Endpoint, failed, nil
	case *pdproto.Abort:
		return m.Endpoint, &pdproto.AbortAck{Room: room, Rank: mb.rank}, nil
	}
	mb.late.Add(1)
	return "", nil, nil
}

// placed reports whether the rank's role ever receives a message of m's
// type: a prefill takes TRANSFER_INFO, QUEUED, ABORT and STATUS; a decode
// KV_CHUNK, STATUS and ABORT_ACK.
func (mb *mailbox) placed(m pdproto.Message) bool {
	switch m.(type) {
	case *pdproto.TransferInfo, *pdproto.Abort, *pdproto.Queued:
		return mb.prefill
	case *pdproto.KVChunk, *pdproto.AbortAck:
		return !mb.prefill
	}
	return true
}

// ownChunk copies a chunk's payload out of the frames zmqlink lends only
// until the handler returns, into one buffer.
func ownChunk(m *pdproto.KVChunk) *pdproto.KVChunk {
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
	return m
}

// heartbeat answers a probe (prefill) or records a reply (decode). mu is
// held; the answer goes out after.
func (mb *mailbox) heartbeat(hb *pdproto.Heartbeat) (string, pdproto.Message, error) {
	switch {
	case mb.prefill && !hb.Reply:
		r := mb.self
		r.Seq, r.UnixNano, r.Reply = hb.Seq, time.Now().UnixNano(), true
		return hb.Sender, &r, nil
	case !mb.prefill && hb.Reply:
		p := mb.peers[hb.Sender]
		if p == nil {
			mb.late.Add(1)
			return "", nil, nil
		}
		p.unanswered, p.boot = time.Time{}, hb.Boot
		mb.wake()
	default:
		mb.bad.Add(1)
	}
	return "", nil, nil
}

// probe returns the heartbeat to send to peer when the interval has passed
// since the last one (nil otherwise); called by the decode loop for every
// peer it waits on.
func (mb *mailbox) probe(peer string, boot uint64, every time.Duration) *pdproto.Heartbeat {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	p := mb.peers[peer]
	if p == nil {
		p = &peerState{}
		mb.peers[peer] = p
	}
	now := time.Now()
	if now.Sub(p.probedAt) < every {
		return nil
	}
	if now.Sub(p.probedAt) > 2*every {
		// Nobody probed the peer for a while (no room waited on it): an
		// old unanswered probe says nothing of it now.
		p.unanswered = time.Time{}
	}
	p.probe++
	p.probedAt = now
	if p.unanswered.IsZero() {
		p.unanswered = now
	}
	return &pdproto.Heartbeat{Sender: mb.self.Sender, Boot: boot, Seq: p.probe, UnixNano: now.UnixNano()}
}

// liveness reports a prefill rank's liveness: how long its oldest
// unanswered probe has waited, and its boot number (0 before its first
// reply).
func (mb *mailbox) liveness(endpoint string) rooms.Liveness {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	p := mb.peers[endpoint]
	if p == nil {
		return rooms.Liveness{}
	}
	l := rooms.Liveness{Boot: p.boot}
	if !p.unanswered.IsZero() {
		l.Silent = time.Since(p.unanswered)
	}
	return l
}

// take returns the room's mail and empties it, leaving the room's entry
// in place (a second TRANSFER_INFO stays refused).
func (mb *mailbox) take(room uint64) rooms.Mail {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	x := mb.rooms[room]
	if x == nil {
		return rooms.Mail{}
	}
	out := x.Mail
	x.Mail, x.kvBytes = rooms.Mail{}, 0
	return out
}

// admit makes room one the loop has: its mail is kept for it.
func (mb *mailbox) admit(room uint64) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	if x := mb.rooms[room]; x != nil && !mb.known[room] {
		mb.dropEarly(x)
	}
	mb.known[room] = true
	delete(mb.ended, room) // a new request for the room; the FIFO entry expires on its own
}

// forget drops a room the loop no longer has, with its mail; on a prefill
// a room that failed (why set) is remembered, so that a decode still
// asking about it hears why. An ABORT the loop never took up (it came
// after the room's last filing) is answered now, as for any room the loop
// does not have: the ack and where it goes are returned for the loop to
// send.
func (mb *mailbox) forget(room uint64, why string) (to string, ack *pdproto.AbortAck) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	if x := mb.rooms[room]; x != nil && x.Abort != nil && mb.prefill {
		to, ack = x.Abort.Endpoint, &pdproto.AbortAck{Room: room, Rank: mb.rank, Known: true}
	}
	if x := mb.rooms[room]; x != nil && !mb.known[room] {
		mb.dropEarly(x)
	}
	delete(mb.known, room)
	delete(mb.rooms, room)
	if mb.prefill && why != "" {
		if _, ok := mb.ended[room]; !ok {
			mb.endedOrder = append(mb.endedOrder, room)
		}
		mb.ended[room] = why
		for len(mb.endedOrder) > maxUnknownRooms {
			delete(mb.ended, mb.endedOrder[0])
			mb.endedOrder = mb.endedOrder[1:]
		}
	}
	return to, ack
}

// expire forgets mail for rooms the loop never took up.
func (mb *mailbox) expire(older time.Time) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	for room, x := range mb.rooms {
		if !mb.known[room] && x.at.Before(older) {
			delete(mb.rooms, room)
			mb.dropEarly(x)
			mb.late.Add(1)
		}
	}
}
