package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/pprof"
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
// With Config.CollectiveTimeout set, the supervisor (supervisor.run) watches
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

// supervisor is the rank group's life: it builds an incarnation, runs its
// loops on its own goroutine (run, started by New, which exits once the
// engine stops and closes Engine.done), gives the group up and rebuilds it
// when recovery is on, and finishes what the last one left. It is split
// from the Engine because it is the one owner of the incarnation: its
// plain fields are written only while no loop runs (by the supervisor's
// goroutine, or New before it starts), which is what lets the loops read
// them without a lock.
type supervisor struct {
	e *Engine // what a build wires the loops to

	// The incarnation serving now, for the loops and the supervisor;
	// readers from other goroutines go through cur.
	loops   []*rankLoop
	shards  *tp.Shards
	control *dist.Group // the loops' communicator; the forward pass's is the shards' group
	err     error       // the failure that stopped the loops

	inc         atomic.Pointer[incarnation]
	lastFailure atomic.Pointer[Failure] // the failure of the last incarnation given up
	restarts    atomic.Uint64
	stalls      atomic.Uint64 // collectives the watchdog reported
}

// incarnation is one build of the rank group: what a rebuild replaces.
// The loops and the supervisor use the supervisor's plain fields (written
// only while no loop runs); readers from other goroutines go through
// supervisor.cur, an atomic pointer.
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

// collectives copies both communicators' state, control first.
func (c *incarnation) collectives() []dist.Snapshot {
	gs := c.groups()
	out := make([]dist.Snapshot, len(gs))
	for i, g := range gs {
		out[i] = g.Snapshot()
	}
	return out
}

// cur is the incarnation serving now, for readers on any goroutine.
func (s *supervisor) cur() *incarnation { return s.inc.Load() }

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

// groupOptions are the options of the communicator name: its flight
// recorder and watchdog, whose times are the engine's clock (the
// watchdog, Stalls and recovery judge waits on them), and the stalls the
// watchdog reports counted.
func (s *supervisor) groupOptions(name string) dist.Options {
	cfg := &s.e.cfg
	o := dist.Options{Name: name, FlightRecorderLen: cfg.FlightRecorderLen, Clock: s.e.now}
	if cfg.CollectiveWatchdog > 0 {
		onStall := cfg.OnStall
		if onStall == nil {
			onStall = func(st dist.Stall) {
				slog.Warn("collective stalled", "server", cfg.Name, "role", cfg.Role, "stall", st.String())
			}
		}
		o.Watchdog = cfg.CollectiveWatchdog
		o.OnStall = func(st dist.Stall) {
			s.stalls.Add(1)
			onStall(st)
		}
	}
	return o
}

// build makes an incarnation: the ranks (their shards and pools), the two
// communicators, and one loop per rank with its scheduler, prefix cache,
// host tier (tier says on) and PD sockets (bound to endpoints[r] when
// given). It sets the supervisor's fields and publishes it; nothing runs
// yet.
func (s *supervisor) build(endpoints []string) error {
	e := s.e
	cfg := &e.cfg
	// The boot number and the start time go to other processes (the
	// peers' mailboxes, the prefill's registry, which checks the start
	// against its own wall clock), so they are the wall clock's; what
	// this engine judges (the loops' beats) is on its clock.
	wall, now := time.Now(), e.now()
	inc := &incarnation{quit: make(chan struct{}), boot: newBoot(wall), started: wall}
	inc.instance = fmt.Sprintf("%x", inc.boot)
	shards, err := tp.NewShards(e.m, tp.Options{Ranks: cfg.TP, Backend: cfg.Backend, PageSize: cfg.PageSize,
		KVTokens: cfg.KVTokens, MaxSeqs: cfg.maxSeqs(), IndexK: kernels.IndexKDType(e.indexK.Load()), KVType: cfg.KVType, Group: s.groupOptions(CommForward)})
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	control, err := dist.NewGroup(cfg.TP, s.groupOptions(CommControl))
	if err != nil {
		shards.Close()
		return fmt.Errorf("serve: %w", err)
	}
	inc.shards, inc.control = shards, control
	tierOn := cfg.HiCache.Enabled
	if len(s.loops) > 0 && s.loops[0].cache != nil {
		tierOn = s.loops[0].cache.Loader() != nil // as the last incarnation had it (SetHiCache)
	}
	prev := s.loops
	s.shards, s.control, s.loops = shards, control, nil
	fail := func(err error) error {
		err = errors.Join(err, s.closeTiers())
		s.closeRankPD()
		control.Close()
		shards.Close()
		s.loops = prev
		return err
	}
	hostPages := 0 // per rank, once the first rank's pool is known
	for r := range cfg.TP {
		core, err := rankcore.NewCore(sched.Config{
			MaxRunning: cfg.MaxRunning, MaxBatchTokens: cfg.MaxBatchTokens, PrefillChunk: cfg.PrefillChunk,
			PageSize: cfg.PageSize, TotalPages: cfg.Pages(),
			WaitingTimeout: cfg.WaitingTimeout, PrefillTimeout: cfg.PrefillTimeout, RequestTimeout: max(0, cfg.RequestTimeout),
			Overlap: cfg.Schedule == ScheduleOverlap,
		}, e.m.Tokenizer.IsEOG)
		if err != nil {
			return fail(fmt.Errorf("serve: %w", err))
		}
		l := &rankLoop{e: e, r: r, rk: shards.Rank(r), core: core, quit: inc.quit,
			ag: newAgreer(r, control.Rank(r), shards.Rank(r).Comm(), cfg.table(), cfg.DecisionLogLen)}
		s.loops = append(s.loops, l)
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
		}
		l.tier = newRankTier(r, cfg, l.cache, l.rk.Pool(), &e.faults, &e.hicacheBandwidth)
		l.px = newRankPrefix(r, l.cache, l.rk.Pool(), l.tier)
		l.ex = &exits{r: r, core: core, px: l.px, pd: l.pd, lp: l.pdLoop, logger: cfg.Logger, name: cfg.Name}
		if r == 0 {
			l.ex.streams = e.streams
		}
		if l.cache != nil {
			if tierOn {
				if hostPages == 0 {
					if hostPages, err = cfg.HiCache.hostPages(l.rk.Pool().Config(), cfg.TP); err != nil {
						return fail(fmt.Errorf("serve: %w", err))
					}
				}
				if err := l.tier.attach(hostPages); err != nil {
					return fail(fmt.Errorf("serve: rank %d: %w", r, err))
				}
			}
			l.tier.publish(l.px.holds)
		}
		l.beat.Store(now.UnixNano())
		l.last.Store(&StepRecord{Rank: r, Loop: LoopLockstep, Phase: "idle", Start: now, End: now})
	}
	inc.loops = s.loops
	s.inc.Store(inc)
	e.publish(*s.loops[0].last.Load())
	return nil
}

// closeRankPD closes the ranks' PD sockets.
func (s *supervisor) closeRankPD() error {
	if len(s.loops) > 0 && s.loops[0].pd != nil {
		s.loops[0].pd.releaseRooms()
	}
	var errs []error
	for _, l := range s.loops {
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
func (s *supervisor) runLoops(ctx context.Context) ([]error, *dist.Stall, []dist.Snapshot) {
	e := s.e
	inc := s.cur()
	errs := make([]error, len(s.loops))
	var wg sync.WaitGroup
	for r, l := range s.loops {
		wg.Go(func() {
			pprof.Do(ctx, pprof.Labels("rank", strconv.Itoa(r)), func(context.Context) {
				errs[r] = l.run()
			})
			if errs[r] != nil {
				// Wake the peers waiting for this rank in a collective.
				inc.giveUp()
				s.closeGroups()
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
				snaps = inc.collectives()
			}
			return errs, stalled, snaps
		case <-stop:
			inc.giveUp() // a loop held by a fault switch goes on to the stop
			stop = nil
		case <-tick: // a pace: the decision is on the engine's clock
			if stalled != nil {
				continue
			}
			now := e.now()
			for _, g := range inc.groups() {
				if ss := g.Stuck(now, e.cfg.CollectiveTimeout); len(ss) > 0 {
					stalled = &ss[0]
					break
				}
			}
			if stalled != nil {
				snaps = inc.collectives()
				inc.giveUp()
				s.closeGroups()
			}
		}
	}
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
// loop running; false means the build failed (s.err says why).
func (s *supervisor) restart(reason string, snaps []dist.Snapshot) bool {
	e := s.e
	old := s.cur()
	e.cfg.Logger.Error("engine restarted: rank group rebuilt", "server", e.cfg.Name, "role", e.cfg.Role, "cause", reason, "boot", old.boot)
	s.lastFailure.Store(&Failure{At: e.now(), Reason: reason, Boot: old.boot, Collectives: snaps})
	fin := "error: engine restarted: " + reason
	// Aborts of requests the ranks knew die with them; those of requests
	// still in the inbox wait for the next incarnation.
	e.inbox.filterAborts(func(a abortMsg) bool { return !e.streams.known(a.id) })
	for _, l := range s.loops {
		l.ex.drop(true)
	}
	e.streams.totals.Finished += uint64(e.streams.endAll(fin))
	if err := s.closeTiers(); err != nil {
		e.cfg.Logger.Error("serve: the failed rank group's host tiers", "server", e.cfg.Name, "err", err)
	}
	var endpoints []string
	for _, l := range s.loops {
		if l.pd != nil {
			endpoints = append(endpoints, l.pd.inbox.Endpoint())
		}
	}
	errs := errors.Join(s.closeRankPD(), s.control.Close(), s.shards.Close())
	if errs != nil && !errors.Is(errs, dist.ErrGroupClosed) {
		e.cfg.Logger.Warn("serve: closing the failed rank group", "server", e.cfg.Name, "err", errs)
	}
	e.streams.totals.Restarts++
	s.restarts.Add(1)
	if err := s.build(endpoints); err != nil {
		s.err = fmt.Errorf("rebuild after %s: %w", reason, err)
		return false
	}
	if e.cfg.Role == pdproto.RolePrefill && e.cfg.PD.OnRankInfos != nil {
		e.cfg.PD.OnRankInfos(e.pdView.RankInfos())
	}
	return true
}

// run is the supervisor's goroutine: it starts the rank loops, waits for
// all of them, rebuilds the group when recovery says so and finishes what
// the loops left.
func (s *supervisor) run(ctx context.Context) {
	e := s.e
	defer close(e.done)
	for {
		errs, stalled, snaps := s.runLoops(ctx)
		closing := false
		select {
		case <-e.stop:
			closing = true
		default:
		}
		var failed error
		for _, err := range errs {
			if err == nil || (closing && errors.Is(err, dist.ErrGroupClosed)) {
				continue
			}
			// A rank's own failure comes before what its peers saw of it.
			if failed == nil || errors.Is(failed, dist.ErrGroupClosed) || errors.Is(failed, dist.ErrGroupBroken) {
				failed = err
			}
		}
		// Recovery: a stalled collective, or a group broken on a mismatch
		// or a divergence, rebuilds the rank group.
		reason := ""
		switch {
		case closing:
		case stalled != nil:
			reason = stallReason(*stalled, e.cfg.CollectiveTimeout)
		case e.cfg.CollectiveTimeout > 0 && failed != nil && recoverable(failed):
			reason = failed.Error()
		}
		if reason == "" {
			s.err = failed
			break
		}
		if !s.restart(reason, snaps) {
			break
		}
	}
	s.shutdown()
}

// shutdown runs once every loop has stopped: it finishes every request
// the ranks still know or rank 0 has not taken, releasing their KV when the
// ranks stopped cleanly between steps.
func (s *supervisor) shutdown() {
	e := s.e
	pending := e.inbox.close()
	reason := ReasonClosed
	if s.err != nil {
		reason = "error: " + s.err.Error()
	}
	for _, l := range s.loops {
		l.ex.drop(s.err == nil)
	}
	e.streams.endAll(reason)
	for _, r := range pending {
		e.streams.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt)})
		for _, f := range r.forks {
			e.streams.deliver(f, Finish{Reason: reason, PromptTokens: len(f.req.Prompt)})
		}
	}
	e.publish(*s.loops[0].last.Load())
}

// close releases the last incarnation once its loops are gone (or were
// never started): the host tiers, the PD lookups and sockets, and both
// communicators.
func (s *supervisor) close() error {
	return errors.Join(s.closeTiers(), s.closePD(), s.control.Close(), s.shards.Close())
}

// closeTiers stops every rank's HiCache loader and writer once the loops
// are gone (or were never started), checks each tier's accounting against
// its cache, and gives the host pools' memory back to the OS. It returns
// what the checks found; a pool it could not close keeps its memory.
func (s *supervisor) closeTiers() error {
	var errs []error
	for _, l := range s.loops {
		if l.cache == nil {
			continue
		}
		if ld := l.cache.Loader(); ld != nil {
			ld.Close()
		}
		if w := l.cache.Writer(); w != nil {
			w.Close()
		}
		h := l.cache.Host()
		if h == nil {
			continue
		}
		if err := errors.Join(l.cache.Check(), h.Check(), h.Close()); err != nil {
			errs = append(errs, fmt.Errorf("serve: rank %d: closing the host tier: %w", l.r, err))
		}
	}
	return errors.Join(errs...)
}

// closePD stops the registry lookups and closes the ranks' sockets.
func (s *supervisor) closePD() error {
	if s.e.pd == nil {
		return nil
	}
	s.e.pd.stopLookups()
	var errs []error
	for _, l := range s.loops {
		if l.pd != nil {
			errs = append(errs, l.pd.close())
		}
	}
	return errors.Join(errs...)
}

// closeGroups wakes every rank waiting in a collective of either
// communicator; both are idempotent to close.
func (s *supervisor) closeGroups() {
	for _, g := range s.cur().groups() {
		g.Close()
	}
}
