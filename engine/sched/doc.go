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
// StepDone, which finishes it and ignores its outcome.
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
// the step in flight matching its requests). Builds with -race or
// -tags invariants run it after every event and panic on a violation.
//
// The PD queues (bootstrap, transfer and their polls) are a machine of their
// own, engine/pd/rooms, built the same way; a PD request enters this
// scheduler only once its KV is in (Request.Transferred) or, on a prefill,
// once its decode is known.
package sched
