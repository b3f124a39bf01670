package serve

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/engine/pd/rooms"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/kernels"
)

// pdEngine is the Engine's PD state outside the rank loops: the decode
// side's registry lookups and the counters the metrics read.
type pdEngine struct {
	reg      *registries // decode: the prefill registries it may look up, and their lookups
	ctx      context.Context
	stop     context.CancelFunc
	wg       sync.WaitGroup
	bytes    atomic.Uint64
	fails    atomic.Uint64
	failsIn  [8]atomic.Uint64  // by the queue (rooms.Phase) the request failed in
	failsFor [16]atomic.Uint64 // by the kind (rooms.Kind) of its reason
	// roomsInUse counts requests refused for naming a room a live request
	// of this server has.
	roomsInUse atomic.Uint64
}

// The machine's names, indexed by its phases and failure kinds.
var (
	phaseNames = names(rooms.Phases)
	kindNames  = append([]string{rooms.KindNone.String()}, names(rooms.Kinds)...)
)

func names[T fmt.Stringer](xs []T) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = x.String()
	}
	return out
}

// pdFailed counts a PD failure, once per request: by the rank whose vote
// decided it.
func (e *Engine) pdFailed(p rooms.Phase, k rooms.Kind) {
	e.pd.fails.Add(1)
	e.pd.failsIn[p].Add(1)
	e.pd.failsFor[k].Add(1)
}

// PDFailuresByReason counts PD failures (not client aborts) by the kind of
// their reason (timeout, peer-aborted, send, ...; see rooms.Kind).
func (e *Engine) PDFailuresByReason() map[string]uint64 {
	if e.pd == nil {
		return nil
	}
	out := map[string]uint64{}
	for i := range kindNames {
		if n := e.pd.failsFor[i].Load(); n > 0 {
			out[kindNames[i]] = n
		}
	}
	return out
}

// PDRoomsInUse counts PD requests refused (ErrRoomInUse) for naming the
// bootstrap room of a live request of this server.
func (e *Engine) PDRoomsInUse() uint64 {
	if e.pd == nil {
		return 0
	}
	return e.pd.roomsInUse.Load()
}

// PDObserver is implemented by a Config.Observer that also wants the PD
// transfers: a decode rank reports each request's KV as it completes, with
// its payload bytes and the time from TRANSFER_INFO to the last chunk. It
// is called on the rank's loop goroutine and must not block.
type PDObserver interface {
	KVTransferred(rank, bytes int, d time.Duration)
}

// PDFailuresByQueue counts PD failures (not client aborts) by the queue
// the request was in: bootstrap, active, inflight (prefill); prealloc,
// transfer (decode).
func (e *Engine) PDFailuresByQueue() map[string]uint64 {
	if e.pd == nil {
		return nil
	}
	out := map[string]uint64{}
	for i := range phaseNames {
		if n := e.pd.failsIn[i].Load(); n > 0 {
			out[phaseNames[i]] = n
		}
	}
	return out
}

func newPDEngine(c PDConfig) (*pdEngine, error) {
	reg, err := newRegistries(c)
	if err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	return &pdEngine{reg: reg, ctx: ctx, stop: stop}, nil
}

func (e *Engine) indexKName() string {
	if e.m.Config.Indexer == nil {
		return ""
	}
	return indexKName(e.IndexK())
}

func (e *Engine) decodeInfo() pdproto.DecodeInfo {
	c := &e.m.Config
	// KVDType is how the pools store K and V (Config.KVType): a prefill
	// and a decode that differ would move rows of the wrong size, so the
	// bootstrap compare refuses the pair by name.
	return pdproto.DecodeInfo{TPSize: e.cfg.TP, PageSize: e.cfg.PageSize, KVDType: kernels.KVName(e.cfg.KVType), IndexKDType: e.indexKName(),
		Model: e.m.Name, Layers: c.Layers, KVHeads: c.KVHeads / e.cfg.TP, HeadDim: c.HeadDim}
}

// RankInfos describes a prefill server's ranks for its bootstrap registry;
// nil on other roles.
func (e *Engine) RankInfos() []pdproto.RankInfo {
	if e.cfg.Role != pdproto.RolePrefill {
		return nil
	}
	d := e.decodeInfo()
	var out []pdproto.RankInfo
	inc := e.cur() // its instance id and start change with each rebuild (recover.go)
	for r, l := range inc.loops {
		out = append(out, pdproto.RankInfo{Rank: r, TPSize: d.TPSize, Endpoint: l.pd.endpoint, PageSize: d.PageSize,
			KVDType: d.KVDType, IndexKDType: d.IndexKDType, Model: d.Model, Layers: d.Layers, KVHeads: d.KVHeads, HeadDim: d.HeadDim,
			InstanceID: inc.instance, StartedAt: inc.started})
	}
	return out
}

// PDQueues counts the PD requests per queue, summed over nothing: rank 0's
// view (every rank holds the same queues). Keys: bootstrap, active,
// inflight (prefill); prealloc, transfer, aborting (decode).
func (e *Engine) PDQueues() map[string]int64 {
	if e.pd == nil {
		return nil
	}
	out := map[string]int64{}
	for _, name := range phaseNames {
		out[name] = 0
	}
	if p := e.cur().loops[0].pd.snap.Load(); p != nil {
		for _, en := range *p {
			out[en.Queue]++
		}
	}
	return out
}

// PDTransferBytes is the KV payload moved by this server (sent by a
// prefill, received by a decode), rank 0's share.
func (e *Engine) PDTransferBytes() uint64 {
	if e.pd == nil {
		return 0
	}
	return e.pd.bytes.Load()
}

// PDFailures counts PD requests that failed (not counting client aborts).
func (e *Engine) PDFailures() uint64 {
	if e.pd == nil {
		return 0
	}
	return e.pd.fails.Load()
}

// PDLinks reports every rank's socket: receive loop liveness and counts,
// and the messages dropped as late, out of place or by a fault switch.
func (e *Engine) PDLinks() []PDLink {
	if e.pd == nil {
		return nil
	}
	loops := e.cur().loops
	out := make([]PDLink, len(loops))
	for r, l := range loops {
		out[r] = PDLink{Rank: r, Advertised: l.pd.endpoint, Inbox: l.pd.inbox.Stats(), Outbox: l.pd.outbox.Stats(), Late: l.pd.mb.late.Load(), Misplaced: l.pd.mb.bad.Load(), Faulted: l.pd.mb.faulted.Load(),
			KVBytes: l.pd.bytes.Load(), OverQuota: l.pd.mb.overQuota.Load(), RepliesDropped: l.pd.replies.dropped.Load()}
	}
	return out
}

// PDQueueEntries returns every rank's PD queues as each rank last
// published them (lock-free), in rank order; nil on a colocated server.
func (e *Engine) PDQueueEntries() [][]PDEntry {
	if e.pd == nil {
		return nil
	}
	loops := e.cur().loops
	out := make([][]PDEntry, len(loops))
	for r, l := range loops {
		if p := l.pd.snap.Load(); p != nil {
			out[r] = *p
		}
	}
	return out
}

// RoomRequest returns the id of the live request of bootstrap room room.
func (e *Engine) RoomRequest(room uint64) (uint64, bool) {
	v, ok := e.rooms.Load(room)
	if !ok {
		return 0, false
	}
	return v.(uint64), true
}

// PDLink is one rank's PD socket state.
type PDLink struct {
	Rank int
	// Advertised is the endpoint the rank hands to its peers (and a
	// prefill registers); Inbox.Endpoint is the one it bound.
	Advertised string
	Inbox      zmqlink.InboxStats
	Outbox     zmqlink.OutboxStats
	Late       uint64 // messages for rooms the rank does not have
	Misplaced  uint64 // messages of a type the rank's role never receives
	Faulted    uint64 // messages a drop-* fault switch dropped
	KVBytes    uint64 // KV payload bytes the rank sent (prefill) or applied (decode)
	// OverQuota counts messages for a new early room dropped because their
	// sender held PDConfig.EarlyRoomsPerSender rooms already;
	// RepliesDropped the replies dropped for a full reply queue or a peer
	// with a full backlog.
	OverQuota, RepliesDropped uint64
}

func (e *Engine) pdBytes(n int) { e.pd.bytes.Add(uint64(n)) }

// emitFirst streams a decode request's first token, which came from the
// prefill, on rank 0.
func (e *Engine) emitFirst(id uint64, tok int32) {
	r := e.front[id]
	if r == nil {
		return
	}
	r.gen++
	e.totals.Sampled++
	e.emit(r, tok, time.Now())
}
