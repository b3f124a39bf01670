package serve

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/steprate"
	"github.com/pdkit/pdkit/engine/tp"
)

// errDiverged stops the engine when the ranks planned different steps: a
// broken lock-step that would otherwise corrupt the KV silently.
var errDiverged = errors.New("serve: ranks planned different steps")

// rankLoop is one rank's event loop and everything it owns. Only its
// goroutine touches it, except beat and last, which are atomics for readers.
type rankLoop struct {
	e      *Engine
	r      int
	rk     *tp.Rank
	core   *rankcore.Core // what every rank holds alike: scheduler, tokens, fork budgets
	ex     *exits         // how requests leave the rank (end.go)
	cache  *prefix.Cache  // nil when the prefix cache is off
	tier   *rankTier      // the cache's host tier executor (tier.go)
	px     *rankPrefix    // the cache's admission and eviction executor (admission.go)
	pd     *rankPD        // nil on a colocated server
	step   uint64
	cycles cycleClock // rank 0's step cycles, for the step rates
	// pdForks are decode arrivals whose later samples fork in this
	// iteration, after the room is granted (fork.go).
	pdForks []*pdFork

	beat atomic.Int64 // unix nanoseconds of the last iteration's start
	last atomic.Pointer[StepRecord]

	// ag runs every collective of the loop's own, in its table's order,
	// and logs what was agreed (agree.go).
	ag     *agreer
	wire   []byte        // rank 0's encoding buffer
	quit   chan struct{} // closed when the group is given up or the engine stops (recover.go)
	flight *flight       // the step whose forward pass ran and has not landed (overlap.go)
}

// hold is what a request keeps in this rank's prefix cache: the cached
// prefix pages locked for it until its sequence ends, and its prefix's
// host part, pinned on host from admit until its first admission loads it
// back (LoadBack) or it ends. A nil hold keeps nothing.
type hold struct {
	matched []int32
	hm      *prefix.HostMatch
	probe   bool // a canary's: its pages go to the cache cold, first to evict
}

// locked is the number of pages h keeps locked.
func (h *hold) locked() int {
	if h == nil {
		return 0
	}
	return len(h.matched)
}

// ctx is the loops' context: a loop stuck in a collective is woken by
// closing the group, not by cancelling (a cancelled collective would leave
// the group broken for the shutdown).
var ctx = context.Background()

// run is the rank's loop. It returns nil when rank 0 broadcasts the stop.
func (l *rankLoop) run() error {
	defer func() { l.flight.wait(); l.flight = nil }()
	ran := true
	var ahead *iteration // the next front half, run beside a forward pass (overlap)
	for {
		it := ahead
		if it == nil {
			it = l.begin(ran)
		}
		ahead = nil
		if it.err != nil {
			return it.err
		}
		if it.stop {
			return nil
		}
		ran = false
		if it.p != nil {
			var err error
			if ran, ahead, err = l.back(it.p); err != nil {
				return err
			}
		}
		if l.r == 0 {
			l.e.streams.streamHeld() // what the overlap loop held back (streams.go)
		}
	}
}

// iteration is an iteration's front half as the loop takes it up: the
// agreed plan (nil when there is nothing to run), or the stop, or the error
// that ends the loop.
type iteration struct {
	p    *planned
	stop bool
	err  error
}

// planned is an iteration up to its agreed plan.
type planned struct {
	rec  StepRecord
	plan sched.Plan
}

// begin takes the next step input and runs the iteration's front half.
func (l *rankLoop) begin(ran bool) *iteration {
	in, err := l.receive(ran)
	if err != nil {
		return &iteration{err: err}
	}
	if in.stop {
		return &iteration{stop: true}
	}
	start := l.e.now()
	l.beat.Store(start.UnixNano())
	p, err := l.front(in, start)
	return &iteration{p: p, err: err}
}

// receive gets the iteration's input: rank 0 takes it from the inbox (after
// waiting for work when the last iteration ran nothing) and broadcasts it;
// every rank decodes the broadcast bytes.
func (l *rankLoop) receive(ran bool) (stepInput, error) {
	var in stepInput
	var data []byte
	if l.r == len(l.e.sup.loops)-1 {
		// The fault switch stall-last-rank: a branch on local state
		// before a collective, which the loop otherwise never takes.
		l.e.faults.waitOff(FaultStallLastRank, l.quit)
	}
	if l.r == 0 {
		if !ran {
			l.e.inbox.idle()
		}
		op := l.e.inbox.draining()
		in = l.e.takeInbox(op == nil)
		if op != nil {
			f := rankcore.DrainFacts{Scheduled: l.core.Scheduled(), Rooms: l.pd.rooms(), Handshaking: l.pd.handshaking(),
				Seqs: l.core.Len(), Joining: len(in.adds), PastBound: !l.e.now().Before(op.deadline)}
			spared := func(id uint64) bool { return l.pd.inHandshake(id) || l.pd.finishing(id) }
			if l.e.streams.drainStep(op, &in, f, spared) && l.cache != nil && l.cache.Attached() {
				var err error
				if in.indexKTier, err = l.e.cfg.tierPagesIn(l.rk.Pool().Config(), op.to); err != nil {
					l.e.cfg.Logger.Warn("serve: hicache stays off after the index-K switch", "server", l.e.cfg.Name, "err", err)
				}
			}
		}
		l.wire = in.encode(l.wire[:0])
		data = l.wire
	}
	got, err := l.ag.bytes(rankcore.Input, data)
	if err != nil {
		return in, err
	}
	if err := in.decode(got); err != nil {
		return in, fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return in, nil
}

// front is an iteration up to the plan every rank agreed on: the step
// input applied, the votes, admissions, room and plan; nil when the
// iteration has nothing to run (it is published then).
func (l *rankLoop) front(in stepInput, start time.Time) (*planned, error) {
	l.core.Begin(in.now)
	l.ag.input(l.step+1, in)
	rec := StepRecord{Rank: l.r, Loop: LoopLockstep, Step: l.step + 1, Phase: "idle", Start: start}
	overlap := l.e.cfg.Schedule == ScheduleOverlap
	if overlap {
		rec.Loop = LoopOverlap
	}
	adds, err := l.arrive(in)
	if err != nil {
		return nil, err
	}
	if !l.ag.runs(rankcore.Room, rankcore.Facts{Joining: len(adds), Scheduled: l.core.Scheduled(), Rooms: l.pd.rooms()}) {
		l.publish(rec)
		return nil, nil
	}
	if overlap && l.pd != nil && l.r == len(l.e.sup.loops)-1 && l.e.faults.onAt(idxOverlapLocal) && l.pd.localIdle(l.step+1) {
		// The fault overlap-local-decision (overlap.go): this rank goes
		// idle on its own view while its peers go on to the poll.
		l.publish(rec)
		return nil, nil
	}
	joins, err := l.poll()
	if err != nil {
		return nil, err
	}
	if err := l.admit(append(adds, joins...)); err != nil {
		return nil, err
	}
	free, rows, err := l.room(rankcore.Room)
	if err != nil {
		return nil, err
	}
	if free, err = l.pd.grantPagesSendInfo(l.pdLoop(), free, rows, l.core); err != nil {
		return nil, err
	}
	if free, err = l.pdForkAll(free); err != nil {
		return nil, err
	}
	if !l.ag.runs(rankcore.Agree, rankcore.Facts{Scheduled: l.core.Scheduled()}) {
		l.publish(rec)
		return nil, nil
	}
	plan, err := l.core.Schedule(rankcore.Capacity{Pages: free})
	if err != nil {
		return nil, fmt.Errorf("serve: rank %d: schedule: %w", l.r, err)
	}
	if l.core.Stalled(plan) {
		// Nothing runs: the head may wait on pages its followers hold.
		n, err := l.px.unstall(l.core)
		if l.r == 0 {
			l.e.streams.totals.Unstalls += uint64(n)
		}
		if err != nil {
			return nil, err
		}
	}
	rec.Digest = rankcore.PlanDigest(rec.Step, plan.Run)
	if err := l.agree(rec.Digest); err != nil {
		return nil, err
	}
	if overlap && l.flight != nil {
		if n := l.px.evictFor(plan); l.r == 0 {
			l.e.streams.totals.PrefixEvictions += uint64(n)
		}
	}
	return &planned{rec: rec, plan: plan}, nil
}

// back is the rest of an iteration from its agreed plan: the lock-step
// loop runs the step and ends it; the overlap loop lands the step before
// and flies this one (fly), returning the next iteration's front half,
// which ran beside it.
func (l *rankLoop) back(p *planned) (bool, *iteration, error) {
	rec, plan := p.rec, p.plan
	overlap := l.e.cfg.Schedule == ScheduleOverlap
	// The overlap loop lands the step in flight now, with N+1 planned
	// (overlap.go); what stopped or was cut in it leaves N+1's batch.
	landed, err := l.landFront()
	if err != nil {
		return false, nil, err
	}
	if landed != nil {
		plan = rankcore.DropVoided(plan, landed.voided)
		if len(plan.Run) > 0 && l.r == 0 {
			l.e.streams.totals.PlannedAhead++
		}
		if len(plan.Run) == 0 {
			// Nothing to start next: end the landed step now, and if
			// nothing could be planned ahead (the scheduler does not
			// retract with a step in flight), plan again as the
			// lock-step loop would rather than wait for the next input.
			if err := l.landBack(landed); err != nil {
				return false, nil, err
			}
			landed = nil
			if l.ag.runs(rankcore.Room, rankcore.Facts{Replan: true, Scheduled: l.core.Scheduled()}) {
				if plan, err = l.replan(&rec); err != nil {
					return false, nil, err
				}
			}
		}
	}
	if err := l.ex.finish(plan.Finished); err != nil {
		return false, nil, err
	}
	l.core.Retracted(plan)
	for _, rt := range plan.Retract {
		if err := l.px.release(rt.ID, l.core.Seq(rt.ID).Tokens); err != nil {
			return false, nil, fmt.Errorf("serve: rank %d: release retracted %d: %w", l.r, rt.ID, err)
		}
		if l.r == 0 {
			l.e.streams.totals.Retractions++
		}
	}
	rec.Retracted = len(plan.Retract)
	if !l.ag.runs(rankcore.Forward, rankcore.Facts{Batch: len(plan.Run)}) {
		if err := l.landBack(landed); err != nil {
			return false, nil, err
		}
		l.publish(rec)
		return false, nil, nil
	}

	batch, err := l.prepare(plan, &rec)
	if err != nil {
		return false, nil, err
	}
	if overlap {
		ahead, err := l.fly(plan, batch, rec, landed)
		return true, ahead, err
	}
	if err := l.forward(batch, &rec); err != nil {
		return false, nil, fmt.Errorf("serve: rank %d: step %d: %w", l.r, rec.Step, err)
	}
	if err := l.tier.settle(); err != nil {
		return false, nil, err
	}
	if l.r == 0 {
		l.e.streams.totals.Steps++
		l.e.streams.totals.Tokens += uint64(rec.BatchTokens)
	}
	out, err := l.results(plan)
	if err != nil {
		return false, nil, err
	}
	if err := l.apply(plan, out, false); err != nil {
		return false, nil, err
	}
	rec = l.publish(rec)
	if o := l.e.cfg.Observer; o != nil && l.r == 0 {
		o.StepFinished(rec)
	}
	return true, nil, nil
}

// arrive applies the step input without a collective: PD requests go to
// the PD machine; a new request the same input aborts ends at once;
// aborts and the scheduler's timeouts apply; then the rank files its PD
// mail. It returns the other new requests, which the iteration's admit
// adds to the scheduler.
func (l *rankLoop) arrive(in stepInput) ([]addMsg, error) {
	if in.tier != nil {
		if err := l.tier.apply(*in.tier, l.px.holds, l.core); err != nil {
			return nil, err
		}
	}
	if in.switchIndexK {
		if err := l.applyIndexK(in.indexK, in.indexKTier); err != nil {
			return nil, err
		}
	}
	if in.offload != nil {
		res, err := l.tier.offload(in.offload)
		if err != nil {
			return nil, err
		}
		if res != nil && l.r == 0 {
			l.e.inbox.offloaded(*res)
		}
	}
	var adds []addMsg
	for _, a := range in.adds {
		l.core.Expect(a.id, a.n)
		switch {
		case a.pd && l.pd != nil:
			if err := l.pd.admit(l.core.Now(), a); err != nil {
				return nil, err
			}
		case slices.ContainsFunc(in.aborts, func(x abortMsg) bool { return x.id == a.id }):
			l.ex.end(a.id, ending{reason: sched.ReasonAbort})
		default:
			adds = append(adds, a)
		}
	}
	for _, a := range in.aborts {
		if err := l.ex.cut(a.id, a.by.String()); err != nil {
			return nil, err
		}
	}
	if err := l.ex.finish(l.core.Tick()); err != nil {
		return nil, err
	}
	if l.pd.rooms() > 0 {
		if err := l.pd.observe(l.pdLoop()); err != nil {
			return nil, err
		}
	}
	return adds, nil
}

// pdLoop is what the PD executor takes from the loop for one call: the
// clock, the pool and cache, and the loop's effects it runs in order.
func (l *rankLoop) pdLoop() pdLoop {
	return pdLoop{now: l.core.Now(), pool: l.rk.Pool(), cache: l.cache, cut: l.ex.cut, end: l.ex.end, join: l.joinArrival}
}

// joinArrival takes a decode request on once its prompt's KV is committed
// in seq (the PD executor's Arrived): its stream's first token tok (the
// prefill's), its later samples' fork, then the scheduler, or its end at
// that token.
func (l *rankLoop) joinArrival(add addMsg, tok int32, seq *kvcache.Seq) error {
	pool := l.rk.Pool()
	if l.r == 0 {
		l.e.streams.emitFirst(add.id, tok)
	}
	// The later samples (Request.N > 1) fork from this KV once the ranks
	// agreed on the room for them (pdForkAll); the sequence stays until
	// then even when this sample ends here.
	release := pool.Release
	if k := l.core.TakeForks(add.id); k > 0 {
		f := pdFork{add: add, n: k}
		l.pdForks = append(l.pdForks, &f)
		release = func(*kvcache.Seq) error { f.release = true; return nil }
	}
	st := add.seq()
	stop := l.core.StopsAt(st, tok)
	if stop || add.maxTokens == 1 {
		reason := sched.ReasonLength
		if stop {
			reason = sched.ReasonStop
		}
		l.ex.end(add.id, ending{reason: reason})
		return release(seq)
	}
	st.Tokens, st.Decoding = append(st.Tokens, tok), true
	err := l.core.Join(sched.Request{ID: add.id, PromptLen: len(add.prompt) + 1, MaxTokens: add.maxTokens - 1, Transferred: len(add.prompt)}, st)
	if err != nil {
		l.ex.end(add.id, ending{reason: sched.ReasonError, err: err.Error()})
		return release(seq)
	}
	return nil
}

// cycleClock times a loop's cycles: from the end of one step to the
// next's, when both decoded (a batch ran on the whole time, so the loop
// never waited for requests in between).
type cycleClock struct {
	busyEnd time.Time // when the last decoding step ended; zero after any other
}

// record adds rec's cycle, if it has one, to rates.
func (c *cycleClock) record(rates *steprate.Tracker, rec StepRecord) {
	decoding := rec.Phase == "decode" || rec.Phase == "mixed"
	if decoding && !c.busyEnd.IsZero() {
		rates.AddCycle(rec.Phase, rec.BatchTokens, rec.End.Sub(c.busyEnd))
	}
	c.busyEnd = time.Time{}
	if decoding {
		c.busyEnd = rec.End
	}
}

// publish ends an iteration: the rank's step record, and on rank 0 the
// engine snapshot. It returns the record as published.
func (l *rankLoop) publish(rec StepRecord) StepRecord {
	l.step++
	rec.Finished, rec.End = len(l.core.Ended()), l.e.now()
	l.ag.published(&rec)
	l.last.Store(&rec)
	l.pd.publish(l.core.Now())
	l.tier.publish(l.px.holds)
	if l.r == 0 {
		d := rec.End.Sub(rec.Start)
		if !rec.ForwardEnd.IsZero() {
			d = rec.ForwardEnd.Sub(rec.ForwardStart) // the overlap loop's forward runs past its iteration
		}
		l.e.rates.Add(rec.Phase, rec.BatchTokens, d)
		l.cycles.record(&l.e.rates, rec)
		l.e.publish(rec)
	}
	return rec
}
