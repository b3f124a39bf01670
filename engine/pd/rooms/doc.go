// Package rooms is the PD queue machine of one TP rank: the life of every
// bootstrap room the rank serves, from admission to its last message, as a
// deterministic state machine in the manner of engine/sched. Events go in;
// votes and typed [Action]s come out. There are no goroutines, no clock
// (every event carries now, the engine's agreed clock), no sockets and no
// randomness inside: the serve loop files the mail its socket received,
// reduces the votes across the TP group and executes the actions.
//
// # Phases
//
// A prefill room is in Bootstrap (waiting for the decode's TRANSFER_INFO),
// Active (in the prefill's scheduler; its KV goes to the decode chunk by
// chunk) or Inflight (the last chunk sent, waiting for the decode's STATUS).
// A decode room is in Prealloc (resolving the prefill's registry, then
// waiting for pages), Transfer (TRANSFER_INFO sent, chunks landing) or
// Aborting (the transfer failed; its pages stay reserved until the prefill
// rank acknowledges that nothing more will be written, or a deadline).
//
//	prefill: Bootstrap ──info──▶ Active ──scheduler done──▶ Inflight ──Success──▶ end
//	            │                  │                          │
//	            └─Failed─▶ end     └─Failed─▶ cut; ends with  └─Failed─▶ end
//	                                 the scheduler's finish
//	decode:  Prealloc ──resolved, pages──▶ Transfer ──Success──▶ joins the scheduler
//	            │                             └──Failed──▶ Aborting ──acked/deadline/peer gone──▶ released
//	            └─Failed─▶ end
//
// On every Failed edge the peer is told once, in the way its state
// expects: a prefill answers an ABORT with ABORT_ACK, else sends STATUS
// Failed to whoever sent TRANSFER_INFO; a decode sends ABORT (unless the
// prefill's own STATUS Failed ended the room: nothing follows it).
//
// # Messages
//
//	decode rank                         prefill rank
//	  Prealloc   ── QUEUED ───────────▶  Bootstrap   (each renews the room's lease)
//	  Transfer   ── TRANSFER_INFO ────▶  Active      (once every rank has its own)
//	  Transfer   ◀── KV_CHUNK … final ─  Active      (one per forward step)
//	  joined     ── STATUS Success ───▶  Inflight    (ends the prefill's stream)
//	  Aborting   ── ABORT ────────────▶  any         (the decode gave up)
//	  Aborting   ◀── ABORT_ACK ────────  any         (nothing more is written)
//	  any        ◀── STATUS Failed ────  any         (the prefill gave up)
//
// # One vote per room, agreed by MIN
//
// Every rank holds the same rooms in the same phases: rooms enter only by
// [Machine.Admit], move only on agreed values (the MIN of the votes, the
// broadcast clock, aborts and scheduler finishes that every rank sees) and
// leave only by those. What one rank alone knows (its mail, its peer's
// liveness, a send that failed on it) shapes only its vote. [Machine.Votes]
// returns one vote per room in id order, a vector whose length every rank
// agrees on; the loop MIN-reduces it and hands it to [Machine.Apply]. A
// vote is a pdproto.KVPoll in its high bits and the voter's rank in its
// low bits, so the MIN is the slowest state and, among the ranks in it, the
// lowest rank: Failed is the smallest state, so any rank that fails a room
// fails it on every rank at once, and the agreed owner of a failure is the
// one rank that logs and counts it, with its own reason.
//
// In Aborting the vote is on the ack instead (Success: the pages may go).
//
// # Deadlines
//
// Every phase has one, judged on the agreed clock: a fixed timeout, or a
// lease that only the peer's proven liveness renews, and the request
// timeout bounds them all. Bootstrap: the bootstrap timeout from the
// decode's last word (TRANSFER_INFO or QUEUED, which a decode sends for
// every room it queues for memory). Prealloc: the bootstrap timeout to
// resolve the registry, then the prefill's liveness (heartbeats) while it
// waits for pages. Active and Transfer: the transfer timeout. Inflight:
// the inflight timeout. Aborting: the abort-ack timeout. A decode room's
// prefill peer is watched by heartbeat: silent past the heartbeat
// timeout, or restarted (a new boot number), fails the room on that
// rank's vote. Busy is not dead: a room queued for memory lives as long as
// both sides do, within the request timeout.
//
// # Reasons
//
// A failure carries a [Reason]: a [Kind] that code may branch on and a text
// for people. The text is never compared.
//
// # Actions
//
// Each event returns its actions in the order the loop carries them out.
// The order is part of the protocol: a room's End (its stream's finish)
// comes before the ABORT that follows it, so a client hears of a failure
// as soon as the ranks agree on it; Arrived (commit the KV, join the
// scheduler) comes before the STATUS Success that lets the prefill forget
// the room; Release comes before Forget, and Forget last. The loop reports
// back what only it can know: a send that failed ([Machine.SendFailed]) or
// a chunk it could not write ([Machine.Failed]) becomes the rank's vote of
// Failed in the next poll, with that error as the reason. An action the
// loop cannot carry out at all (pages it cannot reserve after the ranks
// agreed they were free) is a broken invariant that stops the engine.
//
// # Checks
//
// [Machine.Check] verifies the invariants (the vote order, phases of the
// machine's role, a sequence held exactly in Transfer and Aborting, every
// Reserve matched by one Release or one Arrived) and that no event broke
// one on its way (an agreed Success after an agreed Failed; a room past
// its deadline after Apply, failed rooms aside: a failed Active room waits
// for the scheduler's finish of the step in flight, an Aborting one for
// its ack deadline). Builds with -race or -tags invariants run it after
// every event and panic on a violation.
package rooms
