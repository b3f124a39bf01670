package serve

import (
	"errors"
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/kernels"
)

// A live index-K precision switch. Every index key in a rank's pool, its
// prefix cache and its host tier is in the precision it was written in, so
// a switch needs an engine that holds none: rank 0 stops taking new
// requests from the inbox (they wait there, queued, not refused), lets the
// requests it holds finish, and once the scheduler and the PD machine hold
// none broadcasts the switch in the step input; every rank then drops its
// cached pages and host tier, reallocates its index-K buffers and, if the
// tier was on, attaches a new one in the new layout. Once the switch's
// bound has passed, rank 0 aborts, at every step until the switch, what
// still holds the drain (AbortBySwitch: a clear reason on every stream)
// but the PD rooms that only wait for their peer's word or deadline (a
// prefill's Inflight, a decode's Aborting: an abort would not change them,
// and their deadlines bound them), and switches as soon as it can.
//
// On a PD server the drain waits for every room past the handshake, and for
// none still in it (rooms.Machine.Handshaking): a prefill room waiting for
// its decode's TRANSFER_INFO, a decode room waiting for its registry or
// pages. Those hold nothing in either precision, and a prefill that waited
// for them could wait until its bound: their decode may be out of pages,
// held by rooms whose prefill half arrived after the drain began and waits
// behind it. They span the switch and meet the new precision at the
// handshake, where a peer still in the old one is refused (TRANSFER_INFO
// carries the precision), with that reason.

// AbortBySwitch: the request was in flight when an index-K precision switch
// ran out of its drain bound.
const AbortBySwitch AbortBy = 3

// IndexKSwitch is the outcome of SetIndexK.
type IndexKSwitch struct {
	From, To kernels.IndexKDType
	// Paused is how long the server did not admit: from the request to
	// the switch.
	Paused time.Duration
	// Aborted is the requests in flight that the drain bound cut.
	Aborted int
	// Changed is false when the server already ran in To.
	Changed bool
}

// indexKOp is a switch waiting for the loops; rank 0's loop owns it once
// it is set (under the inbox's lock).
type indexKOp struct {
	to       kernels.IndexKDType
	since    time.Time
	deadline time.Time
	cut      int // requests aborted by the bound
	done     chan IndexKSwitch
}

// ErrIndexKBusy: a precision switch is already draining.
var ErrIndexKBusy = errors.New("serve: an index-K precision switch is already under way")

// drainStep, on rank 0 while a switch drains, puts the switch into the step
// input, or the aborts of what still holds it past the bound, as
// rankcore.DrainStep decides from state every rank holds alike (the
// counts in f, and spared: whether a request is a PD room an abort would
// not change). It reports whether the switch went in.
func (s *streams) drainStep(op *indexKOp, in *stepInput, f rankcore.DrainFacts, spared func(id uint64) bool) bool {
	var held []rankcore.DrainHeld
	if f.PastBound {
		for id, r := range s.front {
			h := rankcore.DrainHeld{ID: id, Cut: r.cut != "", Spared: spared(id)}
			for _, f := range r.forks {
				h.Forks = append(h.Forks, f.id)
			}
			held = append(held, h)
		}
	}
	d := rankcore.DrainStep(f, held)
	if d.Switch {
		in.switchIndexK, in.indexK = true, op.to
		return true
	}
	for _, id := range d.Cut {
		s.front[id].cut = ReasonAbort
		in.aborts = append(in.aborts, abortMsg{id: id, by: AbortBySwitch})
		op.cut++
	}
	return false
}

// applyIndexK switches this rank's pool, cache, host tier and PD machine to
// dt; the engine holds no request but PD rooms still in the handshake.
func (l *rankLoop) applyIndexK(dt kernels.IndexKDType, tierPages int) error {
	e := l.e
	if l.cache != nil {
		if err := l.tier.detach(l.px.holds, l.core); err != nil {
			return err
		}
		l.cache.Evict(l.cache.Pages())
	}
	pool := l.rk.Pool()
	if err := pool.SetIndexK(dt); err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	if l.pd != nil {
		if err := l.pd.machine.SetIndexKDType(indexKName(dt)); err != nil {
			return fmt.Errorf("serve: rank %d: %w", l.r, err)
		}
	}
	if tierPages > 0 && l.cache != nil {
		if err := l.tier.attach(tierPages); err != nil {
			return fmt.Errorf("serve: rank %d: hicache back on after the index-K switch: %w", l.r, err)
		}
	}
	if l.r != 0 {
		return nil
	}
	from := e.view.IndexK()
	e.indexK.Store(int32(dt))
	e.streams.totals.IndexKSwitches++
	if e.pd != nil {
		e.pd.reg.clear() // our handshakes now say the new precision
	}
	op := e.inbox.doneIndexK()
	res := IndexKSwitch{From: from, To: dt, Changed: true}
	if op != nil {
		res.Paused, res.Aborted = e.now().Sub(op.since), op.cut
		op.done <- res
	}
	e.cfg.Logger.Info("serve: index-K precision switched", "server", e.cfg.Name, "from", from.String(), "to", dt.String(),
		"paused", res.Paused, "aborted", res.Aborted)
	if e.cfg.Role == pdproto.RolePrefill && e.cfg.PD.OnRankInfos != nil {
		e.cfg.PD.OnRankInfos(e.pdView.RankInfos())
	}
	return nil
}

// indexKName is dt as the PD protocol names it.
func indexKName(dt kernels.IndexKDType) string {
	if dt == kernels.IndexBF16 {
		return "bf16"
	}
	return "fp8"
}

// tierPagesIn is the host tier's size in pages once the pool dev holds
// index keys in dt: sized once, on rank 0, for every rank (a rank that
// read the machine's memory on its own could decide otherwise); 0, the
// tier staying off, with the reason when the memory is not there.
func (c Config) tierPagesIn(dev kvcache.Config, dt kernels.IndexKDType) (int, error) {
	ik := *dev.IndexK
	ik.DType = dt
	dev.IndexK = &ik
	return c.HiCache.hostPages(dev, c.TP)
}
