package serve

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/pd/mailbox"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
)

// pdEngine is the Engine's PD state outside the rank loops: the bootstrap
// rooms of the live requests, the decode side's registry lookups and the
// counters the metrics read. Any goroutine uses it (its fields are atomic
// or locked); PDView is its reader.
type pdEngine struct {
	reg   *registries // decode: the prefill registries it may look up, and their lookups
	ctx   context.Context
	stop  context.CancelFunc
	wg    sync.WaitGroup // the lookups under way
	rooms sync.Map       // bootstrap room -> request id, for live PD requests

	// What a lookup needs: its bound, the log its failures go to, and
	// this server's description (rank 0's, as the handshake sends it).
	timeout time.Duration
	log     *slog.Logger
	server  string
	local   func() pdproto.DecodeInfo
	now     func() time.Time // the engine's clock: when a failed lookup may be retried

	bytes    atomic.Uint64
	fails    atomic.Uint64
	failsIn  [8]atomic.Uint64  // by the queue (rooms.Phase) the request failed in
	failsFor [16]atomic.Uint64 // by the kind (rooms.Kind) of its reason
	// roomsInUse counts requests refused for naming a room a live request
	// of this server has.
	roomsInUse atomic.Uint64
}

func newPDEngine(cfg *Config, local func() pdproto.DecodeInfo) (*pdEngine, error) {
	reg, err := newRegistries(cfg.PD)
	if err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	return &pdEngine{reg: reg, ctx: ctx, stop: stop, timeout: cfg.PD.BootstrapTimeout, log: cfg.Logger, server: cfg.Name, local: local, now: cfg.Clock.Now}, nil
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

// claimRoom takes bootstrap room room for request id: a room belongs to
// one live request on each side, for two would share one mailbox, and
// one's KV could land in the other. It fails with ErrRoomInUse.
func (p *pdEngine) claimRoom(room, id uint64) error {
	if other, taken := p.rooms.LoadOrStore(room, id); taken {
		return fmt.Errorf("%w: bootstrap room %d belongs to live request %d", ErrRoomInUse, room, other)
	}
	return nil
}

// failed counts a PD failure, once per request: by the rank whose vote
// decided it.
func (p *pdEngine) failed(ph rooms.Phase, k rooms.Kind) {
	p.fails.Add(1)
	p.failsIn[ph].Add(1)
	p.failsFor[k].Add(1)
}

// moved counts n bytes of KV payload sent or applied (rank 0's share).
func (p *pdEngine) moved(n int) { p.bytes.Add(uint64(n)) }

// resolved reports the registry at url (canonical, allowed): its ranks
// (checked compatible), or why not, and whether the lookup has ended. It
// starts a lookup when none is under way (or the last one failed a while
// ago). Safe from any goroutine.
func (p *pdEngine) resolved(url string) ([]pdproto.RankInfo, error, bool) {
	p.reg.mu.Lock()
	defer p.reg.mu.Unlock()
	r := p.reg.get(url)
	if r == nil || (r.done && r.err != nil && p.now().Sub(r.at) > retryFailedAfter) {
		r = &resolution{url: url, at: p.now()}
		p.reg.put(url, r)
		local := p.local()
		p.wg.Go(func() {
			// The HTTP call's own bound, on the wall clock the
			// network runs on; the room's bootstrap deadline, the
			// same length, is judged on the engine's clock.
			ctx, cancel := context.WithTimeout(p.ctx, p.timeout)
			defer cancel()
			infos, err := (&bootstrap.Client{HTTP: lookupClient}).Handshake(ctx, url, local)
			if err != nil {
				p.log.Warn("pd: prefill registry lookup failed", "server", p.server, "registry", url, "err", err)
				err = lookupFailure(url, p.timeout, err)
			}
			p.reg.mu.Lock()
			r.done, r.infos, r.err, r.at = true, infos, err, p.now()
			p.reg.mu.Unlock()
		})
	}
	return r.infos, r.err, r.done
}

// stopLookups ends the registry lookups under way and waits for them.
func (p *pdEngine) stopLookups() {
	p.stop()
	p.wg.Wait()
}

// PDObserver is implemented by a Config.Observer that also wants the PD
// transfers: a decode rank reports each request's KV as it completes, with
// its payload bytes and the time from TRANSFER_INFO to the last chunk. It
// is called on the rank's loop goroutine and must not block.
type PDObserver interface {
	KVTransferred(rank, bytes int, d time.Duration)
}

// PDView reads the PD side of the engine from any goroutine, lock-free:
// the counters, the bootstrap rooms, and every rank's PD queues and socket
// as the rank last published them. Engine.PD returns it. It is apart from
// View because it is one subject with its own readers (the PD metrics and
// debug pages); on a colocated server every read is empty.
type PDView struct {
	pd   *pdEngine // nil on a colocated server
	sup  *supervisor
	role string
}

// Failures counts PD requests that failed (not counting client aborts).
func (v *PDView) Failures() uint64 {
	if v.pd == nil {
		return 0
	}
	return v.pd.fails.Load()
}

// FailuresByReason counts PD failures (not client aborts) by the kind of
// their reason (timeout, peer-aborted, send, ...; see rooms.Kind).
func (v *PDView) FailuresByReason() map[string]uint64 {
	if v.pd == nil {
		return nil
	}
	out := map[string]uint64{}
	for i := range kindNames {
		if n := v.pd.failsFor[i].Load(); n > 0 {
			out[kindNames[i]] = n
		}
	}
	return out
}

// FailuresByQueue counts PD failures (not client aborts) by the queue the
// request was in: bootstrap, active, inflight (prefill); prealloc,
// transfer (decode).
func (v *PDView) FailuresByQueue() map[string]uint64 {
	if v.pd == nil {
		return nil
	}
	out := map[string]uint64{}
	for i := range phaseNames {
		if n := v.pd.failsIn[i].Load(); n > 0 {
			out[phaseNames[i]] = n
		}
	}
	return out
}

// RoomsInUse counts PD requests refused (ErrRoomInUse) for naming the
// bootstrap room of a live request of this server.
func (v *PDView) RoomsInUse() uint64 {
	if v.pd == nil {
		return 0
	}
	return v.pd.roomsInUse.Load()
}

// RoomRequest returns the id of the live request of bootstrap room room.
func (v *PDView) RoomRequest(room uint64) (uint64, bool) {
	if v.pd == nil {
		return 0, false
	}
	id, ok := v.pd.rooms.Load(room)
	if !ok {
		return 0, false
	}
	return id.(uint64), true
}

// TransferBytes is the KV payload moved by this server (sent by a prefill,
// received by a decode), rank 0's share.
func (v *PDView) TransferBytes() uint64 {
	if v.pd == nil {
		return 0
	}
	return v.pd.bytes.Load()
}

// BootstrapRefused counts decode requests refused for a bootstrap_url off
// the allowlist.
func (v *PDView) BootstrapRefused() uint64 {
	if v.pd == nil {
		return 0
	}
	return v.pd.reg.refused.Load()
}

// LookupsEvicted counts registry lookups the decode's bounded cache
// dropped (PDConfig.BootstrapCacheSize).
func (v *PDView) LookupsEvicted() uint64 {
	if v.pd == nil {
		return 0
	}
	return v.pd.reg.evicted.Load()
}

// RankInfos describes a prefill server's ranks for its bootstrap registry;
// nil on other roles.
func (v *PDView) RankInfos() []pdproto.RankInfo {
	if v.role != pdproto.RolePrefill {
		return nil
	}
	d := v.pd.local()
	var out []pdproto.RankInfo
	inc := v.sup.cur() // its instance id and start change with each rebuild (recover.go)
	for r, l := range inc.loops {
		out = append(out, pdproto.RankInfo{Rank: r, TPSize: d.TPSize, Endpoint: l.pd.endpoint, PageSize: d.PageSize,
			KVDType: d.KVDType, IndexKDType: d.IndexKDType, Model: d.Model, Layers: d.Layers, KVHeads: d.KVHeads, HeadDim: d.HeadDim,
			InstanceID: inc.instance, StartedAt: inc.started})
	}
	return out
}

// Queues counts the PD requests per queue, summed over nothing: rank 0's
// view (every rank holds the same queues). Keys: bootstrap, active,
// inflight (prefill); prealloc, transfer, aborting (decode).
func (v *PDView) Queues() map[string]int64 {
	if v.pd == nil {
		return nil
	}
	out := map[string]int64{}
	for _, name := range phaseNames {
		out[name] = 0
	}
	if p := v.sup.cur().loops[0].pd.snap.Load(); p != nil {
		for _, en := range *p {
			out[en.Queue]++
		}
	}
	return out
}

// QueueEntries returns every rank's PD queues as each rank last published
// them (lock-free), in rank order; nil on a colocated server.
func (v *PDView) QueueEntries() [][]PDEntry {
	if v.pd == nil {
		return nil
	}
	loops := v.sup.cur().loops
	out := make([][]PDEntry, len(loops))
	for r, l := range loops {
		if p := l.pd.snap.Load(); p != nil {
			out[r] = *p
		}
	}
	return out
}

// Links reports every rank's socket: receive loop liveness and counts, and
// the messages dropped as late, out of place or by a fault switch.
func (v *PDView) Links() []PDLink {
	if v.pd == nil {
		return nil
	}
	loops := v.sup.cur().loops
	out := make([]PDLink, len(loops))
	for r, l := range loops {
		out[r] = PDLink{Rank: r, Advertised: l.pd.endpoint, Boot: l.pd.boot, Peers: l.pd.mb.peers(), PendingKV: l.pd.mb.pendingKV(), Inbox: l.pd.inbox.Stats(), Outbox: l.pd.outbox.Stats(), Late: l.pd.mb.late.Load(), Misplaced: l.pd.mb.bad.Load(), Faulted: l.pd.mb.faulted.Load(),
			KVBytes: l.pd.bytes.Load(), OverQuota: l.pd.mb.overQuota.Load(), RepliesDropped: l.pd.replies.dropped.Load()}
	}
	return out
}

// PDLink is one rank's PD socket state.
type PDLink struct {
	Rank int
	// Boot is the rank group's boot number, which its heartbeats carry.
	Boot uint64
	// Peers is a decode rank's table of the prefill ranks it probed
	// (nil on a prefill).
	Peers []mailbox.PeerState
	// PendingKV is the KV a decode rank received and has not applied.
	PendingKV int64
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
