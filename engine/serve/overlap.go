package serve

import (
	"fmt"
	"slices"

	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/tp"
)

// The overlap loop (Config.Schedule = ScheduleOverlap). While a rank's
// loop goroutine runs step N's forward pass (fly), which touches only the
// batch's own pages, a goroutine beside it holds the rest of the loop's
// state: it ends step N−1 and runs iteration N+1's front half exactly as
// the lock-step loop does (the step input, the PD machine's votes, the
// admissions, the room), planning N+1 against N's predicted outcome (the
// scheduler's plan-ahead: every decoding sequence emits one token and does
// not stop); every allocator, pool-table, cache and scheduler change is
// made by one goroutine at a time. Then the loop lands N in two halves.
// Before N+1 starts: commit, settle its HiCache loads, sample and
// broadcast N's tokens and append them; a request that stopped or was cut
// in N leaves N+1's batch (the scheduler voids the same items). While N+1
// runs, beside it: N's StepDone, the finishes and releases, the PD chunks,
// the forks and the streaming, none of which touches N+1's batch. Every
// decision is the lock-step loop's, on the same agreed values, in the
// order of the table rankcore.Overlap.
//
// The fault overlap-local-decision puts the incident's bug into this loop:
// see rankPD.localIdle and its paragraph below.

// Schedules a rank loop runs. ScheduleAuto is a caller's choice, turned
// into one of the other two by ResolveSchedule before an engine starts.
const (
	ScheduleLockstep = "lockstep" // the forward pass in line with the rest of the iteration
	ScheduleOverlap  = "overlap"  // the forward pass beside the next iteration's front half
	ScheduleAuto     = "auto"     // overlap where the forward passes leave a CPU free, else lock-step
)

// ResolveSchedule turns ScheduleAuto into the loop that suits where the
// forward passes run: overlap when all ranks' forward passes together keep
// fewer than cpus CPU threads busy (forwardThreads; 0 for a device backend
// that leaves the CPUs to the loop), lock-step when they keep every CPU
// busy. Any other schedule is returned as it is.
//
// Overlap hides the loop's own work (streaming, scheduling, the next step
// input) in CPU time the forward pass leaves idle. Where it leaves none,
// the work can only move onto the forward pass's cores: with pdserve bench
// overlap on 2 cores (the small model, five runs), overlap served on
// average 1.001 of lock-step's tokens/s at 2 threads (0.976 to 1.032
// over 18 levels of the runs) and 1.009 at 1 thread (0.988 to 1.029, 14
// of 16 at or above 1). The rule is a configuration value, the same on every
// rank, never a rank's own view.
func ResolveSchedule(schedule string, forwardThreads, cpus int) string {
	if schedule != ScheduleAuto {
		return schedule
	}
	if forwardThreads < cpus {
		return ScheduleOverlap
	}
	return ScheduleLockstep
}

// LoopOverlap names the overlap loop in step records.
const LoopOverlap = ScheduleOverlap

// flight is a step whose forward pass has run and which has not landed.
type flight struct {
	plan sched.Plan
	rec  StepRecord
	done chan error // the forward pass's outcome; buffered
}

// fly runs plan's forward pass over batch on the loop's goroutine and,
// beside it on a goroutine of its own, what the loop does meanwhile: the
// landed step's outcome (landBack), then the next step input and the next
// iteration's front half, which it returns. The loop's state is the
// helper's until it returns, the forward pass touching only the batch's
// own pages; so no hand-over between goroutines lies on the path from one
// forward pass to the next (the front half has almost always ended by the
// time the forward pass does), where a flight goroutine cost two wake-ups
// (~10 to 25 µs each measured here).
func (l *rankLoop) fly(plan sched.Plan, batch []tp.Input, rec StepRecord, landed *landing) (*iteration, error) {
	if err := l.ag.forward(); err != nil {
		return nil, err
	}
	if err := l.rk.Begin(ctx, batch, nil); err != nil {
		return nil, fmt.Errorf("serve: rank %d: step %d: %w", l.r, rec.Step, err)
	}
	f := &flight{plan: plan, rec: rec, done: make(chan error, 1)}
	l.flight = f
	beside := make(chan *iteration, 1)
	go func() {
		if err := l.landBack(landed); err != nil {
			beside <- &iteration{err: err}
			return
		}
		l.publish(rec)
		if l.r == 0 {
			l.e.streams.streamHeld()
		}
		next := l.begin(true)
		if l.r == 0 {
			l.e.streams.streamHeld() // tokens the front half emitted (a PD first token)
		}
		beside <- next
	}()
	f.rec.ForwardStart = l.e.now()
	err := l.rk.Run(ctx)
	f.rec.ForwardEnd = l.e.now()
	f.done <- err
	// Every collective the helper waits in ends: it completes, or the
	// collective timeout breaks the group.
	return <-beside, nil
}

// landing is a step whose forward pass has ended and whose tokens every
// rank holds, but whose outcome the scheduler has not been told yet: the
// overlap loop starts the next step in between (landFront, then landBack).
type landing struct {
	plan   sched.Plan
	out    stepOutput
	rec    StepRecord
	voided []uint64 // the requests whose items in the plan made ahead go
}

// landFront ends the step in flight, if any, as far as the next step needs:
// it takes the forward pass's outcome, commits it, settles its HiCache loads,
// samples and broadcasts its tokens and appends them to the requests; it
// returns the requests whose items in the plan made ahead must go (they
// stopped or were cut in it: the scheduler's StepDone voids the same).
func (l *rankLoop) landFront() (*landing, error) {
	f := l.flight
	if f == nil {
		return nil, nil
	}
	l.flight = nil
	if err := <-f.done; err != nil {
		return nil, fmt.Errorf("serve: rank %d: step %d: %w", l.r, f.rec.Step, err)
	}
	if err := l.rk.End(); err != nil {
		return nil, fmt.Errorf("serve: rank %d: step %d: %w", l.r, f.rec.Step, err)
	}
	if err := l.tier.settle(); err != nil {
		return nil, err
	}
	if l.r == 0 {
		l.e.streams.totals.Steps++
		l.e.streams.totals.Tokens += uint64(f.rec.BatchTokens)
	}
	out, err := l.results(f.plan)
	if err != nil {
		return nil, err
	}
	ld := &landing{plan: f.plan, out: out, rec: f.rec}
	for _, a := range out.cuts {
		ld.voided = append(ld.voided, a.id)
	}
	stopped, err := l.core.Append(f.plan, out.toks, ld.voided)
	if err != nil {
		return nil, fmt.Errorf("%w: rank %d: %v", errWire, l.r, err)
	}
	ld.voided = append(ld.voided, stopped...)
	return ld, nil
}

// landBack tells the scheduler the landed step's outcome and does the rest
// of apply (streams' ends, PD chunks, forks, releases), while the next
// step's forward pass may already run: nothing here touches its batch.
func (l *rankLoop) landBack(ld *landing) error {
	if ld == nil {
		return nil
	}
	if l.r == 0 {
		l.e.streams.streamHeld()
	}
	if err := l.apply(ld.plan, ld.out, true); err != nil {
		return err
	}
	for _, id := range l.core.Voided() {
		if !slices.Contains(ld.voided, id) {
			return fmt.Errorf("serve: rank %d: the scheduler voided request %d, which neither stopped nor was cut", l.r, id)
		}
	}
	if o := l.e.cfg.Observer; o != nil && l.r == 0 {
		rec := ld.rec
		rec.End = l.e.now()
		o.StepFinished(rec)
	}
	return nil
}

// wait waits for the forward pass of a step that ran but did not land,
// whose outcome the loop, leaving (stop, a broken group), forgets; nil
// waits for nothing.
func (f *flight) wait() {
	if f != nil {
		<-f.done
	}
}

// replan schedules again once the step in flight has landed, with the room
// and the digest agreed again: every rank lands the same step and sees the
// same scheduler, so every rank replans.
func (l *rankLoop) replan(rec *StepRecord) (sched.Plan, error) {
	free, rows, err := l.room(rankcore.Room)
	if err != nil {
		return sched.Plan{}, err
	}
	if free, err = l.pd.grantPagesSendInfo(l.pdLoop(), free, rows, l.core); err != nil {
		return sched.Plan{}, err
	}
	plan, err := l.core.Schedule(rankcore.Capacity{Pages: free})
	if err != nil {
		return sched.Plan{}, fmt.Errorf("serve: rank %d: schedule: %w", l.r, err)
	}
	rec.Digest = rankcore.PlanDigest(rec.Step, plan.Run)
	return plan, l.agree(rec.Digest)
}

// The fault overlap-local-decision
//
// The reference system's overlap loop decided, on each TP rank, whether to
// process new transfers or go idle from that rank's own view; under an
// abort storm one rank entered a collective while a peer took the idle
// branch (incident 2). localIdle is that branch, taken on purpose: with
// the switch on, the highest rank of a PD server running the overlap loop
// asks its own PD socket whether anything new came for it, and the
// signal is the mailbox's count of messages filed under a room
// (pdMailbox.filed, read by rankPD.noNewMail: TRANSFER_INFO, QUEUED,
// ABORT and STATUS on a prefill, KV_CHUNK, STATUS and ABORT_ACK on a
// decode; heartbeats are not mail)
// against the count it saw at its last iteration. When it is unchanged,
// the rank skips the iteration's front half (poll, admit, room, agree) and
// goes straight back to waiting for the next step input, while its peers,
// following the agreed state (there are PD rooms or requests), enter the
// poll's AllReduceMinInt. Such an iteration comes within the first
// requests: a room's first iteration on a decode precedes its first
// KV_CHUNK, and the drill's 60 sessions make many more.
//
// The group then breaks in one of the incident's two ways:
//
//   - the mismatch: the idle rank comes back with another collective at the
//     same seq (the step input's BroadcastBytes against the peers' poll
//     AllReduceMinInt); engine/dist checks every call against its peers',
//     so every rank at that seq gets a dist.MismatchError at once and the
//     group is broken. This is what this engine's loops produce.
//   - the hang: the idle rank is elsewhere (waiting for work, or its next
//     call matches the peers' in op and shape on a collective layer that
//     does not check, as NCCL does not) while a peer waits in the
//     collective, forever; /health sees the loop's age, diagnose's
//     rank-divergence sees one rank in a collective and a peer outside.
//
// With Config.CollectiveTimeout set, both recover (recover.go): the
// mismatch as a broken group at once, the hang once the collective has
// waited the timeout. The lock-step loop never takes this branch. The
// branch is front's, on the highest rank of a PD server with the switch
// on; rankPD.localIdle is the rank-local view it takes.
