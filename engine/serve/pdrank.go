package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
)

// One rank's PD machinery as the engine builds and reads it: its sockets
// and their sends, its mailbox and machine, the queues it publishes for
// readers, and the queries the loop asks of its rooms. What it does with
// the machine's actions is the executor's (pdexec.go).

// rankPD is one rank's PD machinery.
type rankPD struct {
	rank   int
	host   pdHost // what it tells, and asks of, the engine around the ranks
	inbox  *zmqlink.Inbox
	outbox *zmqlink.Outbox
	// endpoint is the inbox's endpoint as peers dial it (advertised), its
	// host the advertise host; inbox.Endpoint() is where it is bound.
	endpoint string
	mb       *pdMailbox
	machine  *rooms.Machine
	reqs     map[uint64]*pdReq         // what the executor keeps per room
	snap     atomic.Pointer[[]PDEntry] // published after every iteration
	boot     uint64                    // this server's boot number, in heartbeats
	cfg      *PDConfig
	bytes    atomic.Uint64 // KV payload bytes this rank sent or applied
	// replies sends what the rank owes to endpoints that others named,
	// off the receive goroutine and the loop (pdlimits.go).
	replies *replies
	// mailSeen is the mailbox's filed count when noNewMail last looked
	// (the fault overlap-local-decision's rank-local signal).
	mailSeen uint64
}

// pdHost is what the executor tells the engine around the rank group, and
// asks of it: a few values and effects, bound once by newRankPD, so that
// the executor holds no engine. The last four are rank 0's alone.
type pdHost struct {
	logger     *slog.Logger
	name, role string
	layers     int
	pageSize   int
	observer   PDObserver       // nil when the engine's observer is none
	indexK     func() string    // the index-K precision a TRANSFER_INFO names now
	now        func() time.Time // the engine's clock (Config.Clock)
	// resolved is a decode's lookup of a prefill's registry (pdlookup.go),
	// forgetResolution drops it: a restarted prefill has new endpoints.
	resolved         func(url string) ([]pdproto.RankInfo, error, bool)
	forgetResolution func(url string)
	failed           func(rooms.Phase, rooms.Kind) // counts a PD failure
	served           func(id uint64, at time.Time) // the request's queue wait ends
	moved            func(bytes int)               // KV payload bytes, for the metrics
	freeRoom         func(room, id uint64)         // the room may serve a new request
	holdRoom         func(id uint64)               // the stream ends, its room stays taken
}

// pdReq is what the executor keeps of one room: the request as it arrived
// and, on a decode, the destination slots it reserved.
type pdReq struct {
	add    addMsg
	slots  []int32
	prompt pdproto.Fingerprint // what each TRANSFER_INFO and KV chunk of the room says of its prompt
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
	// DeadlineIn is how long the entry may stay in its queue from the
	// rank's last iteration on: a fixed timeout, or the lease its peer's
	// word renews (Leased); negative once past it. HasDeadline is false
	// when nothing but the peer's liveness bounds it (no request timeout).
	DeadlineIn  time.Duration
	HasDeadline bool
	Leased      bool
	// Position is the room's place in the decode's queue of rooms waiting
	// for memory (on a prefill: as the decode last said in QUEUED).
	Position int
}

// newRankPD binds the rank's socket: control on a prefill rank, KV on a
// decode rank. The KV path (a prefill rank's Outbox, a decode rank's
// Inbox) uses zmqlink's zero-copy backend; the control path (a prefill
// rank's Inbox, a decode rank's Outbox) uses pebbe/zmq4.
// It listens on endpoint when given (a rebuild keeps each rank's), and
// sends boot in its heartbeats.
func newRankPD(e *Engine, rank int, boot uint64, endpoint string) (*rankPD, error) {
	machine, err := rooms.New(e.machineConfig(rank))
	if err != nil {
		return nil, err
	}
	prefill := e.cfg.Role == pdproto.RolePrefill
	pd := &rankPD{rank: rank, host: pdHostOf(e), mb: newMailbox(e.mailboxConfig(rank, boot), e.inbox.poke, &e.faults), machine: machine,
		reqs: map[uint64]*pdReq{}, boot: boot, cfg: &e.cfg.PD}
	outOpts := zmqlink.SocketOptions{ZeroCopy: prefill}
	e.cfg.PD.socketAuth(&outOpts, prefill, false)
	out, err := zmqlink.NewOutbox(&zmqlink.OutboxOptions{SocketOptions: outOpts,
		MaxPeers: e.cfg.PD.MaxPeerSockets, PeerIdle: e.cfg.PD.PeerSocketIdle})
	if err != nil {
		return nil, err
	}
	pd.outbox = out
	pd.replies = newReplies(out, e.cfg.PD.ReplyQueue, e.cfg.PD.SendTimeout, func(to string, m pdproto.Message, err error) {
		e.cfg.Logger.Debug("pd: reply not sent", "server", e.cfg.Name, "rank", rank, "to", to, "type", fmt.Sprint(m.Type()), "err", err)
	})
	pd.mb.reply = pd.replies.post
	pd.mb.now = e.now
	if endpoint == "" {
		endpoint = "tcp://" + net.JoinHostPort(e.cfg.PD.Host, "0")
	}
	inOpts := zmqlink.SocketOptions{ZeroCopy: !prefill}
	e.cfg.PD.socketAuth(&inOpts, prefill, true)
	in, err := zmqlink.Listen(endpoint, pd.mb.handle, &zmqlink.InboxOptions{SocketOptions: inOpts,
		MaxMsgSize: e.maxMessageBytes(), HandshakeTimeout: e.cfg.PD.HandshakeTimeout, MaxConnections: e.cfg.PD.MaxConnections})
	if err != nil {
		pd.replies.stop()
		out.Close()
		return nil, err
	}
	pd.inbox = in
	if pd.endpoint, err = advertisedEndpoint(in.Endpoint(), e.cfg.PD.advertiseHost()); err != nil {
		pd.close()
		return nil, err
	}
	pd.mb.setSender(pd.endpoint)
	return pd, nil
}

// pdHostOf binds what a rank's executor needs of e.
func pdHostOf(e *Engine) pdHost {
	o, _ := e.cfg.Observer.(PDObserver)
	return pdHost{logger: e.cfg.Logger, name: e.cfg.Name, role: e.cfg.Role, layers: e.m.Config.Layers, pageSize: e.cfg.PageSize,
		observer: o, indexK: e.view.indexKName, now: e.now, resolved: e.pd.resolved, forgetResolution: e.pd.reg.forget,
		failed: e.pd.failed, served: e.streams.observeServed, moved: e.pd.moved,
		freeRoom: func(room, id uint64) { e.pd.rooms.CompareAndDelete(room, id) },
		holdRoom: func(id uint64) {
			if r := e.streams.front[id]; r != nil {
				r.roomHeld = true
			}
		}}
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

// close closes the socket, then stops the replies (the receive goroutine
// posts them), then the Outbox.
func (pd *rankPD) close() error {
	err := pd.inbox.Close()
	pd.replies.stop()
	return errors.Join(err, pd.outbox.Close())
}

// rooms is the number of PD rooms the ranks hold (the same on every
// rank); none on a colocated rank.
func (pd *rankPD) rooms() int {
	if pd == nil {
		return 0
	}
	return pd.machine.Len()
}

// handshaking counts the PD rooms still in the handshake, which an
// index-K switch does not wait for.
func (pd *rankPD) handshaking() int {
	if pd == nil {
		return 0
	}
	return pd.machine.Handshaking()
}

// inHandshake reports whether request id is a PD room still in the
// handshake.
func (pd *rankPD) inHandshake(id uint64) bool {
	return pd != nil && pd.machine.InHandshake(id)
}

// finishing reports whether request id is a PD room that waits only for
// its peer's word or its deadline.
func (pd *rankPD) finishing(id uint64) bool {
	return pd != nil && pd.machine.Finishing(id)
}

// publish stores the rank's PD queues for readers, as of now.
func (pd *rankPD) publish(now time.Duration) {
	if pd == nil {
		return
	}
	es := pd.machine.Entries()
	out := make([]PDEntry, len(es))
	for i, en := range es {
		out[i] = PDEntry{ID: en.ID, Room: en.Room, Queue: en.Phase.String(), InQueue: now - en.Since, Peer: en.Peer,
			Tokens: en.PromptLen, Chunks: en.Chunks, Bytes: en.Bytes, AbortSent: en.AbortSent, Acked: en.Acked,
			Poll: en.Vote, Agreed: en.Agreed, Error: en.Reason.Text, Leased: en.Leased, Position: en.Position}
		if en.Deadline != rooms.NoDeadline {
			out[i].DeadlineIn, out[i].HasDeadline = en.Deadline-now, true
		}
	}
	pd.snap.Store(&out)
}

// releaseRooms frees the bootstrap rooms of every request rank 0's
// machine still holds, whose Forget will never come: the rank group is
// being given up.
func (pd *rankPD) releaseRooms() {
	for _, en := range pd.machine.Entries() {
		pd.host.freeRoom(en.Room, en.ID)
	}
}

// localIdle is the fault overlap-local-decision's branch (overlap.go),
// taken by the rank when the switch is on: whether the mailbox filed no
// message under a room since the rank last asked, the rank-local view that
// nothing else may branch on before a collective. step is the iteration,
// for the log line that says so.
func (pd *rankPD) localIdle(step uint64) bool {
	n := pd.mb.filed.Load()
	idle := n == pd.mailSeen
	pd.mailSeen = n
	if idle {
		pd.host.logger.Warn("fault overlap-local-decision: rank takes the idle branch on its own mail while its peers poll",
			"server", pd.host.name, "role", pd.host.role, "rank", pd.rank, "step", step, "mail_filed", n)
	}
	return idle
}
