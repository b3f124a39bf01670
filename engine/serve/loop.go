package serve

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/tp"
)

// errDiverged stops the engine when the ranks planned different steps: a
// broken lock-step that would otherwise corrupt the KV silently.
var errDiverged = errors.New("serve: ranks planned different steps")

// rankLoop is one rank's event loop and everything it owns. Only its
// goroutine touches it, except beat and last, which are atomics for readers.
type rankLoop struct {
	e     *Engine
	r     int
	rk    *tp.Rank
	sched *sched.Scheduler
	cache *prefix.Cache // nil when the prefix cache is off
	tier  rankTier      // the cache's host tier, as readers see it (hicache.go)
	pd    *rankPD       // nil on a colocated server
	seqs  map[uint64]*seqState
	step  uint64
	// forks is, by parent id, the number of later samples (Request.N > 1)
	// not forked yet: they fork at the parent's first token (fork.go).
	forks map[uint64]int
	// pdForks are decode arrivals whose later samples fork in this
	// iteration, after the room is granted (fork.go).
	pdForks []*pdFork

	beat atomic.Int64 // unix nanoseconds of the last iteration's start
	last atomic.Pointer[StepRecord]

	// cursor is where the rank is in its loop's table: every collective
	// the loop runs itself enters its phase there first (agreeInts,
	// agreeBytes), so none runs out of the table's order.
	cursor   *rankcore.Cursor
	wire     []byte        // rank 0's encoding buffer
	dlog     *decisionLog  // the rank's decision log (decisions.go)
	quit     chan struct{} // closed when the group is given up or the engine stops (recover.go)
	dbuf     []byte        // the step input re-encoded for its digest
	gated    hicache.Loads // the loads the step's forward pass reads through gates
	flight   *flight       // the step whose forward pass ran and has not landed (overlap.go)
	mailSeen uint64        // the mailbox's filed count at the last localIdle (overlap.go)
	now      time.Duration
	finished int // requests finished in the current iteration
}

// seqState is what every rank knows of a request.
type seqState struct {
	all       []int32 // prompt, then generated tokens
	maxTokens int
	ignoreEOS bool
	stop      []int32
	decoding  bool    // prefilled since its last admission
	cut       bool    // aborted; its outcome is ignored
	matched   []int32 // cached prefix pages locked for it, until its sequence ends
	// hm is its prefix's host part, pinned on host from admit until its
	// first admission loads it back (LoadBack) or it ends.
	hm *prefix.HostMatch
}

// ctx is the loops' context: a loop stuck in a collective is woken by
// closing the group, not by cancelling (a cancelled collective would leave
// the group broken for the shutdown).
var ctx = context.Background()

// comm is the rank's control communicator: every collective the loop runs
// itself goes there; the forward pass's own run on the rank's forward one.
func (l *rankLoop) comm() *dist.Comm { return l.e.control.Rank(l.r) }

// phaseCtx is the loops' context tagged with each phase's name, which the
// flight recorder keeps and the collective layer checks across ranks.
var phaseCtx = func() (c [rankcore.NumPhases]context.Context) {
	for _, p := range rankcore.Phases() {
		c[p] = dist.WithTag(ctx, p.String())
	}
	return c
}()

// table is the loop's table of phases (engine/rankcore).
func (c Config) table() *rankcore.Table {
	if c.Schedule == ScheduleOverlap {
		return &rankcore.Overlap
	}
	return &rankcore.Lockstep
}

// agreeInts runs phase p's reduction of the rank's proposal vals, as its
// table says, and notes the agreed values in the decision log.
func (l *rankLoop) agreeInts(p rankcore.Phase, vals []int64) error {
	if err := l.cursor.Enter(p); err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	var err error
	switch p.Op() {
	case dist.OpAllReduceMin:
		err = l.comm().AllReduceMinInt(phaseCtx[p], vals)
	case dist.OpAllReduceMax:
		err = l.comm().AllReduceMaxInt(phaseCtx[p], vals)
	default:
		return fmt.Errorf("serve: rank %d: phase %s is no reduction", l.r, p)
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: %s: %w", l.r, p, err)
	}
	l.note(p, vals)
	return nil
}

// agreeBytes runs phase p's broadcast of rank 0's data, as its table says;
// the caller notes what it decoded.
func (l *rankLoop) agreeBytes(p rankcore.Phase, data []byte) ([]byte, error) {
	if err := l.cursor.Enter(p); err != nil {
		return nil, fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	if p.Op() != dist.OpBroadcast {
		return nil, fmt.Errorf("serve: rank %d: phase %s is no broadcast", l.r, p)
	}
	got, err := l.comm().BroadcastBytes(phaseCtx[p], 0, data)
	if err != nil {
		return nil, fmt.Errorf("serve: rank %d: %s: %w", l.r, p, err)
	}
	return got, nil
}

// enterForward enters the forward pass in the table before its first
// collective on the forward communicator.
func (l *rankLoop) enterForward() error {
	if err := l.cursor.Enter(rankcore.Forward); err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return nil
}

// run is the rank's loop. It returns nil when rank 0 broadcasts the stop.
func (l *rankLoop) run() error {
	defer l.waitFlight()
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
			l.e.streamHeld() // what the overlap loop held back (emit.go)
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
	start := time.Now()
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
	if l.r == len(l.e.loops)-1 {
		// The fault switch stall-last-rank: a branch on local state
		// before a collective, which the loop otherwise never takes.
		l.e.faults.waitOff(FaultStallLastRank, l.quit)
	}
	if l.r == 0 {
		if !ran {
			l.e.idle()
		}
		op := l.e.draining()
		in = l.e.takeInbox(op == nil)
		if op != nil {
			l.drainStep(op, &in)
		}
		l.wire = in.encode(l.wire[:0])
		data = l.wire
	}
	got, err := l.agreeBytes(rankcore.Input, data)
	if err != nil {
		return in, err
	}
	if err := in.decode(got); err != nil {
		return in, fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return in, nil
}

// idle waits, on rank 0, until the inbox changes, the heartbeat passes or
// the engine closes.
func (e *Engine) idle() {
	t := time.NewTimer(e.cfg.Heartbeat)
	defer t.Stop()
	select {
	case <-e.stop:
	case <-e.wake:
	case <-t.C:
	}
}

// takeInbox empties the inbox into a step input and registers the new
// requests' fronts; without admit (an index-K switch drains the engine) the
// new requests stay in the inbox.
func (e *Engine) takeInbox(admit bool) stepInput {
	in := stepInput{now: e.clock()}
	select {
	case <-e.stop:
		in.stop = true
		return in
	default:
	}
	e.mu.Lock()
	pending, aborts := e.pending, e.aborts
	e.pending, e.aborts = nil, nil
	if admit {
		e.numPending.Store(0)
		e.oldestPending.Store(0)
	} else {
		// Draining: the new requests wait in the inbox, and so do the
		// aborts of those (they apply once the requests are taken).
		e.pending, pending = pending, nil
		keep := aborts[:0]
		for _, a := range aborts {
			if e.front[a.id] == nil {
				e.aborts = append(e.aborts, a)
			} else {
				keep = append(keep, a)
			}
		}
		aborts = keep
	}
	in.tier, e.tierOp = e.tierOp, nil
	if op := e.offloadOp; op != nil {
		in.offload = op.prompt // the op stays until rank 0 has run it
	}
	e.mu.Unlock()
	for _, r := range pending {
		e.front[r.id] = r
		for _, f := range r.forks {
			e.front[f.id] = f
		}
		a := addMsg{id: r.id, maxTokens: r.req.MaxTokens, ignoreEOS: r.req.IgnoreEOS, prompt: r.req.Prompt, stop: r.req.Stop, n: 1 + len(r.forks), noCache: r.req.NoCache}
		if pd := r.req.PD; pd != nil {
			a.pd, a.room, a.url = true, pd.Room, pd.BootstrapURL
			if e.cfg.Role == pdproto.RolePrefill {
				a.maxTokens = 1 // the prefill samples the first token only
			}
		}
		in.adds = append(in.adds, a)
	}
	for _, a := range aborts {
		if r := e.front[a.id]; r != nil && r.cut == "" {
			r.cut = ReasonAbort
			in.aborts = append(in.aborts, a)
		}
	}
	return in
}

// takeAborts, on rank 0 during a step, takes the aborts of requests the
// ranks know and leaves the others (for requests still in the inbox) for
// the next step input.
func (e *Engine) takeAborts() []abortMsg {
	e.mu.Lock()
	defer e.mu.Unlock()
	var cuts []abortMsg
	keep := e.aborts[:0]
	for _, a := range e.aborts {
		r, known := e.front[a.id]
		switch {
		case !known:
			keep = append(keep, a)
		case r.cut == "":
			r.cut = ReasonAbort
			if a.by == AbortBySlowReader {
				r.cut = ReasonSlowReader
			}
			cuts = append(cuts, a)
		}
	}
	e.aborts = keep
	return cuts
}

// front is an iteration up to the plan every rank agreed on: the step
// input applied, the votes, admissions, room and plan; nil when the
// iteration has nothing to run (it is published then).
func (l *rankLoop) front(in stepInput, start time.Time) (*planned, error) {
	l.now, l.finished = in.now, 0
	l.noteInput(in)
	rec := StepRecord{Rank: l.r, Loop: LoopLockstep, Step: l.step + 1, Phase: "idle", Start: start}
	overlap := l.e.cfg.Schedule == ScheduleOverlap
	if overlap {
		rec.Loop = LoopOverlap
	}
	adds, err := l.arrive(in)
	if err != nil {
		return nil, err
	}
	if len(adds) == 0 && l.sched.Len() == 0 && l.pdRooms() == 0 {
		l.publish(rec)
		return nil, nil
	}
	if overlap && l.localIdle() {
		// The fault overlap-local-decision (overlap.go): this rank goes
		// idle on its own view while its peers go on to the poll.
		l.publish(rec)
		return nil, nil
	}
	if err := l.poll(); err != nil {
		return nil, err
	}
	if l.pd != nil {
		adds, l.pd.joins = append(adds, l.pd.joins...), nil
	}
	if err := l.admit(adds); err != nil {
		return nil, err
	}
	free, err := l.room()
	if err != nil {
		return nil, err
	}
	if free, err = l.pdForkAll(free); err != nil {
		return nil, err
	}
	if l.sched.Len() == 0 {
		l.publish(rec)
		return nil, nil
	}
	plan, err := l.sched.Schedule(l.now, free)
	if err != nil {
		return nil, fmt.Errorf("serve: rank %d: schedule: %w", l.r, err)
	}
	if len(plan.Run) == 0 && l.sched.Admitted() == 0 {
		if err := l.unstall(); err != nil {
			return nil, err
		}
	}
	rec.Digest = rankcore.PlanDigest(rec.Step, plan.Run)
	if err := l.agree(rec.Digest); err != nil {
		return nil, err
	}
	if overlap && l.flight != nil {
		l.evictFor(plan)
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
		dropVoided(&plan, landed.voided)
		if len(plan.Run) > 0 && l.r == 0 {
			l.e.totals.PlannedAhead++
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
			if l.sched.Len() > 0 {
				if plan, err = l.replan(&rec); err != nil {
					return false, nil, err
				}
			}
		}
	}
	if err := l.finish(plan.Finished); err != nil {
		return false, nil, err
	}
	for _, rt := range plan.Retract {
		s := l.seqs[rt.ID]
		if err := l.release(rt.ID, s); err != nil {
			return false, nil, fmt.Errorf("serve: rank %d: release retracted %d: %w", l.r, rt.ID, err)
		}
		s.decoding = false
		if l.r == 0 {
			l.e.totals.Retractions++
		}
	}
	rec.Retracted = len(plan.Retract)
	if len(plan.Run) == 0 {
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
	if err := l.settle(); err != nil {
		return false, nil, err
	}
	if l.r == 0 {
		l.e.totals.Steps++
		l.e.totals.Tokens += uint64(rec.BatchTokens)
	}
	out, err := l.results(plan)
	if err != nil {
		return false, nil, err
	}
	if err := l.apply(plan, out); err != nil {
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
		if err := l.applyTier(*in.tier); err != nil {
			return nil, err
		}
	}
	if in.switchIndexK {
		if err := l.applyIndexK(in.indexK, in.indexKTier); err != nil {
			return nil, err
		}
	}
	if in.offload != nil {
		if err := l.applyOffload(in.offload); err != nil {
			return nil, err
		}
	}
	var adds []addMsg
	for _, a := range in.adds {
		if a.n > 1 {
			if l.forks == nil {
				l.forks = make(map[uint64]int)
			}
			l.forks[a.id] = a.n - 1
		}
		switch {
		case a.pd && l.pd != nil:
			if err := l.pdAdmit(a); err != nil {
				return nil, err
			}
		case slices.ContainsFunc(in.aborts, func(x abortMsg) bool { return x.id == a.id }):
			l.end(a.id, ending{reason: sched.ReasonAbort})
		default:
			adds = append(adds, a)
		}
	}
	for _, a := range in.aborts {
		if err := l.cut(a.id, a.by.String()); err != nil {
			return nil, err
		}
	}
	if err := l.finish(l.sched.Tick(l.now)); err != nil {
		return nil, err
	}
	if l.pdRooms() > 0 {
		if err := l.pdObserve(); err != nil {
			return nil, err
		}
	}
	return adds, nil
}

// pdRooms is the number of PD rooms the ranks hold (the same on every
// rank).
func (l *rankLoop) pdRooms() int {
	if l.pd == nil {
		return 0
	}
	return l.pd.machine.Len()
}

// pdHandshaking counts the PD rooms still in the handshake, which an
// index-K switch does not wait for.
func (l *rankLoop) pdHandshaking() int {
	if l.pd == nil {
		return 0
	}
	return l.pd.machine.Handshaking()
}

// pdInHandshake reports whether request id is a PD room still in the
// handshake.
func (l *rankLoop) pdInHandshake(id uint64) bool {
	return l.pd != nil && l.pd.machine.InHandshake(id)
}

// pdFinishing reports whether request id is a PD room that waits only for
// its peer's word or its deadline.
func (l *rankLoop) pdFinishing(id uint64) bool {
	return l.pd != nil && l.pd.machine.Finishing(id)
}

// poll is the PD rooms' vote: every rank votes a KVPoll per room from what
// it alone knows, the ranks MIN-reduce the vector (its length, the number
// of rooms, is agreed), and every rank applies the same agreed votes.
func (l *rankLoop) poll() error {
	n := l.pdRooms()
	if n == 0 {
		return nil
	}
	votes := l.pd.machine.Votes(l.now)
	if err := l.agreeInts(rankcore.Poll, votes); err != nil {
		return err
	}
	acts, err := l.pd.machine.Apply(l.now, votes)
	if err != nil {
		return fmt.Errorf("serve: rank %d: pd poll: %w", l.r, err)
	}
	return l.pdExec(acts)
}

// room MIN-reduces what every rank could allocate (free pages plus unused
// cached pages) and its free sequence rows, gives the decode's PD rooms
// their pages within that, and returns the pages left for the scheduler.
func (l *rankLoop) room() (int, error) {
	pool := l.rk.Pool()
	reduced := []int64{int64(l.freePages()), int64(pool.Config().MaxSeqs - pool.Live())}
	if err := l.agreeInts(rankcore.Room, reduced); err != nil {
		return 0, err
	}
	free := int(reduced[0])
	if l.pd == nil {
		return free, nil
	}
	b := rooms.Budget{FreePages: free, FreeRows: int(reduced[1]), SchedSlots: l.e.cfg.MaxRunning - l.sched.Admitted()}
	if g := l.e.cfg.PD.ReservedDecodeTokens; g >= 0 {
		b.SchedGrowth = l.sched.Reserve(g)
	}
	free, acts := l.pd.machine.Grant(l.now, b)
	return free, l.pdExec(acts)
}

// admit adds the new requests, each at the length of its cached prefix: the
// ranks match their own caches and MIN-reduce, per request, the device
// match, the whole match (device plus host tier) and the negated device
// match, so all of them admit at the same length and load back the same
// host part. Device caches hold the same pages on every rank; should they
// ever differ (the negated minimum is not the minimum), nothing is loaded.
func (l *rankLoop) admit(adds []addMsg) error {
	if len(adds) == 0 {
		return nil
	}
	k := len(adds)
	hms := make([]prefix.HostMatch, k)
	ms := make([]rankcore.Match, k)
	var agreed []int64
	if l.cache != nil {
		for i, a := range adds {
			if a.noCache {
				continue // matches nothing: every rank admits it at 0
			}
			hm := l.cache.MatchHost(a.prompt[:len(a.prompt)-1])
			hms[i] = hm
			ms[i] = rankcore.Match{Device: hm.N, Total: hm.N + hm.Host}
		}
		agreed = rankcore.AdmitProposal(ms)
		if err := l.agreeInts(rankcore.Admit, agreed); err != nil {
			return err
		}
	}
	for i, a := range adds {
		var dev, total int
		if agreed != nil {
			m := rankcore.AdmitAgreed(agreed, i, k)
			dev, total = m.Device, m.Total
		}
		s := &seqState{all: append(make([]int32, 0, len(a.prompt)+a.maxTokens), a.prompt...),
			maxTokens: a.maxTokens, ignoreEOS: a.ignoreEOS, stop: a.stop}
		if l.cache != nil {
			hm := hms[i]
			if hm.N > dev {
				// A peer matched less: keep the agreed part only.
				if err := l.dropMatch(&hm); err != nil {
					return err
				}
				s.matched, _ = l.cache.Match(a.prompt[:dev])
			} else {
				s.matched = hm.Pages
				s.hm = &hm
				if total == dev {
					if err := l.dropHostMatch(s); err != nil { // nothing to load: unpin
						return err
					}
				}
			}
		}
		err := l.sched.Add(sched.Request{ID: a.id, PromptLen: len(a.prompt), MaxTokens: a.maxTokens, Cached: total, Loaded: total - dev}, l.now)
		if err != nil {
			if l.cache != nil {
				if uerr := errors.Join(l.dropHostMatch(s), l.cache.Unlock(s.matched)); uerr != nil {
					return fmt.Errorf("serve: rank %d: %w", l.r, uerr)
				}
			}
			if a.pd {
				// A prefill room the scheduler refuses fails like any
				// other end of its scheduler life.
				if _, err := l.pdSchedFinished(sched.Finish{ID: a.id, Reason: sched.ReasonError}); err != nil {
					return err
				}
			}
			l.end(a.id, ending{reason: sched.ReasonError, err: err.Error()})
			continue
		}
		l.seqs[a.id] = s
		if l.r == 0 {
			t := &l.e.totals
			t.PromptTokens += uint64(len(a.prompt))
			t.CachedTokens += uint64(total)
			if total > 0 {
				t.PrefixHits++
			}
		}
	}
	return nil
}

// dropMatch unpins hm's host part and unlocks its device match.
func (l *rankLoop) dropMatch(hm *prefix.HostMatch) error {
	pages, _, err := l.cache.LoadBack(ctx, nil, *hm, hm.N)
	if err == nil {
		err = l.cache.Unlock(pages)
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return nil
}

// unstall frees pages that requests waiting behind the head hold locked as
// their cached prefixes, when nothing runs and the head does not fit:
// those locks are all that keep the pages from eviction, and without this
// the queue would wait for ever (busy is not dead). The newest waiters give
// their cached prefixes up first (they will compute them), until the head
// fits. Every rank sees the same scheduler and cache, so every rank does
// the same.
func (l *rankLoop) unstall() error {
	if l.cache == nil {
		return nil
	}
	_, need, ok := l.sched.Head()
	ids := l.sched.WaitingIDs()
	for i := len(ids) - 1; ok && i > 0 && l.cache.Free() < need; i-- {
		s := l.seqs[ids[i]]
		if s == nil || (len(s.matched) == 0 && s.hm == nil) {
			continue
		}
		if err := errors.Join(l.dropHostMatch(s), l.cache.Unlock(s.matched)); err != nil {
			return fmt.Errorf("serve: rank %d: unstall: %w", l.r, err)
		}
		s.matched = nil
		if err := l.sched.Uncache(ids[i], 0, l.now); err != nil {
			return fmt.Errorf("serve: rank %d: unstall: %w", l.r, err)
		}
		if l.r == 0 {
			l.e.totals.Unstalls++
		}
	}
	return nil
}

// cut aborts a request the ranks know in whatever state it is; an unknown
// (already finished) or already cut id changes nothing. why, who asked,
// goes with a PD request's abort to its peer.
func (l *rankLoop) cut(id uint64, why string) error {
	s := l.seqs[id]
	if s == nil {
		_, err := l.pdAbort(id, why)
		return err
	}
	if s.cut {
		return nil
	}
	s.cut = true
	fs, err := l.sched.Abort(id, l.now)
	if err != nil {
		return fmt.Errorf("serve: rank %d: abort %d: %w", l.r, id, err)
	}
	if len(fs) == 0 && l.r == 0 {
		l.e.totals.AbortsInStep++
	}
	return l.finish(fs)
}

// freePages is what this rank could allocate now: free pages plus cached
// pages nothing uses.
func (l *rankLoop) freePages() int {
	n := l.rk.Pool().FreePages()
	if l.cache != nil {
		n += l.cache.Evictable()
	}
	return n
}

// agree MAX-reduces the plan digest and its negation: the ranks agree when
// the maximum equals the minimum.
func (l *rankLoop) agree(d uint64) error {
	buf := rankcore.AgreeProposal(d)
	if err := l.agreeInts(rankcore.Agree, buf); err != nil {
		return err
	}
	if !rankcore.PlansAgree(buf) {
		return fmt.Errorf("%w: rank %d at step %d", errDiverged, l.r, l.step+1)
	}
	return nil
}

// prepare starts the sequences of admissions on their cached prefixes,
// evicts cached pages for the room the plan needs and builds the batch.
func (l *rankLoop) prepare(plan sched.Plan, rec *StepRecord) ([]tp.Input, error) {
	pool := l.rk.Pool()
	for _, it := range plan.Run {
		if it.Fresh && it.Cached > 0 {
			s := l.seqs[it.ID]
			if err := l.loadBack(it, s); err != nil {
				return nil, err
			}
			if _, err := pool.NewSeqWithPrefix(it.ID, s.matched[:it.Cached/l.e.cfg.PageSize], it.Cached); err != nil {
				return nil, fmt.Errorf("serve: rank %d: admit %d on its prefix: %w", l.r, it.ID, err)
			}
		}
	}
	l.evictFor(plan)
	if l.r == 0 {
		now := time.Now()
		for _, it := range plan.Run {
			l.e.observeServed(it.ID, now)
		}
	}
	batch := make([]tp.Input, len(plan.Run))
	prefill, decode := 0, 0
	for i, it := range plan.Run {
		s := l.seqs[it.ID]
		n := 0
		if it.WantLogits {
			n = 1
		}
		batch[i] = tp.Input{SeqID: it.ID, Tokens: s.all[it.Start : it.Start+it.Tokens], NumLogits: n}
		if l.cache != nil && len(s.matched) > 0 {
			if loads := l.cache.Gate(s.matched); loads != nil {
				batch[i].Gate = l.gate(loads)
				l.gated = append(l.gated, loads...)
			}
		}
		rec.BatchTokens += it.Tokens
		if s.decoding {
			decode++
		} else {
			prefill++
		}
	}
	rec.BatchSize = len(plan.Run)
	switch {
	case decode == 0:
		rec.Phase = "prefill"
	case prefill == 0:
		rec.Phase = "decode"
	default:
		rec.Phase = "mixed"
	}
	return batch, nil
}

// evictFor evicts cached prefixes until plan's pages fit in the free pool.
// Evict takes only pages no sequence uses, so the overlap loop calls it
// while the step before runs too, off the path between two forward
// passes; prepare calls it again for what the finishes left short.
func (l *rankLoop) evictFor(plan sched.Plan) {
	if short := plan.PagesNeeded - l.rk.Pool().FreePages(); short > 0 && l.cache != nil {
		n := l.cache.Evict(short)
		if l.r == 0 {
			l.e.totals.PrefixEvictions += uint64(n)
		}
	}
}

// results gets the step's outcome: rank 0 takes the aborts that came during
// the step, samples every other item that wants logits, streams the tokens
// and broadcasts all of it; every rank decodes the broadcast bytes.
func (l *rankLoop) results(plan sched.Plan) (stepOutput, error) {
	var out stepOutput
	var data []byte
	if l.r == 0 {
		e := l.e
		out.now = e.clock()
		out.cuts = e.takeAborts()
		cut := make(map[uint64]bool, len(out.cuts))
		for _, a := range out.cuts {
			cut[a.id] = true
		}
		logits := l.rk.Logits()
		greedy := l.rk.Greedy() // the greedy choices the forward found, when it did
		emitted := time.Now()   // one timestamp for every token of the step
		e.holding = e.cfg.Schedule == ScheduleOverlap && len(logits) >= holdFromTokens*e.vocab
		defer func() { e.holding = false }()
		j := 0
		for _, it := range plan.Run {
			if !it.WantLogits {
				continue
			}
			lg := logits[j*e.vocab : (j+1)*e.vocab]
			j++
			if l.seqs[it.ID].cut || cut[it.ID] {
				continue
			}
			r := e.front[it.ID]
			var tok int32
			if greedy != nil && r.sampler.IsGreedy() {
				tok = greedy[j-1]
			} else {
				tok = r.sampler.Sample(lg)
			}
			e.totals.Sampled++
			r.gen++
			// Counted even if the reader proves too slow, as
			// CompletionTokens does; never blocks: the request goes
			// instead.
			if !e.emit(r, tok, emitted) {
				r.cut = ReasonSlowReader
				out.cuts = append(out.cuts, abortMsg{id: it.ID, by: AbortBySlowReader})
				continue
			}
			s := l.seqs[it.ID]
			stops := func(tok int32) bool {
				return (!s.ignoreEOS && e.m.Tokenizer.IsEOG(tok)) || slices.Contains(s.stop, tok)
			}
			out.toks = append(out.toks, sampled{tok: tok, stop: stops(tok)})
			if k := l.forks[it.ID]; k > 0 {
				out.toks = e.sampleForks(it.ID, k, lg, stops, emitted, out.toks)
			}
		}
		l.wire = out.encode(l.wire[:0])
		data = l.wire
	}
	got, err := l.agreeBytes(rankcore.Results, data)
	if err != nil {
		return out, err
	}
	l.noteBytes(rankcore.Results, got)
	if err := out.decode(got); err != nil {
		return out, fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return out, nil
}

// forward runs the step's forward pass in line (the lock-step loop),
// noting when the pass itself ran.
func (l *rankLoop) forward(batch []tp.Input, rec *StepRecord) error {
	if err := l.enterForward(); err != nil {
		return err
	}
	if err := l.rk.Begin(ctx, batch, nil); err != nil {
		return err
	}
	rec.ForwardStart = time.Now()
	err := l.rk.Run(ctx)
	rec.ForwardEnd = time.Now()
	if err != nil {
		return err
	}
	return l.rk.End()
}

// apply ends the step on this rank: the cuts, then the tokens.
func (l *rankLoop) apply(plan sched.Plan, out stepOutput) error {
	return l.applyFrom(plan, out, false)
}

// appendTokens is the part of apply the next step's batch needs first: each
// sampled token appended to its request (those cut in the step get none);
// stopped is told each request whose token ends it.
func (l *rankLoop) appendTokens(plan sched.Plan, out stepOutput, cut map[uint64]bool, stopped func(uint64)) error {
	j := 0
	for _, it := range plan.Run {
		s := l.seqs[it.ID]
		if !it.WantLogits || s.cut || cut[it.ID] {
			continue
		}
		if j == len(out.toks) {
			return fmt.Errorf("%w: rank %d: %d sampled tokens for more items", errWire, l.r, len(out.toks))
		}
		t := out.toks[j]
		j += 1 + l.forks[it.ID]
		s.all = append(s.all, t.tok)
		s.decoding = true
		if t.stop {
			stopped(it.ID)
		}
	}
	return nil
}

// applyRest is apply once appendTokens has run.
func (l *rankLoop) applyRest(plan sched.Plan, out stepOutput) error {
	return l.applyFrom(plan, out, true)
}

// applyFrom is apply; appended says appendTokens has already appended the
// step's tokens to their requests.
func (l *rankLoop) applyFrom(plan sched.Plan, out stepOutput, appended bool) error {
	l.now = max(l.now, out.now)
	for _, a := range out.cuts {
		if err := l.cut(a.id, a.by.String()); err != nil {
			return err
		}
	}
	outcomes := make([]sched.Outcome, 0, len(plan.Run))
	var toks map[uint64]int32
	var forked []forkOf
	j := 0
	for _, it := range plan.Run {
		s := l.seqs[it.ID]
		switch {
		case !it.WantLogits:
			outcomes = append(outcomes, sched.Outcome{ID: it.ID})
		case s.cut:
			// Aborted in the step: its outcome is ignored.
			outcomes = append(outcomes, sched.Outcome{ID: it.ID, Emitted: 1})
		default:
			if j == len(out.toks) {
				return fmt.Errorf("%w: rank %d: %d sampled tokens for more items", errWire, l.r, len(out.toks))
			}
			t := out.toks[j]
			j++
			if !appended {
				s.all = append(s.all, t.tok)
				s.decoding = true
			}
			if toks == nil {
				toks = make(map[uint64]int32)
			}
			toks[it.ID] = t.tok
			outcomes = append(outcomes, sched.Outcome{ID: it.ID, Emitted: 1, Stop: t.stop})
			if k := l.forks[it.ID]; k > 0 {
				if j+k > len(out.toks) {
					return fmt.Errorf("%w: rank %d: %d sampled tokens for more samples", errWire, l.r, len(out.toks))
				}
				forked = append(forked, forkOf{parent: it.ID, toks: out.toks[j : j+k]})
				j += k
				delete(l.forks, it.ID)
			}
		}
	}
	if j != len(out.toks) {
		return fmt.Errorf("%w: rank %d: %d sampled tokens for %d items", errWire, l.r, len(out.toks), j)
	}
	if err := l.forkAll(forked); err != nil { // while the parents hold their prompt's KV
		return err
	}
	if err := l.sendChunks(plan.Run, toks); err != nil { // before StepDone releases what finished
		return err
	}
	fs, err := l.sched.StepDone(l.now, outcomes)
	if ferr := l.finish(fs); ferr != nil {
		return ferr
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: step %d: %w", l.r, l.step+1, err)
	}
	return nil
}

// finish ends requests the scheduler finished: each exactly once, with its
// sequence (if any) given to the prefix cache; a PD prefill request goes on
// in the PD machine (it waits for the decode's word) or ends by it.
func (l *rankLoop) finish(fs []sched.Finish) error {
	for _, f := range fs {
		s := l.seqs[f.ID]
		if s == nil {
			return fmt.Errorf("serve: rank %d: finish of unknown request %d", l.r, f.ID)
		}
		delete(l.seqs, f.ID)
		var err error
		switch {
		case f.Release:
			err = l.release(f.ID, s)
		case l.cache != nil:
			err = errors.Join(l.dropHostMatch(s), l.cache.Unlock(s.matched)) // finished while waiting
		}
		handled, perr := l.pdSchedFinished(f)
		if !handled {
			l.end(f.ID, endingOf(f, err))
		}
		if err != nil {
			return fmt.Errorf("serve: rank %d: release %d: %w", l.r, f.ID, err)
		}
		if perr != nil {
			return perr
		}
	}
	return nil
}

// release ends request id's sequence: its full pages go to the prefix cache
// (which unlocks its matched prefix), the rest is freed.
func (l *rankLoop) release(id uint64, s *seqState) error {
	pool := l.rk.Pool()
	seq, ok := pool.Seq(id)
	if !ok {
		return fmt.Errorf("no live sequence %d", id)
	}
	defer func() { s.matched = nil }()
	if l.cache == nil {
		return pool.Release(seq)
	}
	return l.cache.Finish(seq, s.all[:seq.Len()], s.matched)
}

// publish ends an iteration: the rank's step record, and on rank 0 the
// engine snapshot. It returns the record as published.
func (l *rankLoop) publish(rec StepRecord) StepRecord {
	l.step++
	rec.Finished, rec.End = l.finished, time.Now()
	rec.ControlSeq, rec.ForwardSeq = l.comm().LastSeq(), l.rk.Comm().LastSeq()
	l.last.Store(&rec)
	l.noteEnd(rec)
	l.publishPD()
	l.publishTier()
	if l.r == 0 {
		l.e.publish(rec)
	}
	return rec
}

// drop forgets every request after the loop stopped; with release set (the
// loops stopped between steps) their sequences and locks are given back, so
// the pool's accounting still balances. A release that fails is logged:
// the engine is shutting down and has nobody else to tell.
func (l *rankLoop) drop(release bool) {
	release = release && !l.sched.InFlight()
	ids := make([]uint64, 0, len(l.seqs))
	for id := range l.seqs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		s := l.seqs[id]
		delete(l.seqs, id)
		if !release {
			continue
		}
		fs, err := l.sched.Abort(id, l.now)
		for _, f := range fs {
			switch {
			case f.Release:
				err = errors.Join(err, l.release(f.ID, s))
			case l.cache != nil:
				err = errors.Join(err, l.dropHostMatch(s), l.cache.Unlock(s.matched))
			}
		}
		if err != nil {
			l.e.cfg.Logger.Warn("serve: request not released at shutdown", "server", l.e.cfg.Name, "rank", l.r, "request", id, "err", err)
		}
	}
}
