package serve

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/mailbox"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
)

// pdMailbox is what a rank's socket received, per room, for its loop: the
// one structure of the PD path that two goroutines share. What becomes of
// each message is the machine's decision (engine/pd/mailbox); this wrapper
// does what a machine must not: the lock (the receive goroutine files, the
// loop takes), the clock, the counters the debug API reads, the fault
// switches, waking the loops, copying a chunk out of the frames zmqlink
// lends, and posting the answers once mu is released, to the rank's reply
// queue (pdlimits.go), which never waits: a slow or dead peer holds
// neither the lock nor the receive goroutine.
type pdMailbox struct {
	mu      sync.Mutex
	m       *mailbox.Machine // guarded by mu
	late    atomic.Uint64    // messages for rooms nobody has, dropped
	faulted atomic.Uint64    // messages a drop-* fault switch dropped
	bad     atomic.Uint64    // messages that made no sense here, dropped
	// filed counts the messages filed under a room for the loop: the
	// rank-local signal the fault overlap-local-decision branches on.
	filed     atomic.Uint64
	overQuota atomic.Uint64 // messages past a quota, dropped: a new room past its sender's, a room's chunks past its bound
	prefill   bool
	wake      func()    // tells the loops that mail arrived
	faults    *faultSet // the engine's fault switches
	reply     func(endpoint string, m pdproto.Message)
	// now is the time the machine files, probes and judges liveness at:
	// the engine's clock once the rank sets it (newRankPD), the wall
	// clock for a mailbox on its own.
	now func() time.Time
	// forgotAt is when forgetPeers last walked the peer table (guarded by
	// mu).
	forgotAt time.Time
}

// maxUnknownRooms bounds the rooms a prefill keeps mail for before their
// request arrived, and the failed rooms it remembers.
const maxUnknownRooms = mailbox.MaxUnknownRooms

// mailboxConfig is rank's mailbox configuration; boot goes in its
// heartbeats, and its endpoint once the socket listens (setSender).
func (e *Engine) mailboxConfig(rank int, boot uint64) mailbox.Config {
	c := mailbox.Config{Role: rooms.Prefill, Rank: rank, PerSender: e.cfg.PD.EarlyRoomsPerSender, Boot: boot}
	if e.cfg.Role != pdproto.RolePrefill {
		// Each layer's K, V, index-K and scales frame is within the
		// frame bound, which covers a whole context.
		c.Role, c.RoomBytes = rooms.Decode, 4*int64(e.m.Config.Layers)*e.maxMessageBytes()
	}
	return c
}

// newMailbox returns an empty mailbox; wake is called under its lock.
func newMailbox(cfg mailbox.Config, wake func(), faults *faultSet) *pdMailbox {
	m, err := mailbox.New(cfg)
	if err != nil {
		// The engine derives the configuration: an error is a bug.
		panic(err)
	}
	return &pdMailbox{m: m, prefill: cfg.Role == rooms.Prefill, wake: wake, faults: faults, now: time.Now}
}

// setSender sets the endpoint the rank's heartbeats name: its advertised
// endpoint, known once the socket listens.
func (mb *pdMailbox) setSender(endpoint string) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	mb.m.SetSender(endpoint)
}

// handle is the receive goroutine's handler: it files each message under
// its room. It never waits for the loop.
func (mb *pdMailbox) handle(frames [][]byte) error {
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

// file has the machine decide on m, counts the decision and wakes the
// loop; it returns the answer to send, if any, once mu is released.
func (mb *pdMailbox) file(m pdproto.Message) (to string, answer pdproto.Message, err error) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	d := mb.m.File(mb.now(), m)
	switch d.Drop {
	case mailbox.Late:
		mb.late.Add(1)
	case mailbox.Misplaced:
		mb.bad.Add(1)
	case mailbox.OverQuota:
		mb.overQuota.Add(1)
	}
	if c, ok := m.(*pdproto.KVChunk); ok && d.Filed {
		ownChunk(c) // before the loop can take it: the frames are lent
	}
	if d.Filed {
		mb.filed.Add(1)
	}
	if d.Wake {
		mb.wake()
	}
	return d.To, d.Answer, nil
}

// ownChunk copies a chunk's payload out of the frames zmqlink lends only
// until the handler returns, into one buffer, in place.
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

// probe returns the heartbeat to send to peer when the interval has passed
// since the last one (nil otherwise); called by the decode loop for every
// peer it waits on.
func (mb *pdMailbox) probe(peer string, boot uint64, every time.Duration) *pdproto.Heartbeat {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	return mb.m.Probe(mb.now(), peer, boot, every)
}

// liveness reports a prefill rank's liveness: how long its oldest
// unanswered probe has waited, and its boot number (0 before its first
// reply).
func (mb *pdMailbox) liveness(endpoint string) rooms.Liveness {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	return mb.m.Liveness(mb.now(), endpoint)
}

// expect records that a decode room takes its KV from the prefill rank at
// endpoint: its mail is then a word from that peer.
func (mb *pdMailbox) expect(room uint64, endpoint string) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	mb.m.Expect(room, endpoint)
}

// lost records that a room failed for endpoint's silence.
func (mb *pdMailbox) lost(endpoint string) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	mb.m.Lost(mb.now(), endpoint)
}

// peers is a decode rank's table of the prefill ranks it probed; nil on
// a prefill, which probes nobody.
func (mb *pdMailbox) peers() []mailbox.PeerState {
	if mb.prefill {
		return nil
	}
	mb.mu.Lock()
	defer mb.mu.Unlock()
	return mb.m.Peers(mb.now())
}

// peerMemory is how long a decode rank remembers a prefill peer that it
// no longer probes, hears or loses (and no room expects): well past the
// two minutes pdctl diagnose reads a loss for.
const peerMemory = 10 * time.Minute

// forgetPeers drops the peers not seen since peerMemory before now, at
// most once a minute: the loop calls it every iteration, and the walk is
// over every peer and room.
func (mb *pdMailbox) forgetPeers() {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	now := mb.now()
	if now.Sub(mb.forgotAt) < time.Minute {
		return
	}
	mb.forgotAt = now
	mb.m.ForgetPeers(now.Add(-peerMemory))
}

// pendingKV is the KV filed for the loop and not yet taken; 0 on a
// prefill.
func (mb *pdMailbox) pendingKV() int64 {
	if mb.prefill {
		return 0
	}
	mb.mu.Lock()
	defer mb.mu.Unlock()
	return mb.m.PendingKV()
}

// take returns the room's mail and empties it, leaving the room's entry
// in place (a second TRANSFER_INFO stays refused).
func (mb *pdMailbox) take(room uint64) rooms.Mail {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	return mb.m.Take(room)
}

// admit makes room one the loop has: its mail is kept for it.
func (mb *pdMailbox) admit(room uint64) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	mb.m.Admit(room)
}

// forget drops a room the loop no longer has, with its mail; a prefill
// remembers why a failed one failed (why set). An ABORT the loop never
// took up is answered now: the ack and where it goes are returned for the
// loop to send.
func (mb *pdMailbox) forget(room uint64, why string, asked bool) (to string, ack *pdproto.AbortAck) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	return mb.m.Forget(room, why, asked)
}

// expire forgets mail for rooms the loop never took up, first filed
// before older; they count as late.
func (mb *pdMailbox) expire(older time.Time) {
	mb.mu.Lock()
	defer mb.mu.Unlock()
	mb.late.Add(uint64(mb.m.Expire(older)))
}
