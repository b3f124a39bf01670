package mailbox

import (
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
)

// Machine is one rank's mailbox. It is not safe for concurrent use: its
// caller serializes the receive side and the loop.
type Machine struct {
	cfg     Config
	prefill bool
	bound   int // MaxUnknownRooms; smaller in tests that reach it often
	rooms   map[uint64]*box
	known   map[uint64]bool // rooms the loop has
	// expect is the prefill rank each of a decode's known rooms takes
	// its KV from, once the room resolved (Expect): mail for the room is
	// a word from that peer.
	expect map[uint64]string
	peers  map[string]*peer
	// ended remembers why a prefill's recent rooms failed, oldest first
	// out of endedOrder past the bound. admit deletes a room from ended
	// only: its entry in endedOrder expires on its own.
	ended      map[uint64]endedRoom
	endedOrder []uint64
	early      int            // rooms with mail that the loop does not have
	earlyFrom  map[string]int // the early rooms by sender, which PerSender bounds
}

// box is one room's mail waiting for the loop.
type box struct {
	at       time.Time // its first filing
	infoSeen bool      // a TRANSFER_INFO was filed: a second one is refused
	from     string    // the sender of its first mail, while the room is early
	kvBytes  int64     // the KV payload of the chunks filed and not yet taken
	rooms.Mail
}

// peer is a decode rank's view of one prefill rank's liveness.
type peer struct {
	probe      uint64    // last probe sequence number sent
	probedAt   time.Time // when that probe went out
	unanswered time.Time // the first probe not answered since the peer's last word; zero when none
	boot       uint64    // the peer's boot number from its last reply
	heard      time.Time // the peer's last word: a reply, or mail for a room expected from it
	lost       uint64    // rooms failed for its silence (Lost)
	lostAt     time.Time // the last of them
	lostBoot   uint64    // its boot number then: a later reply overwrites boot
}

// New returns an empty mailbox.
func New(cfg Config) (*Machine, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Machine{cfg: cfg, prefill: cfg.Role == rooms.Prefill, bound: MaxUnknownRooms, rooms: map[uint64]*box{},
		known: map[uint64]bool{}, expect: map[uint64]string{}, peers: map[string]*peer{}, ended: map[uint64]endedRoom{}, earlyFrom: map[string]int{}}, nil
}

// SetSender sets the endpoint the rank's heartbeats name: its advertised
// endpoint is known only once its socket listens.
func (m *Machine) SetSender(endpoint string) { m.cfg.Sender = endpoint }

// File decides what becomes of a message the rank received at now: filed
// under its room, answered, or dropped. A filed KV_CHUNK is kept as given:
// a caller whose frames are only lent copies the payload out before the
// loop can take it.
func (m *Machine) File(now time.Time, msg pdproto.Message) Decision {
	if hb, ok := msg.(*pdproto.Heartbeat); ok {
		return m.heartbeat(now, hb)
	}
	room, _ := pdproto.RoomOf(msg)
	if e, ok := m.ended[room]; ok && !m.known[room] {
		return m.endedAnswer(room, e, msg)
	}
	if !m.known[room] && (!m.prefill || (m.rooms[room] == nil && m.early >= m.bound)) {
		// A decode has every room it expects mail for; a prefill may
		// hear from a decode before the router's request arrives,
		// within the table's bound.
		return Decision{Drop: Late}
	}
	if !m.placed(msg) {
		return Decision{Drop: Misplaced}
	}
	x := m.rooms[room]
	if x == nil {
		from := senderOf(msg)
		if !m.known[room] && m.cfg.PerSender > 0 && m.earlyFrom[from] >= m.cfg.PerSender {
			return Decision{Drop: OverQuota}
		}
		x = &box{at: now}
		m.rooms[room] = x
		if !m.known[room] {
			m.addEarly(x, from)
		}
	}
	var d Decision
	switch msg := msg.(type) {
	case *pdproto.TransferInfo:
		if x.infoSeen {
			return Decision{Drop: Misplaced}
		}
		x.Info, x.infoSeen = msg, true
	case *pdproto.Abort:
		if !m.known[room] {
			// The loop does not have the room: nothing is written for
			// it, so the ack goes now. The ABORT stays filed: a request
			// for the room that arrives later fails on it.
			d.To, d.Answer = msg.Endpoint, &pdproto.AbortAck{Room: room, Rank: uint32(m.cfg.Rank)}
		}
		x.Abort = msg
	case *pdproto.KVChunk:
		n := int64(msg.PayloadBytes())
		if m.cfg.RoomBytes > 0 && x.kvBytes+n > m.cfg.RoomBytes {
			return Decision{Drop: OverQuota} // the room then fails on the missing chunk
		}
		x.kvBytes += n
		x.Chunks = append(x.Chunks, msg)
	case *pdproto.Status:
		x.Status = msg
	case *pdproto.AbortAck:
		x.Acked = true
	case *pdproto.Queued:
		x.Queued = msg
	}
	d.Filed, d.Wake = true, true
	if from, ok := m.expect[room]; ok {
		m.word(now, from)
	}
	return d
}

// word records a word from a prefill peer at now: its reply to a probe,
// or mail for a room it serves. Either ends its silence: a peer whose KV
// still streams in is alive, however long its replies wait behind that KV
// on a slow link (busy is not dead).
func (m *Machine) word(now time.Time, endpoint string) *peer {
	p := m.peers[endpoint]
	if p != nil {
		p.unanswered, p.heard = time.Time{}, now
	}
	return p
}

// Expect records that a decode's known room takes its KV from the prefill
// rank at endpoint: the room's mail then counts as a word from that peer.
// A room the loop does not have, or a prefill's, is ignored.
func (m *Machine) Expect(room uint64, endpoint string) {
	if !m.prefill && m.known[room] && endpoint != "" {
		m.expect[room] = endpoint
	}
}

// senderOf is who msg says sent it: the endpoint it names for answers (""
// for a message that names none).
func senderOf(msg pdproto.Message) string {
	switch msg := msg.(type) {
	case *pdproto.TransferInfo:
		return msg.Endpoint
	case *pdproto.Queued:
		return msg.Endpoint
	case *pdproto.Abort:
		return msg.Endpoint
	}
	return ""
}

// addEarly counts x, a room the loop does not have, against from's quota.
func (m *Machine) addEarly(x *box, from string) {
	m.early++
	x.from = from
	m.earlyFrom[from]++
}

// dropEarly uncounts x, an early room that the loop took up or that went.
func (m *Machine) dropEarly(x *box) {
	m.early--
	if m.earlyFrom[x.from]--; m.earlyFrom[x.from] <= 0 {
		delete(m.earlyFrom, x.from)
	}
}

// endedRoom is why a prefill room failed, and whether it was an abort
// someone asked for, which the STATUS Failed it answers with says.
type endedRoom struct {
	why   string
	asked bool
}

// endedAnswer answers mail about a room this prefill failed and forgot:
// TRANSFER_INFO and QUEUED get STATUS Failed with the reason, an ABORT its
// ack; anything else is late.
func (m *Machine) endedAnswer(room uint64, e endedRoom, msg pdproto.Message) Decision {
	failed := &pdproto.Status{Room: room, Rank: uint32(m.cfg.Rank), State: pdproto.Failed, Error: "the prefill ended the room: " + e.why, Asked: e.asked}
	switch msg := msg.(type) {
	case *pdproto.TransferInfo:
		return Decision{To: msg.Endpoint, Answer: failed}
	case *pdproto.Queued:
		return Decision{To: msg.Endpoint, Answer: failed}
	case *pdproto.Abort:
		return Decision{To: msg.Endpoint, Answer: &pdproto.AbortAck{Room: room, Rank: uint32(m.cfg.Rank)}}
	}
	return Decision{Drop: Late}
}

// placed reports whether the rank's role ever receives a message of msg's
// type: a prefill takes TRANSFER_INFO, QUEUED, ABORT and STATUS; a decode
// KV_CHUNK, STATUS and ABORT_ACK.
func (m *Machine) placed(msg pdproto.Message) bool {
	switch msg.(type) {
	case *pdproto.TransferInfo, *pdproto.Abort, *pdproto.Queued:
		return m.prefill
	case *pdproto.KVChunk, *pdproto.AbortAck:
		return !m.prefill
	}
	return true
}

// heartbeat answers a probe (prefill) or records a reply (decode).
func (m *Machine) heartbeat(now time.Time, hb *pdproto.Heartbeat) Decision {
	switch {
	case m.prefill && !hb.Reply:
		r := &pdproto.Heartbeat{Sender: m.cfg.Sender, Boot: m.cfg.Boot, Seq: hb.Seq, UnixNano: now.UnixNano(), Reply: true}
		return Decision{To: hb.Sender, Answer: r}
	case !m.prefill && hb.Reply:
		p := m.word(now, hb.Sender)
		if p == nil {
			return Decision{Drop: Late}
		}
		p.boot = hb.Boot
		return Decision{Wake: true}
	}
	return Decision{Drop: Misplaced}
}

// Probe returns the heartbeat to send to peer at now when the interval
// has passed since the last one (nil otherwise); the decode loop calls it
// for every peer it waits on. boot is the decode's boot number.
func (m *Machine) Probe(now time.Time, endpoint string, boot uint64, every time.Duration) *pdproto.Heartbeat {
	p := m.peers[endpoint]
	if p == nil {
		p = &peer{}
		m.peers[endpoint] = p
	}
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
	return &pdproto.Heartbeat{Sender: m.cfg.Sender, Boot: boot, Seq: p.probe, UnixNano: now.UnixNano()}
}

// Liveness reports a prefill rank's liveness at now: how long its oldest
// unanswered probe has waited, and its boot number (0 before its first
// reply).
func (m *Machine) Liveness(now time.Time, endpoint string) rooms.Liveness {
	p := m.peers[endpoint]
	if p == nil {
		return rooms.Liveness{}
	}
	l := rooms.Liveness{Boot: p.boot}
	if !p.unanswered.IsZero() {
		l.Silent = now.Sub(p.unanswered)
	}
	return l
}

// Lost records at now that a room failed because the prefill rank at
// endpoint stayed silent past the heartbeat timeout: the peer table then
// says when the peer was last lost, for an operator to tell a partition
// (the peer is up, its boot unchanged) from a restart.
func (m *Machine) Lost(now time.Time, endpoint string) {
	if p := m.peers[endpoint]; p != nil {
		p.lost++
		p.lostAt, p.lostBoot = now, p.boot
	}
}

// ForgetPeers drops the peers neither probed nor lost since older, that
// no room expects: prefills that left, or restarted on new endpoints, do
// not grow the table for ever.
func (m *Machine) ForgetPeers(older time.Time) {
	expected := map[string]bool{}
	for _, e := range m.expect {
		expected[e] = true
	}
	for e, p := range m.peers {
		if !expected[e] && p.probedAt.Before(older) && p.lostAt.Before(older) && p.heard.Before(older) {
			delete(m.peers, e)
		}
	}
}

// PendingKV is the KV payload filed for the loop and not yet taken, all
// rooms together: KV that reached the rank but that its loop has not
// applied (a busy or stalled loop), not KV still on the wire.
func (m *Machine) PendingKV() int64 {
	var n int64
	for _, x := range m.rooms {
		n += x.kvBytes
	}
	return n
}

// PeerState is what a decode rank knows of one prefill rank it probed.
type PeerState struct {
	Endpoint string
	Boot     uint64    // from its last reply; 0 before the first
	Heard    time.Time // its last word; zero before the first
	Probed   time.Time // the last probe sent
	Silent   time.Duration
	Lost     uint64    // rooms failed for its silence
	LostAt   time.Time // the last of them; zero when none
	// LostBoot is the peer's boot number as last heard before that loss:
	// a restart on the same endpoint answers with another one later.
	LostBoot uint64
}

// Peers returns the peer table at now, by endpoint.
func (m *Machine) Peers(now time.Time) []PeerState {
	out := make([]PeerState, 0, len(m.peers))
	for e, p := range m.peers {
		st := PeerState{Endpoint: e, Boot: p.boot, Heard: p.heard, Probed: p.probedAt, Lost: p.lost, LostAt: p.lostAt, LostBoot: p.lostBoot}
		if !p.unanswered.IsZero() {
			st.Silent = now.Sub(p.unanswered)
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b PeerState) int { return strings.Compare(a.Endpoint, b.Endpoint) })
	return out
}

// Take returns the room's mail and empties it, leaving the room's entry
// in place (a second TRANSFER_INFO stays refused).
func (m *Machine) Take(room uint64) rooms.Mail {
	x := m.rooms[room]
	if x == nil {
		return rooms.Mail{}
	}
	out := x.Mail
	x.Mail, x.kvBytes = rooms.Mail{}, 0
	return out
}

// Admit makes room one the loop has: its early mail is kept for it, and
// it no longer counts against the bounds of early rooms.
func (m *Machine) Admit(room uint64) {
	if x := m.rooms[room]; x != nil && !m.known[room] {
		m.dropEarly(x)
	}
	m.known[room] = true
	delete(m.ended, room) // a new request for the room; the FIFO entry expires on its own
}

// Forget drops a room the loop no longer has, with its mail; on a prefill
// a room that failed (why set) is remembered, so that a decode still
// asking about it hears why. An ABORT the loop never took up (it came
// after the room's last taking) is answered now, as for any room the loop
// does not have, but known: the ack and where it goes are returned for the
// caller to send.
func (m *Machine) Forget(room uint64, why string, asked bool) (to string, ack *pdproto.AbortAck) {
	x := m.rooms[room]
	if x != nil && x.Abort != nil && m.prefill {
		to, ack = x.Abort.Endpoint, &pdproto.AbortAck{Room: room, Rank: uint32(m.cfg.Rank), Known: true}
	}
	if x != nil && !m.known[room] {
		m.dropEarly(x)
	}
	delete(m.known, room)
	delete(m.expect, room)
	delete(m.rooms, room)
	if m.prefill && why != "" {
		if _, ok := m.ended[room]; !ok {
			m.endedOrder = append(m.endedOrder, room)
		}
		m.ended[room] = endedRoom{why: why, asked: asked}
		for len(m.endedOrder) > m.bound {
			delete(m.ended, m.endedOrder[0])
			m.endedOrder = m.endedOrder[1:]
		}
	}
	return to, ack
}

// Expire forgets the mail of rooms the loop never took up that was first
// filed before older, and returns how many rooms went: late mail.
func (m *Machine) Expire(older time.Time) int {
	n := 0
	for room, x := range m.rooms {
		if !m.known[room] && x.at.Before(older) {
			delete(m.rooms, room)
			m.dropEarly(x)
			n++
		}
	}
	return n
}
