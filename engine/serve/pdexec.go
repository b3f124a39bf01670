package serve

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
)

// The PD roles' executor. The protocol itself, every move of every room, is
// engine/pd/rooms' machine; this file does its I/O: it files the socket's
// mail and the peers' liveness into the machine, hands its vote vector to
// the loop's poll, and carries out the actions it returns (reserve pages,
// write landed chunks, send messages); the loop's part of them (a request
// joining the scheduler or ending) it runs through the pdLoop each call
// takes, in the machine's order.
// A send that fails goes back into the machine as this rank's vote of
// Failed, so the next poll fails the room on every rank with the real
// cause.

// pdLoop is what one call into the executor takes from the rank loop: the
// agreed clock, the rank's pool and prefix cache, and the loop's part of
// the machine's actions. The executor runs them in the machine's order (a
// stream's End before the ABORT that follows it, a decode arrival's join
// before the STATUS Success that lets the prefill forget the room).
type pdLoop struct {
	now   time.Duration
	pool  *kvcache.Pool
	cache *prefix.Cache // nil when the prefix cache is off
	// cut aborts a prefill request in the scheduler (Cut); its finish
	// comes back through schedFinished.
	cut func(id uint64, why string) error
	end func(id uint64, how ending) // ends a request's stream (End)
	// join takes a decode request on from its committed KV (Arrived): its
	// first token, its later samples, then the scheduler or its end.
	join func(add addMsg, first int32, seq *kvcache.Seq) error
}

// admit takes in a new PD request on this rank (an agreed event).
func (pd *rankPD) admit(now time.Duration, a addMsg) error {
	fp := pdproto.PromptFingerprint(a.prompt)
	err := pd.machine.Admit(now, rooms.Request{ID: a.id, Room: a.room, PromptLen: len(a.prompt), MaxTokens: a.maxTokens, URL: a.url, Prompt: fp})
	if err != nil {
		// Submit checked the request (and refuses a room in use): an
		// error here is a broken invariant, the same on every rank.
		return fmt.Errorf("admit room %d: %w", a.room, err)
	}
	pd.reqs[a.id] = &pdReq{add: a, prompt: fp}
	pd.mb.admit(a.room)
	return nil
}

// observe files what this rank alone knows into the machine before its
// vote: each room's mail, the registry lookups of the decode rooms that
// wait for one, and the liveness of the prefill peers (probing them).
func (pd *rankPD) observe(lp pdLoop) error {
	pd.mb.expire(pd.host.now().Add(-pd.cfg.BootstrapTimeout))
	pd.mb.forgetPeers()
	for id := range pd.reqs { // filing only writes chunks, never ends a room
		if err := pd.fileMail(lp, id); err != nil {
			return err
		}
	}
	for _, r := range pd.machine.Resolving() {
		infos, err, done := pd.host.resolved(r.URL)
		switch {
		case !done:
		case err != nil:
			pd.machine.Resolve(r.ID, rooms.Resolution{Err: err})
		case pd.rank >= len(infos):
			pd.machine.Resolve(r.ID, rooms.Resolution{Err: fmt.Errorf("the prefill has %d ranks", len(infos))})
		default:
			pd.machine.Resolve(r.ID, rooms.Resolution{Endpoint: infos[pd.rank].Endpoint})
			if q := pd.reqs[r.ID]; q != nil {
				pd.mb.expect(q.add.room, infos[pd.rank].Endpoint)
			}
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
func (pd *rankPD) fileMail(lp pdLoop, id uint64) error {
	q := pd.reqs[id]
	if q == nil {
		return nil
	}
	m := pd.mb.take(q.add.room)
	if m.Empty() {
		return nil
	}
	return pd.exec(lp, pd.machine.File(lp.now, id, m))
}

// abort aborts a PD request that is not in the scheduler (an agreed
// abort). It reports whether the machine had it (a colocated rank has
// none).
func (pd *rankPD) abort(lp pdLoop, id uint64, why string) (bool, error) {
	if pd == nil {
		return false, nil
	}
	// The room's latest mail first: a prefill tells a decode whose
	// TRANSFER_INFO just arrived.
	if err := pd.fileMail(lp, id); err != nil {
		return false, err
	}
	acts, handled := pd.machine.Abort(lp.now, id, why)
	return handled, pd.exec(lp, acts)
}

// schedFinished tells the machine of a prefill request the scheduler
// finished. It reports whether the machine owns the request's end (it
// waits for the decode's word, or ended it by the PD failure that cut it).
func (pd *rankPD) schedFinished(lp pdLoop, f sched.Finish) (bool, error) {
	if pd == nil || !pd.machine.Has(f.ID) {
		return false, nil
	}
	produced := f.Reason == sched.ReasonStop || f.Reason == sched.ReasonLength
	acts, handled := pd.machine.SchedFinished(lp.now, f.ID, produced, f.Reason.String())
	if !handled && (f.Reason == sched.ReasonTimeout || f.Reason == sched.ReasonError) && pd.rank == 0 {
		// The prefill's own scheduler ended it: a PD failure too, told
		// to the decode by the STATUS among acts.
		pd.host.failed(rooms.Active, rooms.KindScheduler)
		pd.host.logger.Warn("pd: request failed", "server", pd.host.name, "role", pd.host.role, "request", f.ID,
			"client_request_id", tagOf(pd.reqs, f.ID), "rank", pd.rank, "phase", rooms.Active.String(), "reason", rooms.KindScheduler.String(), "error", "prefill "+f.Reason.String())
	}
	return handled, pd.exec(lp, acts)
}

// applyPoll moves every room by the agreed votes and carries out the
// machine's actions. It returns the prefill requests whose TRANSFER_INFO
// the ranks agreed on (Admit, which only the poll gives): the loop's admit
// adds them to the scheduler.
func (pd *rankPD) applyPoll(lp pdLoop, votes []int64) ([]addMsg, error) {
	acts, err := pd.machine.Apply(lp.now, votes)
	if err != nil {
		return nil, fmt.Errorf("serve: rank %d: pd poll: %w", pd.rank, err)
	}
	var joins []addMsg
	for i, act := range acts {
		if a, ok := act.(rooms.Admit); ok {
			joins = append(joins, pd.reqs[a.ID].add)
			continue
		}
		if err := pd.exec(lp, acts[i:i+1]); err != nil {
			return nil, err
		}
	}
	return joins, nil
}

// grantPagesSendInfo gives the decode rooms that wait for memory their
// pages within what every rank can allocate (pages, rows, less what the
// core's scheduler keeps): each granted room's sequence is reserved and its
// TRANSFER_INFO sent; a room that waits on is sent QUEUED. It returns the
// pages left for the scheduler; a prefill grants none.
func (pd *rankPD) grantPagesSendInfo(lp pdLoop, pages, rows int, core *rankcore.Core) (int, error) {
	if pd == nil {
		return pages, nil
	}
	b := rooms.Budget{FreePages: pages, FreeRows: rows, SchedSlots: core.FreeSlots()}
	if g := pd.cfg.ReservedDecodeTokens; g >= 0 {
		b.SchedGrowth = core.Reserve(g)
	}
	free, acts := pd.machine.Grant(lp.now, b)
	return free, pd.exec(lp, acts)
}

// exec carries out the machine's actions, in order. An Admit is not one
// of them: only the poll gives it, and applyPoll hands it to the loop.
func (pd *rankPD) exec(lp pdLoop, acts []rooms.Action) error {
	for _, act := range acts {
		var err error
		switch a := act.(type) {
		case rooms.Reserve:
			err = pd.reserve(lp, a.ID, a.Tokens)
			if pd.rank == 0 {
				pd.host.served(a.ID, pd.host.now())
			}
		case rooms.SendTransferInfo:
			pd.sendChecked(a.ID, "transfer info", a.Peer, pd.transferInfo(a))
		case rooms.SendChunk:
			pd.sendChunk(lp.pool, a)
		case rooms.SendQueued:
			pd.sendChecked(a.ID, "queued", a.Peer, &pdproto.Queued{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(pd.rank), Position: uint32(a.Position)})
		case rooms.ApplyChunk:
			if werr := pd.applyChunk(lp.pool, a); werr != nil {
				pd.machine.Failed(a.ID, rooms.Reason{Kind: rooms.KindBadChunk, Text: werr.Error()}) // it can only be failing already otherwise
			}
		case rooms.SendStatus:
			pd.sendChecked(a.ID, "status", a.Peer, &pdproto.Status{Room: a.Room, Rank: uint32(pd.rank), State: a.State, Error: a.Error, Asked: a.Asked})
		case rooms.SendAbort:
			pd.sendChecked(a.ID, "abort", a.Peer, &pdproto.Abort{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(pd.rank), Reason: a.Reason, Asked: a.Asked})
		case rooms.SendAbortAck:
			pd.replies.post(a.To, &pdproto.AbortAck{Room: a.Room, Rank: uint32(pd.rank), Known: true}) // to an endpoint the ABORT named
		case rooms.Cut:
			err = lp.cut(a.ID, a.Reason.Text)
		case rooms.Arrived:
			err = pd.arrived(lp, a)
		case rooms.Release:
			err = releaseReserved(lp.pool, a.ID)
		case rooms.End:
			pd.endStream(lp, a)
		case rooms.Forget:
			delete(pd.reqs, a.ID)
			if pd.rank == 0 {
				pd.host.freeRoom(a.Room, a.ID) // the room may serve a new request now
			}
			if to, ack := pd.mb.forget(a.Room, a.Why, a.Asked); ack != nil {
				pd.replies.post(to, ack)
			}
		default:
			err = fmt.Errorf("unknown PD action %T", act)
		}
		if err != nil {
			return fmt.Errorf("serve: rank %d: %s: %w", pd.rank, rooms.Format(act), err)
		}
	}
	return nil
}

// sendChecked sends m for request id; a failure is this rank's vote of
// Failed for the room, or, once the room is ending anyway, logged.
func (pd *rankPD) sendChecked(id uint64, what, to string, m pdproto.Message) {
	err := pd.send(to, m)
	if err == nil {
		return
	}
	if pd.machine.SendFailed(id, what, err) {
		return
	}
	// The room is gone or failing already: nothing left to vote; the
	// peer finds out by its own timeout or heartbeat.
	pd.host.logger.Warn("pd: peer not told", "server", pd.host.name, "rank", pd.rank, "request", id, "client_request_id", tagOf(pd.reqs, id), "to", to, "message", what, "err", err)
}

// reserve starts the decode sequence of request id with room for its
// prompt: the machine granted pages every rank agreed are free.
func (pd *rankPD) reserve(lp pdLoop, id uint64, tokens int) error {
	pool := lp.pool
	need := (tokens + pd.host.pageSize - 1) / pd.host.pageSize // pages, rounded up
	if short := need - pool.FreePages(); short > 0 && lp.cache != nil {
		lp.cache.Evict(short)
	}
	seq, err := pool.NewSeq(id)
	if err != nil {
		return err
	}
	if err := pool.Reserve(seq, tokens); err != nil {
		return errors.Join(err, pool.Release(seq))
	}
	pd.reqs[id].slots = slices.Clone(seq.Slots()[:tokens])
	return nil
}

// transferInfo is a decode room's TRANSFER_INFO: where its KV goes.
func (pd *rankPD) transferInfo(a rooms.SendTransferInfo) *pdproto.TransferInfo {
	q := pd.reqs[a.ID]
	info := &pdproto.TransferInfo{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(pd.rank),
		Tokens: uint32(len(q.slots)), Prompt: q.prompt, IndexKDType: pd.host.indexK(), RequestID: strconv.FormatUint(a.ID, 10)}
	pageSize := int32(pd.host.pageSize)
	for i := 0; i < len(q.slots); i += int(pageSize) {
		info.Pages = append(info.Pages, uint32(q.slots[i]/pageSize))
	}
	return info
}

// applyChunk writes a landed chunk into the room's reserved slots.
func (pd *rankPD) applyChunk(pool *kvcache.Pool, a rooms.ApplyChunk) error {
	ch, q := a.Chunk, pd.reqs[a.ID]
	if len(ch.Layers) != pd.host.layers {
		return fmt.Errorf("KV chunk %d has %d layers, the model %d", ch.Chunk, len(ch.Layers), pd.host.layers)
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
	return nil
}

// sendChunk copies the KV of a prefill step's tokens out of the pool and
// sends it to the decode rank.
func (pd *rankPD) sendChunk(pool *kvcache.Pool, a rooms.SendChunk) {
	seq, ok := pool.Seq(a.ID)
	if !ok {
		pd.machine.Failed(a.ID, rooms.Reason{Kind: rooms.KindBadChunk, Text: "the sequence is gone"})
		return
	}
	slots := seq.Slots()[a.Start:a.End]
	ch := &pdproto.KVChunk{Room: a.Room, Chunk: uint32(a.Index), Start: uint32(a.Start), End: uint32(a.End), Prompt: pd.reqs[a.ID].prompt, Final: a.Final}
	for layer := range pd.host.layers {
		var kv pdproto.LayerKV
		kv.K, kv.V = pool.AppendKV(layer, slots, nil, nil)
		kv.IndexK, kv.IndexKScales = pool.AppendIndexK(layer, slots, nil, nil)
		ch.Layers = append(ch.Layers, kv)
	}
	n := ch.PayloadBytes()
	pd.machine.Moved(a.ID, n)
	pd.bytes.Add(uint64(n))
	if pd.rank == 0 {
		pd.host.moved(n)
	}
	pd.sendChecked(a.ID, "KV", a.Peer, ch)
}

// sendStepKV sends, after a prefill step, the KV of each PD request's new
// tokens (core holds the rank's requests) to its decode rank, one chunk
// each; the chunk of an item that sampled carries the first token. toks
// maps the step's sampled tokens by request. A decode sends nothing.
func (pd *rankPD) sendStepKV(lp pdLoop, core *rankcore.Core, items []sched.Item, toks map[uint64]int32) error {
	if pd == nil || pd.host.role != pdproto.RolePrefill {
		return nil
	}
	for _, it := range items {
		q, s := pd.reqs[it.ID], core.Seq(it.ID)
		if q == nil || s == nil || s.Cut {
			continue
		}
		var final *pdproto.ChunkFinal
		if tok, ok := toks[it.ID]; ok {
			final = &pdproto.ChunkFinal{FirstToken: tok, PromptTokens: uint32(len(q.add.prompt)), CachedTokens: uint32(it.Cached)}
		}
		if err := pd.exec(lp, pd.machine.Sent(it.ID, it.Start+it.Tokens, final)); err != nil {
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
// and the loop takes the request on with the prefill's first token.
func (pd *rankPD) arrived(lp pdLoop, a rooms.Arrived) error {
	pool := lp.pool
	q := pd.reqs[a.ID]
	seq, ok := pool.Seq(a.ID)
	if !ok {
		return fmt.Errorf("room %d lost its sequence", q.add.room)
	}
	if err := pool.Commit(seq, len(q.slots)); err != nil {
		return err
	}
	if h := arrivedHook; h != nil {
		h(pd.rank, q.add.room, pool, seq.Slots())
	}
	pd.bytes.Add(uint64(a.Bytes))
	if o := pd.host.observer; o != nil {
		o.KVTransferred(pd.rank, a.Bytes, a.Took)
	}
	if pd.rank == 0 {
		pd.host.moved(a.Bytes)
	}
	return lp.join(q.add, a.First.FirstToken, seq)
}

// releaseReserved frees a decode room's reserved sequence.
func releaseReserved(pool *kvcache.Pool, id uint64) error {
	seq, ok := pool.Seq(id)
	if !ok {
		return fmt.Errorf("no reserved sequence %d to release", id)
	}
	return pool.Release(seq)
}

// tagOf is the client's id of request id among reqs ("" without one, or
// once gone).
func tagOf(reqs map[uint64]*pdReq, id uint64) string {
	if q := reqs[id]; q != nil {
		return q.add.tag
	}
	return ""
}

// endStream ends a PD request's stream by its typed outcome. A failure is
// logged and counted once, by the rank whose vote decided it.
func (pd *rankPD) endStream(lp pdLoop, a rooms.End) {
	o := a.Outcome
	q := pd.reqs[a.ID]
	if pd.rank == 0 && pd.machine.Has(a.ID) {
		// Its room outlives the stream (pages held until the abort is
		// acknowledged): a new request for it would share the room's
		// mail with this one.
		pd.host.holdRoom(a.ID)
	}
	switch {
	case o.OK:
		lp.end(a.ID, ending{reason: sched.ReasonLength, pd: true})
		return
	case o.Reason.Kind == rooms.KindAborted || o.Reason.Asked:
		// An abort someone asked for, here or on the peer's side (the
		// client, the router, an operator): an abort, not a failure.
		lp.end(a.ID, ending{reason: sched.ReasonAbort, pd: true})
		return
	}
	if q != nil && q.add.url != "" {
		pd.host.forgetResolution(q.add.url) // a restarted prefill has new endpoints
	}
	if o.Reason.Kind == rooms.KindPeerLost && o.Peer != "" {
		pd.mb.lost(o.Peer) // every rank's own table: each probes its own peer
	}
	if o.Owner {
		room, tag := uint64(0), ""
		if q != nil {
			room, tag = q.add.room, q.add.tag
		}
		pd.host.failed(o.Phase, o.Reason.Kind)
		pd.host.logger.Warn("pd: request failed", "server", pd.host.name, "role", pd.host.role, "request", a.ID, "room", room,
			"client_request_id", tag, "rank", pd.rank, "phase", o.Phase.String(), "peer", o.Peer, "reason", o.Reason.Kind.String(), "error", o.Reason.Text)
	}
	lp.end(a.ID, ending{reason: sched.ReasonError, err: "pd: " + o.Reason.Text, pd: true})
}
