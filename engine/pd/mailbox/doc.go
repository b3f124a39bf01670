// Package mailbox is the receive side of one PD rank as a deterministic
// machine: for every message the rank's socket hears, it decides at once,
// before the rank's loop sees anything, whether to file it under its room
// for the loop (a rooms.Mail, taken at the loop's pace), answer it now, or
// drop it and why. There are no goroutines, no locks and no clock inside:
// events that need the time take now, and the caller (engine/serve, which
// shares the machine between the receive goroutine and the loop under a
// lock) counts the drops, wakes the loop and posts the answers.
//
// # Why decide here, not in the loop
//
// Some answers must not wait for a loop iteration. An ABORT for a room the
// loop does not have (not arrived yet, or ended) is acknowledged at once:
// nothing was written for such a room, so the ack is already true, and a
// decode that waits for it holds its pages until it comes. The first
// incident was this message: the reference prefill's control loop knew no
// ABORT and died on one, and under a mass abort every decode room waited
// out its deadline. A decode that asks about a room this prefill failed
// and forgot (TRANSFER_INFO, QUEUED) hears STATUS Failed with the reason,
// instead of waiting out its transfer timeout. A heartbeat probe is
// answered by the receive side, so that a busy loop does not look like a
// dead rank.
//
// # Rooms
//
// A room is known (the loop has its request), early (mail came first: a
// prefill may hear from the decode before the router's request arrives)
// or ended (a prefill's room that failed and was forgotten, remembered
// with its reason). A decode has every room it expects mail for: mail for
// any other is late.
//
//	none ──file (a prefill, within the bounds)──▶ early
//	none, early, ended ──admit──▶ known
//	early ──expire, forget──▶ none
//	known ──forget──▶ none; ended on a prefill, when the room failed
//	ended ──past the bound, oldest first──▶ none
//
// # Bounds
//
// The socket listens for hostile peers as well as its own: everything a
// peer can make the machine hold is bounded, and each bound, when hit,
// drops the message with [OverQuota] or [Late] for the caller to count:
//
//   - the early rooms, [MaxUnknownRooms] of them, all senders together;
//   - the early rooms of one sender (the endpoint its messages name),
//     Config.PerSender: one sender cannot fill the table and starve the
//     others' rooms;
//   - the KV bytes filed for one room and not yet taken, Config.RoomBytes:
//     a peer replaying chunks while the loop is held cannot grow the heap;
//   - the ended rooms remembered, [MaxUnknownRooms], oldest first out;
//   - early mail the loop never took up, which the caller expires.
//
// Mail that makes no sense on the rank's role (a KV_CHUNK on a prefill,
// a TRANSFER_INFO on a decode), a second TRANSFER_INFO for a room, a probe
// on a decode or a reply on a prefill is [Misplaced]: dropped, never
// filed, so it cannot move a room.
//
// # Heartbeats
//
// A decode probes each prefill peer it waits on ([Machine.Probe]) and
// records its replies; [Machine.Liveness] says how long the oldest
// unanswered probe has waited (from the first probe after the last reply)
// and the peer's boot number, which the rooms machine judges. A peer not
// probed for two intervals (no room waited on it) starts afresh: an old
// unanswered probe says nothing of it now.
//
// # Time
//
// now is the rank's own wall clock, not the rooms machine's agreed clock:
// the mailbox is one rank's, its times never cross ranks, and heartbeats
// carry the wall clock on the wire.
package mailbox
