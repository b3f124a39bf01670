package serve

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/engine/sched"
)

// The PD roles' executor. The protocol itself, every move of every room, is
// engine/pd/rooms' machine; this file does its I/O: it files the socket's
// mail and the peers' liveness into the machine, hands its vote vector to
// the loop's poll, and carries out the actions it returns (reserve pages,
// write landed chunks, send messages, join the scheduler, end streams).
// A send that fails goes back into the machine as this rank's vote of
// Failed, so the next poll fails the room on every rank with the real
// cause.

// rankPD is one rank's PD machinery.
type rankPD struct {
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
	// joins are the prefill requests whose TRANSFER_INFO the ranks agreed
	// on in this iteration's poll: the iteration's admit adds them.
	joins []addMsg
	// replies sends what the rank owes to endpoints that others named,
	// off the receive goroutine and the loop (pdlimits.go).
	replies *replies
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
	pd := &rankPD{mb: newMailbox(e.mailboxConfig(rank, boot), e.inbox.poke, &e.faults), machine: machine, reqs: map[uint64]*pdReq{},
		boot: boot, cfg: &e.cfg.PD}
	out, err := zmqlink.NewOutbox(&zmqlink.OutboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: prefill, Auth: e.cfg.PD.zmqAuth()},
		MaxPeers: e.cfg.PD.MaxPeerSockets, PeerIdle: e.cfg.PD.PeerSocketIdle})
	if err != nil {
		return nil, err
	}
	pd.outbox = out
	pd.replies = newReplies(out, e.cfg.PD.ReplyQueue, e.cfg.PD.SendTimeout, func(to string, m pdproto.Message, err error) {
		e.cfg.Logger.Debug("pd: reply not sent", "server", e.cfg.Name, "rank", rank, "to", to, "type", fmt.Sprint(m.Type()), "err", err)
	})
	pd.mb.reply = pd.replies.post
	if endpoint == "" {
		endpoint = "tcp://" + net.JoinHostPort(e.cfg.PD.Host, "0")
	}
	in, err := zmqlink.Listen(endpoint, pd.mb.handle, &zmqlink.InboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: !prefill, Auth: e.cfg.PD.zmqAuth()},
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

// pdAdmit takes in a new PD request on this rank (an agreed event).
func (l *rankLoop) pdAdmit(a addMsg) error {
	fp := pdproto.PromptFingerprint(a.prompt)
	err := l.pd.machine.Admit(l.now, rooms.Request{ID: a.id, Room: a.room, PromptLen: len(a.prompt), MaxTokens: a.maxTokens, URL: a.url, Prompt: fp})
	if err != nil {
		// Submit checked the request (and refuses a room in use): an
		// error here is a broken invariant, the same on every rank.
		return fmt.Errorf("admit room %d: %w", a.room, err)
	}
	l.pd.reqs[a.id] = &pdReq{add: a, prompt: fp}
	l.pd.mb.admit(a.room)
	return nil
}

// pdObserve files what this rank alone knows into the machine before its
// vote: each room's mail, the registry lookups of the decode rooms that
// wait for one, and the liveness of the prefill peers (probing them).
func (l *rankLoop) pdObserve() error {
	pd := l.pd
	pd.mb.expire(time.Now().Add(-pd.cfg.BootstrapTimeout))
	for id := range pd.reqs { // filing only writes chunks, never ends a room
		if err := l.fileMail(id); err != nil {
			return err
		}
	}
	for _, r := range pd.machine.Resolving() {
		infos, err, done := l.e.pd.resolved(r.URL)
		switch {
		case !done:
		case err != nil:
			pd.machine.Resolve(r.ID, rooms.Resolution{Err: err})
		case l.r >= len(infos):
			pd.machine.Resolve(r.ID, rooms.Resolution{Err: fmt.Errorf("the prefill has %d ranks", len(infos))})
		default:
			pd.machine.Resolve(r.ID, rooms.Resolution{Endpoint: infos[l.r].Endpoint})
		}
	}
	for _, peer := range pd.machine.Peers() {
		if hb := pd.mb.probe(peer, pd.boot, pd.cfg.HeartbeatInterval); hb != nil {
			// A probe that cannot go out leaves the peer unanswered:
			// the heartbeat timeout then judges it. It never waits on
			// the peer: a dead one must not hold up the loop.
			pd.replies.post(peer, hb)
		}
		pd.machine.Peer(peer, pd.mb.liveness(peer))
	}
	return nil
}

// fileMail files request id's mail into the machine and writes the chunks
// it accepts.
func (l *rankLoop) fileMail(id uint64) error {
	q := l.pd.reqs[id]
	if q == nil {
		return nil
	}
	m := l.pd.mb.take(q.add.room)
	if m.Empty() {
		return nil
	}
	return l.pdExec(l.pd.machine.File(l.now, id, m))
}

// pdAbort aborts a PD request that is not in the scheduler (an agreed
// abort). It reports whether the machine had it.
func (l *rankLoop) pdAbort(id uint64, why string) (bool, error) {
	if l.pd == nil {
		return false, nil
	}
	// The room's latest mail first: a prefill tells a decode whose
	// TRANSFER_INFO just arrived.
	if err := l.fileMail(id); err != nil {
		return false, err
	}
	acts, handled := l.pd.machine.Abort(l.now, id, why)
	return handled, l.pdExec(acts)
}

// pdSchedFinished tells the machine of a prefill request the scheduler
// finished. It reports whether the machine owns the request's end (it
// waits for the decode's word, or ended it by the PD failure that cut it).
func (l *rankLoop) pdSchedFinished(f sched.Finish) (bool, error) {
	if l.pd == nil || !l.pd.machine.Has(f.ID) {
		return false, nil
	}
	produced := f.Reason == sched.ReasonStop || f.Reason == sched.ReasonLength
	acts, handled := l.pd.machine.SchedFinished(l.now, f.ID, produced, f.Reason.String())
	if !handled && (f.Reason == sched.ReasonTimeout || f.Reason == sched.ReasonError) && l.r == 0 {
		// The prefill's own scheduler ended it: a PD failure too, told
		// to the decode by the STATUS among acts.
		l.e.pd.failed(rooms.Active, rooms.KindScheduler)
		l.e.cfg.Logger.Warn("pd: request failed", "server", l.e.cfg.Name, "role", l.e.cfg.Role, "request", f.ID,
			"rank", l.r, "phase", rooms.Active.String(), "reason", rooms.KindScheduler.String(), "error", "prefill "+f.Reason.String())
	}
	return handled, l.pdExec(acts)
}

// pdExec carries out the machine's actions, in order.
func (l *rankLoop) pdExec(acts []rooms.Action) error {
	pd := l.pd
	for _, act := range acts {
		var err error
		switch a := act.(type) {
		case rooms.Reserve:
			err = l.reserve(a.ID, a.Tokens)
			if l.r == 0 {
				l.e.streams.observeServed(a.ID, time.Now())
			}
		case rooms.SendTransferInfo:
			l.sendChecked(a.ID, "transfer info", a.Peer, l.transferInfo(a))
		case rooms.SendChunk:
			l.sendChunk(a)
		case rooms.SendQueued:
			l.sendChecked(a.ID, "queued", a.Peer, &pdproto.Queued{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(l.r), Position: uint32(a.Position)})
		case rooms.ApplyChunk:
			if werr := l.applyChunk(a); werr != nil {
				pd.machine.Failed(a.ID, rooms.Reason{Kind: rooms.KindBadChunk, Text: werr.Error()}) // it can only be failing already otherwise
			}
		case rooms.SendStatus:
			l.sendChecked(a.ID, "status", a.Peer, &pdproto.Status{Room: a.Room, Rank: uint32(l.r), State: a.State, Error: a.Error})
		case rooms.SendAbort:
			l.sendChecked(a.ID, "abort", a.Peer, &pdproto.Abort{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(l.r), Reason: a.Reason})
		case rooms.SendAbortAck:
			pd.replies.post(a.To, &pdproto.AbortAck{Room: a.Room, Rank: uint32(l.r), Known: true}) // to an endpoint the ABORT named
		case rooms.Admit:
			pd.joins = append(pd.joins, pd.reqs[a.ID].add)
		case rooms.Cut:
			err = l.cut(a.ID, a.Reason.Text)
		case rooms.Arrived:
			err = l.arrived(a)
		case rooms.Release:
			err = l.releaseReserved(a.ID)
		case rooms.End:
			l.pdEnded(a)
		case rooms.Forget:
			delete(pd.reqs, a.ID)
			if l.r == 0 {
				l.e.pd.rooms.CompareAndDelete(a.Room, a.ID) // the room may serve a new request now
			}
			if to, ack := pd.mb.forget(a.Room, a.Why); ack != nil {
				pd.replies.post(to, ack)
			}
		default:
			err = fmt.Errorf("unknown PD action %T", act)
		}
		if err != nil {
			return fmt.Errorf("serve: rank %d: %s: %w", l.r, rooms.Format(act), err)
		}
	}
	return nil
}

// sendChecked sends m for request id; a failure is this rank's vote of
// Failed for the room, or, once the room is ending anyway, logged.
func (l *rankLoop) sendChecked(id uint64, what, to string, m pdproto.Message) {
	err := l.pd.send(to, m)
	if err == nil {
		return
	}
	if l.pd.machine.SendFailed(id, what, err) {
		return
	}
	// The room is gone or failing already: nothing left to vote; the
	// peer finds out by its own timeout or heartbeat.
	l.e.cfg.Logger.Warn("pd: peer not told", "server", l.e.cfg.Name, "rank", l.r, "request", id, "to", to, "message", what, "err", err)
}

// reserve starts the decode sequence of request id with room for its
// prompt: the machine granted pages every rank agreed are free.
func (l *rankLoop) reserve(id uint64, tokens int) error {
	pool := l.rk.Pool()
	if short := l.e.cfg.pagesFor(tokens) - pool.FreePages(); short > 0 && l.cache != nil {
		l.cache.Evict(short)
	}
	seq, err := pool.NewSeq(id)
	if err != nil {
		return err
	}
	if err := pool.Reserve(seq, tokens); err != nil {
		return errors.Join(err, pool.Release(seq))
	}
	l.pd.reqs[id].slots = slices.Clone(seq.Slots()[:tokens])
	return nil
}

// transferInfo is a decode room's TRANSFER_INFO: where its KV goes.
func (l *rankLoop) transferInfo(a rooms.SendTransferInfo) *pdproto.TransferInfo {
	q := l.pd.reqs[a.ID]
	info := &pdproto.TransferInfo{Room: a.Room, Endpoint: l.pd.endpoint, Rank: uint32(l.r),
		Tokens: uint32(len(q.slots)), Prompt: q.prompt, IndexKDType: l.e.view.indexKName(), RequestID: strconv.FormatUint(a.ID, 10)}
	pageSize := int32(l.e.cfg.PageSize)
	for i := 0; i < len(q.slots); i += int(pageSize) {
		info.Pages = append(info.Pages, uint32(q.slots[i]/pageSize))
	}
	return info
}

// applyChunk writes a landed chunk into the room's reserved slots.
func (l *rankLoop) applyChunk(a rooms.ApplyChunk) error {
	ch, q := a.Chunk, l.pd.reqs[a.ID]
	if len(ch.Layers) != l.e.m.Config.Layers {
		return fmt.Errorf("KV chunk %d has %d layers, the model %d", ch.Chunk, len(ch.Layers), l.e.m.Config.Layers)
	}
	pool := l.rk.Pool()
	slots := q.slots[ch.Start:ch.End]
	for layer, kv := range ch.Layers {
		if err := pool.PutKV(layer, slots, kv.K, kv.V); err != nil {
			return err
		}
		if err := pool.PutIndexK(layer, slots, kv.IndexK, kv.IndexKScales); err != nil {
			return err
		}
	}
	return nil
}

// sendChunk copies the KV of a prefill step's tokens out of the pool and
// sends it to the decode rank.
func (l *rankLoop) sendChunk(a rooms.SendChunk) {
	pool := l.rk.Pool()
	seq, ok := pool.Seq(a.ID)
	if !ok {
		l.pd.machine.Failed(a.ID, rooms.Reason{Kind: rooms.KindBadChunk, Text: "the sequence is gone"})
		return
	}
	slots := seq.Slots()[a.Start:a.End]
	ch := &pdproto.KVChunk{Room: a.Room, Chunk: uint32(a.Index), Start: uint32(a.Start), End: uint32(a.End), Prompt: l.pd.reqs[a.ID].prompt, Final: a.Final}
	for layer := range l.e.m.Config.Layers {
		var kv pdproto.LayerKV
		kv.K, kv.V = pool.AppendKV(layer, slots, nil, nil)
		kv.IndexK, kv.IndexKScales = pool.AppendIndexK(layer, slots, nil, nil)
		ch.Layers = append(ch.Layers, kv)
	}
	n := ch.PayloadBytes()
	l.pd.machine.Moved(a.ID, n)
	l.pd.bytes.Add(uint64(n))
	if l.r == 0 {
		l.e.pd.moved(n)
	}
	l.sendChecked(a.ID, "KV", a.Peer, ch)
}

// sendChunks plans, after a prefill step, the chunk of each PD request's
// new tokens; the chunk of an item that sampled carries the first token.
// toks maps the step's sampled tokens by request.
func (l *rankLoop) sendChunks(items []sched.Item, toks map[uint64]int32) error {
	if l.pd == nil || l.e.cfg.Role != pdproto.RolePrefill {
		return nil
	}
	for _, it := range items {
		q, s := l.pd.reqs[it.ID], l.seqs[it.ID]
		if q == nil || s == nil || s.cut {
			continue
		}
		var final *pdproto.ChunkFinal
		if tok, ok := toks[it.ID]; ok {
			final = &pdproto.ChunkFinal{FirstToken: tok, PromptTokens: uint32(len(q.add.prompt)), CachedTokens: uint32(it.Cached)}
		}
		if err := l.pdExec(l.pd.machine.Sent(it.ID, it.Start+it.Tokens, final)); err != nil {
			return err
		}
	}
	return nil
}

// arrivedHook, when a test sets it (before any engine starts), sees every
// decode rank's pool and the slots of a request's transferred prompt KV as
// it arrives, on the rank's loop.
var arrivedHook func(rank int, room uint64, pool *kvcache.Pool, slots []int32)

// arrived ends a decode request's transfer: the prompt's KV is committed
// and the request joins the scheduler with the prefill's first token.
func (l *rankLoop) arrived(a rooms.Arrived) error {
	pool := l.rk.Pool()
	q := l.pd.reqs[a.ID]
	seq, ok := pool.Seq(a.ID)
	if !ok {
		return fmt.Errorf("room %d lost its sequence", q.add.room)
	}
	if err := pool.Commit(seq, len(q.slots)); err != nil {
		return err
	}
	if h := arrivedHook; h != nil {
		h(l.r, q.add.room, pool, seq.Slots())
	}
	l.pd.bytes.Add(uint64(a.Bytes))
	if o, ok := l.e.cfg.Observer.(PDObserver); ok {
		o.KVTransferred(l.r, a.Bytes, a.Took)
	}
	add, tok := q.add, a.First.FirstToken
	if l.r == 0 {
		l.e.pd.moved(a.Bytes)
		l.e.streams.emitFirst(add.id, tok)
	}
	// The later samples (Request.N > 1) fork from this KV once the ranks
	// agreed on the room for them (pdForkAll); the sequence stays until
	// then even when this sample ends here.
	release := pool.Release
	if k := l.forks.Take(add.id); k > 0 {
		f := pdFork{add: add, n: k}
		l.pdForks = append(l.pdForks, &f)
		release = func(*kvcache.Seq) error { f.release = true; return nil }
	}
	stop := (!add.ignoreEOS && l.e.m.Tokenizer.IsEOG(tok)) || slices.Contains(add.stop, tok)
	if stop || add.maxTokens == 1 {
		reason := sched.ReasonLength
		if stop {
			reason = sched.ReasonStop
		}
		l.end(add.id, ending{reason: reason})
		return release(seq)
	}
	err := l.sched.Add(sched.Request{ID: add.id, PromptLen: len(add.prompt) + 1, MaxTokens: add.maxTokens - 1, Transferred: len(add.prompt)}, l.now)
	if err != nil {
		l.end(add.id, ending{reason: sched.ReasonError, err: err.Error()})
		return release(seq)
	}
	l.seqs[add.id] = &seqState{all: append(append(make([]int32, 0, len(add.prompt)+add.maxTokens), add.prompt...), tok),
		maxTokens: add.maxTokens, ignoreEOS: add.ignoreEOS, stop: add.stop, decoding: true}
	return nil
}

// releaseReserved frees a decode room's reserved sequence.
func (l *rankLoop) releaseReserved(id uint64) error {
	pool := l.rk.Pool()
	seq, ok := pool.Seq(id)
	if !ok {
		return fmt.Errorf("no reserved sequence %d to release", id)
	}
	return pool.Release(seq)
}

// pdEnded ends a PD request's stream by its typed outcome. A failure is
// logged and counted once, by the rank whose vote decided it.
func (l *rankLoop) pdEnded(a rooms.End) {
	o := a.Outcome
	q := l.pd.reqs[a.ID]
	if l.r == 0 && l.pd.machine.Has(a.ID) {
		// Its room outlives the stream (pages held until the abort is
		// acknowledged): a new request for it would share the room's
		// mail with this one.
		if r := l.e.streams.front[a.ID]; r != nil {
			r.roomHeld = true
		}
	}
	switch {
	case o.OK:
		l.end(a.ID, ending{reason: sched.ReasonLength, pd: true})
		return
	case o.Reason.Kind == rooms.KindAborted:
		l.end(a.ID, ending{reason: sched.ReasonAbort, pd: true})
		return
	}
	if q != nil && q.add.url != "" {
		l.e.pd.reg.forget(q.add.url) // a restarted prefill has new endpoints
	}
	if o.Owner {
		room := uint64(0)
		if q != nil {
			room = q.add.room
		}
		l.e.pd.failed(o.Phase, o.Reason.Kind)
		l.e.cfg.Logger.Warn("pd: request failed", "server", l.e.cfg.Name, "role", l.e.cfg.Role, "request", a.ID, "room", room,
			"rank", l.r, "phase", o.Phase.String(), "peer", o.Peer, "reason", o.Reason.Kind.String(), "error", o.Reason.Text)
	}
	l.end(a.ID, ending{reason: sched.ReasonError, err: "pd: " + o.Reason.Text, pd: true})
}

// publishPD stores the rank's PD queues for readers.
func (l *rankLoop) publishPD() {
	if l.pd == nil {
		return
	}
	es := l.pd.machine.Entries()
	out := make([]PDEntry, len(es))
	for i, en := range es {
		out[i] = PDEntry{ID: en.ID, Room: en.Room, Queue: en.Phase.String(), InQueue: l.now - en.Since, Peer: en.Peer,
			Tokens: en.PromptLen, Chunks: en.Chunks, Bytes: en.Bytes, AbortSent: en.AbortSent, Acked: en.Acked,
			Poll: en.Vote, Agreed: en.Agreed, Error: en.Reason.Text, Leased: en.Leased, Position: en.Position}
		if en.Deadline != rooms.NoDeadline {
			out[i].DeadlineIn, out[i].HasDeadline = en.Deadline-l.now, true
		}
	}
	l.pd.snap.Store(&out)
}

// releaseRooms frees the bootstrap rooms of every request rank 0's
// machine still holds, whose Forget will never come: the rank group is
// being given up.
func (l *rankLoop) releaseRooms() {
	for _, en := range l.pd.machine.Entries() {
		l.e.pd.rooms.CompareAndDelete(en.Room, en.ID)
	}
}
