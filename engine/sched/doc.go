// Package sched is the per-rank scheduler of the serving engine: a
// deterministic state machine in the manner of etcd's raft. The scheduler
// decides, the loop acts. Events go in ([Scheduler.Add], [Scheduler.Abort],
// [Scheduler.Schedule], [Scheduler.StepDone], [Scheduler.Tick]); a [Plan]
// and [Finish] reports come out. There are no goroutines, no clock (every
// event carries now, a duration since start) and no randomness inside, and
// the scheduler never touches a KV pool: the same inputs give the same
// outputs, so every TP rank can run its own copy on the same reduced inputs
// (free pages MIN-reduced across ranks) and reach the same plan without
// branching on rank-local state.
//
// # Requests
//
// A request is Waiting (queued, no KV), Prefilling (admitted, prompt not
// fully run), Running (decoding one token per step) or Finished, with a
// [Reason]: stop, length, abort, timeout or error. Prefilling and Running
// requests count against MaxRunning. A retracted request goes back to the
// front of the waiting queue keeping nothing: its KV is released and its
// prompt plus the tokens generated so far (Retract.Generated) are prefilled
// again from position 0. A request aborted or timed out while in the step in
// flight is Aborting: it has left every queue but keeps its pages until
// StepDone, which finishes it and ignores its outcome (see Overlap for the
// two steps in flight).
//
// # The step
//
// Schedule(now, freePages) plans one step: decoding requests first (one
// token each); when their new pages do not fit, the most recently admitted
// requests are retracted (LIFO) until they do; then the next chunk of each
// prefilling request (at most PrefillChunk tokens, within MaxBatchTokens);
// then, unless the step retracted, waiting requests in FIFO order while a
// slot, tokens and the pages of their whole prefill are free. The loop
// releases the KV of Plan.Finished (Release set) and Plan.Retract, reserves
// each Run item (kvcache Reserve(Tokens) on a Seq of Len Start; Fresh means
// a new Seq), runs the batch and reports one [Outcome] per item to StepDone.
// Page holdings are counted as ceil(tokens/PageSize) per request, exactly as
// the pool allocates them.
//
// # Overlap
//
// With Config.Overlap set, the loop may plan step N+1 while step N's
// forward pass runs (the overlap schedule), against N's predicted outcome:
// every item of N with WantLogits emits one token and does not stop, an
// item without logits (a prefill chunk) advances as planned, and a request
// that reaches MaxTokens in N is predicted finished (it is not planned and
// keeps its pages, Aborting, until N's StepDone). With no surprise, and
// pages to spare, the plans are the lock-step plans. The loop calls, in
// this order:
//
//  1. p := Schedule(now, free) with no step in flight; act on p as in
//     lock-step and launch p.Run (step N).
//  2. While N runs, q := Schedule(now, free) plans N+1 (Ahead() is then
//     true; a third Schedule fails with ErrStepInFlight). Release
//     q.Finished, which holds only requests outside N; q.Retract is always
//     empty, since a plan made with a step in flight never retracts: where
//     it would, it runs nothing (q.Run empty, no step planned) and the
//     loop goes on with 3 and schedules again in lock-step (1). The loop
//     reserves q.Run's pages now or after 3, before 4.
//  3. When N's forward is done, StepDone(now, outcomes of N). It returns
//     N's finishes, predicted or not (length, stop, error, and aborts and
//     timeouts during N), exactly as in lock-step: predicted finishes are
//     reported here, not earlier, so the loop releases a sequence only
//     after the forward pass that wrote it. A request that finishes while
//     it has an item in N+1 has that item voided.
//  4. Launch q.Run less Voided() (nothing when that leaves no item: then
//     InFlight is false and no StepDone is due). N+1 is now the step in
//     flight; go to 2 to plan N+2, and later pass StepDone the outcomes of
//     the launched items only.
//
// Abort or a timeout of a request in N (whether or not it is in N+1)
// finishes it at N's StepDone, as in lock-step, its outcome ignored; one
// only in N+1 (not launched) finishes at once, its item voided. Either
// way the Finish releases the request's pages once, the pages reserved for
// its N+1 item included, and the loop drops every id of Voided from N+1
// before it launches it.
//
// # Exactly once
//
// Every request that was added leaves through exactly one [Finish], returned
// by the event that ended it (Abort, Tick, Schedule or StepDone); its Release
// field says whether the loop holds KV to free.
//
// # Checks
//
// [Scheduler.Check] verifies the invariants (no request in two queues,
// holdings consistent and within TotalPages, at most MaxRunning admitted,
// the steps in flight matching their requests, each request at most once
// per step, voided items in no step, the predicted state consistent).
// Builds with -race or -tags invariants run it after every event and panic
// on a violation.
//
// The PD queues (bootstrap, transfer and their polls) are a machine of their
// own, engine/pd/rooms, built the same way; a PD request enters this
// scheduler only once its KV is in (Request.Transferred) or, on a prefill,
// once its decode is known.
package sched
