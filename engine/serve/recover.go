package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/tp"
	"github.com/pdkit/pdkit/kernels"
)

// Recovery in place
//
// With Config.CollectiveTimeout set, the supervisor (Engine.run) watches
// both communicators while the loops run. When a collective has waited
// longer than the timeout, or a loop stops on a broken group (a mismatch)
// or on ranks that planned different steps, it breaks the group: it closes
// both communicators and the incarnation's quit channel (which also ends
// the stall-last-rank fault's wait), so every loop returns. Then, with no
// loop running, it fails every request the ranks knew with
// "error: engine restarted: <cause>", lets the loops drop their requests,
// closes the HiCache tiers and the PD sockets, and builds a new
// incarnation: new shards and pools, communicators, schedulers, caches and
// loops, a new boot number and PD instance id, the PD sockets bound to the
// same endpoints (so a peer's heartbeat meets the new boot number and
// fails the old incarnation's rooms), and a prefill re-registers its ranks
// (PDConfig.OnRankInfos). Requests submitted meanwhile wait in the inbox.
// The failed group's collectives are kept for the bundle (LastFailure);
// Totals.Restarts counts the rebuilds.

// incarnation is one build of the rank group: what a rebuild replaces.
// The loops and the supervisor use the Engine's plain fields (written only
// while no loop runs); readers from other goroutines go through
// Engine.cur, an atomic pointer.
type incarnation struct {
	loops   []*rankLoop
	shards  *tp.Shards
	control *dist.Group
	// quit is closed when the group is given up (or the engine stops), so
	// that a loop waiting outside a collective returns.
	quit     chan struct{}
	quitOnce sync.Once
	boot     uint64 // the PD heartbeats' boot number
	instance string // the PD registry's instance id
	started  time.Time
}

func (c *incarnation) giveUp() { c.quitOnce.Do(func() { close(c.quit) }) }

// groups are the communicators, control first.
func (c *incarnation) groups() []*dist.Group { return []*dist.Group{c.control, c.shards.Group()} }

// cur is the incarnation serving now, for readers on any goroutine.
func (e *Engine) cur() *incarnation { return e.inc.Load() }

// Failure is the failure that made the engine rebuild its rank group.
type Failure struct {
	At     time.Time
	Reason string // the stalled collective or the loop's error
	Boot   uint64 // the failed incarnation's boot number
	// Collectives are the failed group's communicators (control, then
	// forward) as they were when the group was given up: the flight
	// recorders, the call each rank waited in.
	Collectives []dist.Snapshot
}

// LastFailure returns the last failure the engine recovered from, nil when
// none.
func (e *Engine) LastFailure() *Failure { return e.lastFailure.Load() }

// Restarts counts the rank group's rebuilds.
func (e *Engine) Restarts() uint64 { return e.restarts.Load() }

// nextBoot is a boot number above every earlier one.
var bootSeq atomic.Uint64

func newBoot(now time.Time) uint64 {
	b := uint64(now.UnixNano())
	for {
		old := bootSeq.Load()
		if b <= old {
			b = old + 1
		}
		if bootSeq.CompareAndSwap(old, b) {
			return b
		}
	}
}

// build makes an incarnation: the ranks (their shards and pools), the two
// communicators, and one loop per rank with its scheduler, prefix cache,
// host tier (tier says on) and PD sockets (bound to endpoints[r] when
// given). It sets the Engine's fields and publishes it; nothing runs yet.
func (e *Engine) build(endpoints []string) error {
	cfg := &e.cfg
	now := time.Now()
	inc := &incarnation{quit: make(chan struct{}), boot: newBoot(now), started: now}
	inc.instance = fmt.Sprintf("%x", inc.boot)
	gopts := func(name string) dist.Options {
		o := dist.Options{Name: name, FlightRecorderLen: cfg.FlightRecorderLen}
		if cfg.CollectiveWatchdog > 0 {
			onStall := cfg.OnStall
			if onStall == nil {
				onStall = func(s dist.Stall) {
					slog.Warn("collective stalled", "server", cfg.Name, "role", cfg.Role, "stall", s.String())
				}
			}
			o.Watchdog = cfg.CollectiveWatchdog
			o.OnStall = func(s dist.Stall) {
				e.stalls.Add(1)
				onStall(s)
			}
		}
		return o
	}
	shards, err := tp.NewShards(e.m, tp.Options{Ranks: cfg.TP, Backend: cfg.Backend, PageSize: cfg.PageSize,
		KVTokens: cfg.KVTokens, MaxSeqs: cfg.maxSeqs(), IndexK: kernels.IndexKDType(e.indexK.Load()), KVType: cfg.KVType, Group: gopts(CommForward)})
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	control, err := dist.NewGroup(cfg.TP, gopts(CommControl))
	if err != nil {
		shards.Close()
		return fmt.Errorf("serve: %w", err)
	}
	inc.shards, inc.control = shards, control
	tierOn := cfg.HiCache.Enabled
	if len(e.loops) > 0 && e.loops[0].cache != nil {
		tierOn = e.loops[0].cache.Loader() != nil // as the last incarnation had it (SetHiCache)
	}
	prev := e.loops
	e.shards, e.control, e.loops = shards, control, nil
	fail := func(err error) error {
		err = errors.Join(err, e.closeTiers())
		e.closeRankPD()
		control.Close()
		shards.Close()
		e.loops = prev
		return err
	}
	hostPages := 0 // per rank, once the first rank's pool is known
	for r := range cfg.TP {
		sc, err := sched.New(sched.Config{
			MaxRunning: cfg.MaxRunning, MaxBatchTokens: cfg.MaxBatchTokens, PrefillChunk: cfg.PrefillChunk,
			PageSize: cfg.PageSize, TotalPages: cfg.Pages(),
			WaitingTimeout: cfg.WaitingTimeout, PrefillTimeout: cfg.PrefillTimeout, RequestTimeout: max(0, cfg.RequestTimeout),
			Overlap: cfg.Schedule == ScheduleOverlap,
		})
		if err != nil {
			return fail(fmt.Errorf("serve: %w", err))
		}
		l := &rankLoop{e: e, r: r, rk: shards.Rank(r), sched: sc, seqs: make(map[uint64]*seqState), dlog: newDecisionLog(cfg.DecisionLogLen), quit: inc.quit, cursor: rankcore.NewCursor(cfg.table())}
		e.loops = append(e.loops, l)
		if cfg.Role != pdproto.RoleColocated {
			ep := ""
			if r < len(endpoints) {
				ep = endpoints[r]
			}
			if l.pd, err = newRankPD(e, r, inc.boot, ep); err != nil {
				return fail(fmt.Errorf("serve: rank %d: %w", r, err))
			}
		}
		if !cfg.DisablePrefixCache {
			l.cache = prefix.New(l.rk.Pool())
			layers := l.rk.Pool().Config().Layers
			l.tier.waitKV, l.tier.waitIndexK = make([]atomic.Int64, layers), make([]atomic.Int64, layers)
			if tierOn {
				if hostPages == 0 {
					if hostPages, err = cfg.HiCache.hostPages(l.rk.Pool().Config(), cfg.TP); err != nil {
						return fail(fmt.Errorf("serve: %w", err))
					}
				}
				if err := l.attachTier(hostPages); err != nil {
					return fail(fmt.Errorf("serve: rank %d: %w", r, err))
				}
			}
			l.publishTier()
		}
		l.beat.Store(now.UnixNano())
		l.last.Store(&StepRecord{Rank: r, Loop: LoopLockstep, Phase: "idle", Start: now, End: now})
	}
	inc.loops = e.loops
	e.inc.Store(inc)
	e.publish(*e.loops[0].last.Load())
	return nil
}

// closeRankPD closes the ranks' PD sockets.
func (e *Engine) closeRankPD() error {
	if len(e.loops) > 0 && e.loops[0].pd != nil {
		e.loops[0].releaseRooms()
	}
	var errs []error
	for _, l := range e.loops {
		if l.pd != nil {
			errs = append(errs, l.pd.close())
		}
	}
	return errors.Join(errs...)
}

// runLoops runs the current incarnation's loops until all have returned.
// With recovery on it watches the communicators meanwhile; it returns the
// loops' errors and, when it gave the group up on a stalled collective,
// the stall.
func (e *Engine) runLoops(ctx context.Context) ([]error, *dist.Stall, []dist.Snapshot) {
	inc := e.cur()
	errs := make([]error, len(e.loops))
	var wg sync.WaitGroup
	for r, l := range e.loops {
		wg.Go(func() {
			pprof.Do(ctx, pprof.Labels("rank", strconv.Itoa(r)), func(context.Context) {
				errs[r] = l.run()
			})
			if errs[r] != nil {
				// Wake the peers waiting for this rank in a collective.
				inc.giveUp()
				e.closeGroups()
			}
		})
	}
	loopsDone := make(chan struct{})
	go func() {
		wg.Wait()
		close(loopsDone)
	}()
	var tick <-chan time.Time
	if d := e.cfg.CollectiveTimeout; d > 0 {
		t := time.NewTicker(min(max(d/8, time.Millisecond), time.Second))
		defer t.Stop()
		tick = t.C
	}
	stop := e.stop
	var stalled *dist.Stall
	var snaps []dist.Snapshot
	for {
		select {
		case <-loopsDone:
			if stalled == nil && e.cfg.CollectiveTimeout > 0 {
				snaps = e.collectives(inc)
			}
			return errs, stalled, snaps
		case <-stop:
			inc.giveUp() // a loop held by a fault switch goes on to the stop
			stop = nil
		case now := <-tick:
			if stalled != nil {
				continue
			}
			for _, g := range inc.groups() {
				if ss := g.Stuck(now, e.cfg.CollectiveTimeout); len(ss) > 0 {
					stalled = &ss[0]
					break
				}
			}
			if stalled != nil {
				snaps = e.collectives(inc)
				inc.giveUp()
				e.closeGroups()
			}
		}
	}
}

func (e *Engine) collectives(inc *incarnation) []dist.Snapshot {
	gs := inc.groups()
	out := make([]dist.Snapshot, len(gs))
	for i, g := range gs {
		out[i] = g.Snapshot()
	}
	return out
}

// recoverable says whether the loops' stop is one recovery rebuilds from:
// a broken group, a collective mismatch (which breaks the group too: the
// ranks entered different calls at one seq, as the overlap-local-decision
// fault makes them) or ranks that planned different steps.
func recoverable(err error) bool {
	return errors.Is(err, dist.ErrGroupBroken) || errors.Is(err, dist.ErrMismatch) || errors.Is(err, errDiverged)
}

// stallReason tells a stalled collective: which ranks did not arrive at
// which call, within the timeout.
func stallReason(s dist.Stall, timeout time.Duration) string {
	var missing []string
	for _, p := range s.Missing {
		missing = append(missing, strconv.Itoa(p.Rank))
	}
	who := "ranks " + fmt.Sprint(missing)
	if len(missing) == 1 {
		who = "rank " + missing[0]
	}
	return fmt.Sprintf("%s did not reach %s seq %d %v within %v", who, s.Comm, s.Seq, s.Op, timeout)
}

// restart fails every request the ranks knew with reason, drops the failed
// incarnation and builds the next one. It runs on the supervisor with no
// loop running; false means the build failed (e.err says why).
func (e *Engine) restart(reason string, snaps []dist.Snapshot) bool {
	old := e.cur()
	e.cfg.Logger.Error("engine restarted: rank group rebuilt", "server", e.cfg.Name, "role", e.cfg.Role, "cause", reason, "boot", old.boot)
	e.lastFailure.Store(&Failure{At: time.Now(), Reason: reason, Boot: old.boot, Collectives: snaps})
	fin := "error: engine restarted: " + reason
	e.mu.Lock()
	// Aborts of requests the ranks knew die with them; those of requests
	// still in the inbox wait for the next incarnation.
	keep := e.aborts[:0]
	for _, a := range e.aborts {
		if e.front[a.id] == nil {
			keep = append(keep, a)
		}
	}
	e.aborts = keep
	e.mu.Unlock()
	for _, l := range e.loops {
		l.drop(true)
	}
	e.failFront(fin)
	if err := e.closeTiers(); err != nil {
		e.cfg.Logger.Error("serve: the failed rank group's host tiers", "server", e.cfg.Name, "err", err)
	}
	var endpoints []string
	for _, l := range e.loops {
		if l.pd != nil {
			endpoints = append(endpoints, l.pd.inbox.Endpoint())
		}
	}
	errs := errors.Join(e.closeRankPD(), e.control.Close(), e.shards.Close())
	if errs != nil && !errors.Is(errs, dist.ErrGroupClosed) {
		e.cfg.Logger.Warn("serve: closing the failed rank group", "server", e.cfg.Name, "err", errs)
	}
	e.totals.Restarts++
	e.restarts.Add(1)
	if err := e.build(endpoints); err != nil {
		e.err = fmt.Errorf("rebuild after %s: %w", reason, err)
		return false
	}
	if e.cfg.Role == pdproto.RolePrefill && e.cfg.PD.OnRankInfos != nil {
		e.cfg.PD.OnRankInfos(e.RankInfos())
	}
	return true
}

// failFront ends every request rank 0 knew with reason.
func (e *Engine) failFront(reason string) {
	ids := make([]uint64, 0, len(e.front))
	for id := range e.front {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		r := e.front[id]
		delete(e.front, id)
		e.totals.Finished++
		e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
	}
}
