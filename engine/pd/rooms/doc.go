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
//	decode:  Prealloc ──resolved, pages──▶ Transfer ──Success──▶ joins the scheduler
//	                                          └──Failed──▶ Aborting ──acked/deadline──▶ released
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
// Every phase has one, judged on the agreed clock: Bootstrap and Prealloc
// the bootstrap timeout, Active and Transfer the transfer timeout, Inflight
// the inflight timeout, Aborting the abort-ack timeout. A decode room's
// prefill peer is also watched by heartbeat: silent past the heartbeat
// timeout, or restarted (a new boot number), fails the room on that rank's
// vote. So every room reaches its end by the sum of its phases' deadlines.
//
// # Reasons
//
// A failure carries a [Reason]: a [Kind] that code may branch on and a text
// for people. The text is never compared.
//
// # Checks
//
// [Machine.Check] verifies the invariants (pages reserved and released at
// most once each, never an agreed Success after an agreed Failed, every
// room within its deadline after Apply). Builds with -race or -tags
// invariants run it after every event and panic on a violation.
package rooms
