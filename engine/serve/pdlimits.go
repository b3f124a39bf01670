package serve

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/kernels"
)

// The PD plane's bounds (docs/protocol.md, "Limits"): the largest frame a
// rank's socket accepts, the peer sockets its Outbox keeps, the replies it
// owes and the rooms one sender may hold in its mailbox before their
// requests arrive. Every message comes from another process, and a
// hostile one may send anything: each bound is counted when hit.

// Defaults of the PDConfig limits.
const (
	DefaultReplyQueue          = 1024
	DefaultEarlyRoomsPerSender = maxUnknownRooms / 8
)

// messageHeadroom is what a socket's frame bound allows past the largest
// legal payload: a message's fixed fields, strings and per-layer lengths.
const messageHeadroom = 64 << 10

// maxMessageBytes is the largest frame the rank's socket accepts
// (ZMQ_MAXMSGSIZE): PDConfig.MaxMessageBytes when set, else derived from
// the model's shapes. A decode's KV socket takes a KV_CHUNK, whose largest
// frame is one layer's K or V rows (or index-K rows) of the chunk's tokens,
// and a chunk covers at most a context of them (the prefill's chunk size
// is its own); a prefill's control socket takes TRANSFER_INFO at most,
// whose page list covers a context.
func (e *Engine) maxMessageBytes() int64 {
	if n := e.cfg.PD.MaxMessageBytes; n > 0 {
		return n
	}
	c := &e.m.Config
	tokens := int64(c.ContextLen)
	if e.cfg.Role == pdproto.RolePrefill {
		pages := (tokens + int64(e.cfg.PageSize) - 1) / int64(e.cfg.PageSize)
		return 4*pages + messageHeadroom
	}
	row := int64(c.RankKVDim(e.cfg.TP)) * int64(kernels.KVElemBytes(e.cfg.KVType)) // K or V (or latent) as the pool stores them
	if ix := c.Indexer; ix != nil {
		row = max(row, int64(ix.Dim)*2) // bf16 index-K; fp8 is smaller
	}
	return tokens*row + messageHeadroom
}

// replies carries the messages a rank sends to endpoints other processes
// named and that nothing waits on (ABORT_ACK, heartbeat probes and their
// replies, STATUS for a room the prefill forgot) on its own goroutine, so
// that neither the receive goroutine nor the loop ever waits on a peer. A
// message that finds the queue full, or its peer with a full backlog in
// the Outbox (zmqlink.Outbox.Offer), is dropped and counted: its sender
// times out or probes again, as for a lost message. Heartbeats have a lane
// of their own, served first: a flood of ABORTs naming new endpoints,
// each acknowledged, must not hold a prefill's heartbeat replies past its
// decodes' heartbeat timeout, which would fail every room with them.
type replies struct {
	out     *zmqlink.Outbox
	timeout time.Duration // for room in the Outbox's queue, never for a peer
	queue   chan reply
	beats   chan reply // heartbeat probes and replies
	dropped atomic.Uint64
	closing chan struct{}
	done    chan struct{}
	stopped sync.Once
	warn    func(to string, m pdproto.Message, err error)
}

type reply struct {
	to string
	m  pdproto.Message
}

func newReplies(out *zmqlink.Outbox, size int, timeout time.Duration, warn func(string, pdproto.Message, error)) *replies {
	r := &replies{out: out, timeout: timeout, queue: make(chan reply, size), beats: make(chan reply, heartbeatLane), closing: make(chan struct{}),
		done: make(chan struct{}), warn: warn}
	go r.run()
	return r
}

// heartbeatLane bounds the heartbeats waiting to be sent: a rank probes
// and answers a few peers a few times a second.
const heartbeatLane = 256

// post queues m for to without waiting; a full queue drops it, counted.
func (r *replies) post(to string, m pdproto.Message) {
	q := r.queue
	if _, ok := m.(*pdproto.Heartbeat); ok {
		q = r.beats
	}
	select {
	case q <- reply{to: to, m: m}:
	default:
		r.dropped.Add(1)
	}
}

func (r *replies) run() {
	defer close(r.done)
	for {
		rp, ok := r.next()
		if !ok {
			return
		}
		r.send(rp)
	}
}

// next waits for the next message to send, a heartbeat first; false once
// stop was called.
func (r *replies) next() (reply, bool) {
	select {
	case rp := <-r.beats:
		return rp, true
	default:
	}
	select {
	case rp := <-r.beats:
		return rp, true
	case rp := <-r.queue:
		return rp, true
	case <-r.closing:
		return reply{}, false
	}
}

func (r *replies) send(rp reply) {
	frames, err := pdproto.Encode(rp.m)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
		err = r.out.Offer(ctx, rp.to, frames)
		cancel()
	}
	if err != nil {
		r.dropped.Add(1)
		r.warn(rp.to, rp.m, err)
	}
}

// stop ends the goroutine; what is still queued is dropped. The Outbox
// closes after it. Calling it again does nothing, as closing a socket
// twice does nothing.
func (r *replies) stop() {
	r.stopped.Do(func() { close(r.closing) })
	<-r.done
}
