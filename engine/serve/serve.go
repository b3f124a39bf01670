// Package serve is the colocated serving engine: prefill and decode in one
// process, over TP ranks. There is no HTTP here; the HTTP server calls
// [Engine.Submit].
//
// # One loop per rank
//
// Each TP rank runs its own event loop goroutine (pprof labels server, role
// and rank) with its own core (rankcore.Core: the scheduler, every
// request's tokens and stop rules, the fork budgets, which requests ended;
// the state every rank holds alike), its own KV pool, its own radix prefix
// cache (engine/prefix), its shard of the weights (engine/tp) and, on a
// prefill or decode server, its own PD queue machine (engine/pd/rooms).
// The loop does the I/O around the core: the pool's pages, the forward
// pass, the sockets, the streams. The loops move in lock-step through two communicators
// of the rank group (engine/dist): "control" for the loop's agreements and
// "forward" for the model's collectives. The order of an iteration's
// collectives is a table in engine/rankcore (rankcore.Lockstep,
// rankcore.Overlap; its package doc prints both): in each phase every rank
// proposes a value (its PD votes, its prefix matches, its free pages, its
// plan's digest; rank 0 its inbox and its sampled tokens), the group
// reduces or broadcasts it, and every rank applies the agreed value. The
// loop enters each phase through its rank's agreer (agree.go), whose
// rankcore.Cursor refuses a phase out of the table's order and says
// whether the phase runs at all (the row's condition, on agreed facts),
// and tags the collective with the phase's name, which the flight
// recorder keeps and the collective layer checks across ranks.
// In words: rank 0 broadcasts the step input; every rank applies it (PD
// requests to the PD machine, aborts, timeouts, its own PD mail); the
// ranks agree on the PD votes, the prefix matches of the requests that
// join, the room (a decode grants pages to its transfers within it) and
// the plan's digest (a divergence stops the engine); each rank runs its
// shard of the batch; rank 0 samples, streams and broadcasts the tokens
// with the aborts that came during the step; every rank applies them,
// sends the step's KV (prefill), forks samples, finishes what stopped and
// publishes its step record.
//
// # PD
//
// On a prefill or decode server each rank's engine/pd/rooms machine holds
// the PD life of every request (its package doc and testdata/ traces tell
// it); this package is its executor: it files mail and peer liveness into
// the machine, reduces the machine's votes across the ranks, and carries
// out the actions it returns (reserve and release pages, write landed KV,
// send messages, join the scheduler, end streams). A send that fails is
// the rank's vote of Failed with the send error, so every rank fails the
// room in the same iteration with the real cause.
//
// The rule, which every change to the loop must keep: every decision that
// precedes a collective or changes queue or allocator state is taken from
// values all ranks agree on: broadcast by rank 0 or reduced over the
// group. No rank branches on its own state (its clock, its inbox, its
// pool) before a collective. Rank 0's local state (the inbox, the streams,
// its clock) enters the other ranks only through its broadcasts.
//
// # Streams
//
// Each [Stream] carries an event channel of capacity MaxTokens+1: one slot
// per token it can ever produce plus one for the Finish, after which the
// channel is closed. A slow reader therefore never stalls the loop; should a
// send ever find the buffer full all the same, rank 0 does not block: it
// aborts the request with reason "error: reader too slow".
//
// # Samples
//
// A request of N > 1 samples ([Engine.SubmitN]) reserves N consecutive ids
// and gives one stream per sample; aborting any of them, or its context
// ending, aborts all. The ranks admit and prefill the first sample only. On
// a colocated server, at its first token rank 0 samples N first tokens from
// the same logits (sample i seeded with Seed+i) and broadcasts them, and
// every rank forks N-1 sequences holding a copy of the prompt's KV, which
// join the scheduler as a PD decode arrival does. On a decode server the
// one transfer brings the prompt's KV and the first sample's token; each
// other sample starts on a copy of all but the prompt's last token and
// samples its own first token after running that one token. The room to
// fork in is MIN-reduced over the ranks; fork.go tells the rest.
//
// # Reading the engine from outside
//
// After every iteration each rank publishes an immutable [StepRecord] (with
// the sequence numbers of its last collective on each communicator) and rank 0 an
// [EngineSnapshot] (its scheduler's queues, copied by the loop itself),
// through atomic pointers, plus heartbeat times. [Engine.View] reads them:
// [View.LastStep], [View.RankSteps], [View.Snapshot], [View.Health],
// [View.KVPages] and [View.Collectives] read only atomics: no locks, no help
// from the loops, so they answer while a loop is stuck; [Engine.PD] reads
// the PD side alike. Each rank also keeps a decision log, its last
// iterations' agreed inputs and decisions, which [View.Decisions] reads,
// stuck loops included (decisions.go). For latencies,
// [Config.Observer] is told of every token, finished request and forward
// step, on rank 0's goroutine, with the loop's timestamps.
//
// # Prefix cache
//
// A new request's prompt (all but its last token) is matched against each
// rank's cache when it arrives; the matched pages stay locked while it
// waits, it is admitted at the matched length and shares those pages. A
// finished or retracted sequence gives its full pages to the cache; a
// retracted request gives its prefix up and is recomputed from position 0.
// Cached pages that nothing uses are evicted, least recently used first,
// when a step needs the room. When nothing runs and the head of the queue
// does not fit because the requests waiting behind it hold the pool's
// pages locked, the newest of them give their cached prefixes up until it
// fits (Totals.Unstalls). What each rank keeps of its match once the ranks
// agreed, and who gives up, are engine/rankcore's decisions (PlanAdmit,
// Unstall); the rank's prefix executor (admission.go) runs them.
//
// With HiCache (Config.HiCache) each rank's cache has a host tier: pages are
// backed up to host memory by a writer goroutine and loaded back, layer by
// layer, while the forward pass runs; host hits are MIN-reduced with the
// match in step 3, the load starts at the request's first admission, the
// forward pass reads its pages through per-layer KV and index-K gates, and
// the load settles before anything else reads them. hicache.go tells it.
//
// # Recovery
//
// With Config.CollectiveTimeout set, a collective that waits past it, or a
// group that broke on a mismatch, does not end the engine: the supervisor
// gives the group up, ends the requests in flight with the reason, frees
// their pages, rebuilds the ranks with a new PD boot number and serves again
// (recover.go; View.LastFailure keeps what the failed group looked like).
// Without it, an engine whose step fails finishes every request with an
// error and must be rebuilt.
//
// # Overlap
//
// With Config.Schedule = ScheduleOverlap a goroutine beside each rank's
// forward pass runs the next iteration's front half and plans it against
// the step's predicted outcome; the step lands before the next one starts,
// and what stopped in it leaves the next batch (overlap.go). The decisions
// and their values are the lock-step loop's. ResolveSchedule says which
// loop suits a machine.
//
// Stop sequences are token ids (Request.Stop); stop strings belong to the
// HTTP layer that owns detokenization.
package serve

import (
	"context"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/steprate"
)

// Engine is the serving engine. Its methods are safe for concurrent use.
//
// It wires together owners that each have one job and one rule for who
// touches them, so that each rule can be read off one type: the inbox
// (any goroutine puts, rank 0 takes, under the inbox's own lock), the
// streams (rank 0's loop while it runs, the supervisor when none does),
// the supervisor (the incarnation, written only while no loop runs), the
// PD state (atomic or locked, any goroutine) and the two views (only what
// any goroutine may read while a loop is stuck). The Engine keeps
// construction, the public entry points (submit.go, switches.go, Close)
// and what every owner shares: the config, the clock, the fault switches
// and the settings an operator changes live.
type Engine struct {
	m      *model.Model
	cfg    Config
	epoch  time.Time // cfg.Clock's time at New: the origin of clock()
	vocab  int
	nextID atomic.Uint64

	inbox   *inbox      // what waits for rank 0's next step input
	streams *streams    // rank 0's side of every request the ranks know
	sup     *supervisor // the rank group's life: build, run, recover, shut down
	pd      *pdEngine   // nil on a colocated server
	view    *View
	rates   steprate.Tracker // rank 0's step times by phase and batch size (View.StepRates)
	pdView  *PDView

	faults           faultSet
	hicacheBandwidth atomic.Int64                   // the loaders' pacing, bytes/s (0 unlimited)
	indexK           atomic.Int32                   // the index-K precision now (kernels.IndexKDType)
	snap             atomic.Pointer[EngineSnapshot] // rank 0's, as publish last stored it

	stop     chan struct{}
	done     chan struct{} // closed once every loop has stopped and shutdown ran
	once     sync.Once
	closeErr error
}

// New builds the ranks (cfg.TP of them, each with the kernels of
// cfg.Backend), their schedulers and prefix caches, and the two
// communicators of the TP group, and starts one loop goroutine per rank,
// which run until Close.
//
// The ranks talk over two communicators: "forward", the model's own
// collectives inside a forward pass, and "control", the loop's agreements
// (the step input, the poll and free-page reductions, the prefix match,
// the plan digest and the step output). Each has its own sequence numbers,
// flight recorder and watchdog, so an operator sees which of the two a
// wedged rank waits in, and a loop that prepares the next step while the
// forward runs never interleaves its calls with the model's.
func New(m *model.Model, cfg Config) (*Engine, error) {
	cfg.setDefaults(m)
	if err := cfg.Validate(m); err != nil {
		return nil, err
	}
	e := &Engine{
		m: m, cfg: cfg, epoch: cfg.Clock.Now(), vocab: m.Config.VocabSize,
		stop: make(chan struct{}), done: make(chan struct{}),
	}
	e.inbox = newInbox(e.stop, e.cfg.Heartbeat)
	e.sup = &supervisor{e: e}
	e.view = &View{cfg: &e.cfg, m: m, sup: e.sup, inbox: e.inbox, snap: &e.snap, faults: &e.faults, rates: &e.rates,
		indexK: &e.indexK, hicacheBandwidth: &e.hicacheBandwidth}
	for _, name := range cfg.Faults {
		e.faults.set(faultIndex(name), true) // checked by Validate
	}
	e.hicacheBandwidth.Store(cfg.HiCache.LoadBandwidth)
	e.indexK.Store(int32(cfg.IndexK))
	if cfg.Role != pdproto.RoleColocated {
		pd, err := newPDEngine(&e.cfg, e.view.decodeInfo)
		if err != nil {
			return nil, err
		}
		e.pd = pd
	}
	e.pdView = &PDView{pd: e.pd, sup: e.sup, role: cfg.Role}
	e.streams = &streams{observer: cfg.Observer, inbox: e.inbox, pd: e.pd, prefill: cfg.Role == pdproto.RolePrefill, now: e.now,
		front: make(map[uint64]*request)}
	if err := e.sup.build(nil); err != nil {
		if e.pd != nil {
			e.pd.stopLookups()
		}
		return nil, err
	}
	go pprof.Do(context.Background(), pprof.Labels("server", cfg.Name, "role", cfg.Role), func(ctx context.Context) { e.sup.run(ctx) })
	return e, nil
}

// clock is the engine's agreed time: rank 0 reads it and broadcasts it,
// and every deadline of the scheduler and the PD machine is judged on it.
// It is Config.Clock's time since New.
func (e *Engine) clock() time.Duration {
	return e.now().Sub(e.epoch)
}

// now is Config.Clock's time, for what one rank or the supervisor judges
// alone (a drain bound, the mailbox's liveness, the collective timeout)
// and for the records' timestamps.
func (e *Engine) now() time.Time { return e.cfg.Clock.Now() }

// Config returns the effective configuration.
func (e *Engine) Config() Config { return e.cfg }

// View reads the engine's state from any goroutine, lock-free (see View).
func (e *Engine) View() *View { return e.view }

// PD reads the engine's PD side from any goroutine, lock-free (see PDView).
func (e *Engine) PD() *PDView { return e.pdView }

// takeInbox is rank 0's step input: its clock, the stop, and what the
// inbox holds, whose new requests it registers in the streams; without
// admit (an index-K switch drains the engine) the new requests stay in
// the inbox.
func (e *Engine) takeInbox(admit bool) stepInput {
	in := stepInput{now: e.clock()}
	select {
	case <-e.stop:
		in.stop = true
		return in
	default:
	}
	pending, aborts, tier, offload := e.inbox.take(admit, e.streams.known)
	in.tier, in.offload = tier, offload
	in.adds = e.streams.register(pending, in.adds)
	in.aborts = e.streams.cut(aborts, in.aborts)
	return in
}

// publish stores rank 0's snapshot; called by rank 0's loop and by the
// supervisor (a build, the shutdown) while no loop runs.
func (e *Engine) publish(rec StepRecord) {
	s := &EngineSnapshot{Taken: e.now(), Step: rec, Queue: e.sup.loops[0].core.Snapshot(), Totals: e.streams.totals}
	if e.sup.err != nil {
		s.Err = e.sup.err.Error()
	}
	e.snap.Store(s)
}

// Close stops the loops at their next iteration, finishes every request
// still known with "error: engine closed" and closes the ranks. A loop that
// does not stop within Config.CloseTimeout (stuck in a collective) is woken
// by closing the rank group. It is idempotent.
func (e *Engine) Close() error {
	e.once.Do(func() {
		close(e.stop)
		e.inbox.poke()
		t := e.cfg.Clock.NewTimer(e.cfg.CloseTimeout)
		select {
		case <-e.done:
		case <-t.C():
			e.sup.closeGroups()
			<-e.done
		}
		t.Stop()
		e.closeErr = e.sup.close()
	})
	return e.closeErr
}
