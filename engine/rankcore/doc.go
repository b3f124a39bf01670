// Package rankcore is the order of a rank's iteration and the decisions
// taken from what the ranks agree on: the part of a TP group's loop that
// every rank must run alike, held apart from the loop that runs it.
//
// # The rule
//
// A TP group's ranks meet only in collectives. The rule the second
// incident broke is that no rank branches on its own state before a
// collective: whether each collective runs, and its shape, follow from
// values every rank holds alike. Here that order is data. An iteration is
// a table of phases; in each phase every rank proposes a value, the group
// reduces or broadcasts it on one communicator, and the row's condition,
// on agreed values only, says whether the phase runs at all.
//
// # The tables
//
// The executor (engine/serve) enters each phase through a [Cursor], which
// refuses a phase out of its table's order before any rank waits on it,
// and tags the phase's collective with its name (dist.WithTag). The
// flight recorder then shows the phase of every call, the collective
// layer refuses two ranks that run the same operation for different
// phases, a broken group says which phase each rank was in, and
// [CheckLog] holds a recorded log against the table. The lock-step and
// overlap loops are two tables over the same phases; an iteration may end
// after any row (nothing to run), and the next starts at the step input.
//
//	lockstep:
//	  #  phase    of  comm     op             when
//	  1  input    N   control  Broadcast      every iteration
//	  2  poll     N   control  AllReduceMin   the PD machine holds rooms
//	  3  admit    N   control  AllReduceMin   requests join the scheduler and the prefix cache is on
//	  4  room     N   control  AllReduceMin   there is work: requests joining, scheduled or PD rooms
//	  5  pd_fork  N   control  AllReduceMin   a decode arrival of n > 1 samples forks
//	  6  agree    N   control  AllReduceMax   the scheduler holds requests
//	  7  forward  N   forward  (the model's)  the plan runs a batch
//	  8  results  N   control  Broadcast      the plan ran a batch
//	  9  fork     N   control  AllReduceMin   a request of n > 1 samples sampled its first tokens
//
// In the overlap loop step N's forward pass runs on the forward
// communicator while the control rows of N+1, up to its agree, run
// beside it; N lands (results, fork) once N+1 is agreed, and when what
// landed leaves N+1 nothing to run, N+1 is planned again:
//
//	overlap:
//	  #   phase    of   comm     op             when
//	  1   input    N    control  Broadcast      every iteration
//	  2   poll     N    control  AllReduceMin   the PD machine holds rooms
//	  3   admit    N    control  AllReduceMin   requests join the scheduler and the prefix cache is on
//	  4   room     N    control  AllReduceMin   there is work: requests joining, scheduled or PD rooms
//	  5   pd_fork  N    control  AllReduceMin   a decode arrival of n > 1 samples forks
//	  6   agree    N    control  AllReduceMax   the scheduler holds requests
//	  7   results  N-1  control  Broadcast      a step is in flight: it lands
//	  8   fork     N-1  control  AllReduceMin   a request of n > 1 samples sampled its first tokens in N-1
//	  9   room     N    control  AllReduceMin   N-1 landed and left N's plan empty, and the scheduler holds requests: plan again
//	  10  agree    N    control  AllReduceMax   N was planned again
//	  11  forward  N    forward  (the model's)  the plan runs a batch; the rows of N+1 up to agree run beside it
//
// What every rank proposes in each phase:
//
//	input    rank 0: the inbox's requests and aborts, its clock, the switches
//	poll     one KVPoll vote per PD room, from the rank's own mail and sends
//	admit    per joining request: device match, device+host match, -device match
//	room     free pages (free + evictable cached) and free sequence rows
//	pd_fork  free pages and rows, after the decode's grant
//	agree    the plan's digest and its negation
//	forward  the rank's shard of the batch (the model's all-reduces)
//	results  rank 0: the sampled tokens, the aborts that came during the step
//	fork     free pages and rows, once first tokens are appended
//
// # A PD request through the table
//
// The router picks a prefill and a decode, gives the request one
// bootstrap room and sends it to both. On each server, rank 0 takes it
// from the inbox into an input; every rank hands it to its PD machine
// (engine/pd/rooms), whose votes are poll's proposal: the decode's ranks
// agree to reserve pages (room, within the agreed free pages) and send
// TRANSFER_INFO; the prefill's ranks agree the room is ready and admit
// the prompt (admit, agree, forward). Each forward step's KV goes to the
// decode as the prefill lands the step (results); the prefill samples the
// first token and the room stays in its inflight queue until the decode's
// ranks have polled every chunk in. The decode then admits the request at
// its prompt's length and decodes it step by step (agree, forward,
// results), rank 0 streaming each token. An abort, from either side, is a
// vote of Failed in poll: every rank fails the room in the same
// iteration. A decode's ABORT for a room the prefill does not know (yet,
// or any more) is acknowledged at once by the prefill's receive side,
// engine/pd/mailbox, without waiting for an iteration: incident 1's
// message. testdata/cluster-the-life-of-a-pd-request.txt shows all of it
// step by step, both groups' collectives and the messages between them;
// the traces of engine/pd/rooms and engine/pd/mailbox tell the machines'
// side.
//
// # The core
//
// [Core] is the state of one rank that every rank holds alike: the
// scheduler (engine/sched), each request's tokens and stop rules, the
// fork budgets of requests of n > 1 samples, and what ended in the
// iteration. Every change to it comes from an agreed value: the step
// input and its clock ([Core.Begin]), an agreed [Capacity]
// ([Core.Schedule]), the agreed plan, the broadcast tokens ([Core.Land],
// [Core.Append]), and its own answers. It holds no clock, goroutine,
// pool, socket or randomness; a lint test reads this package's source
// and holds its methods to agreed parameter types and the package to
// imports without I/O. The executor (engine/serve) does what the core
// says: it copies and frees pages, runs the forward pass, streams tokens.
//
// The traces testdata/group-*.txt run several ranks of the lock-step
// loop in one goroutine: each rank is a core with its own cursor and a
// pool counted in pages, its iteration a coroutine that stops at every
// collective, and the harness runs a collective once every rank has
// reached it. They show, under the lock-step and the overlap table, a
// request's life on every rank, the room agreed at the least any rank
// has, retraction, aborts in every state, forks within the agreed room,
// the overlap loop's landing, voiding and replan, a host-tier load
// admitted at the least match, an index-K switch's drain and its bound,
// the second incident's shape (a rank that goes idle on its own view
// meets its peer in another collective, and the harness names both
// phases and the seq where the ranks parted) and the rebuild after it.
//
// The traces testdata/cluster-*.txt put two such groups together, a
// prefill and a decode, each rank with its own rooms and mailbox machine
// (engine/pd/rooms, engine/pd/mailbox) and a wire between the sides that
// can hold, lose or deliver the PD protocol's messages: the life of a PD
// request; aborts on each side, in each of its states, for each cause
// (the client, an operator, a timeout, the peer); the first incident's
// storm of 60 ABORTs for rooms the prefill does not know, each
// acknowledged by its mailbox at once; and the second incident where it
// happened, an overlap decode whose rank 1 goes idle while rank 0 polls.
//
// # Decisions
//
// The decisions that follow agreed values are functions here: agreed
// values in, what every rank does out, with no state, clock or I/O. The
// plan's agreement ([PlanDigest], [PlansAgree]), the prefix match every
// rank admits at ([AdmitAgreed]: the least device match, and the host part
// only where every rank's device matched alike) and what each rank does
// with its own match ([PlanAdmit]: keep it, loading the agreed host part
// or unpinning it, or let it go for the agreed device part), which
// waiting requests give their cached prefixes up when nothing runs and
// the head does not fit ([Unstall]: newest first, never the head, until
// it fits), rank 0's step of an index-K precision switch's drain
// ([DrainStep]: the switch once nothing holds the old precision, past the
// bound the aborts of what still does, sparing what an abort would not
// change), and the forks of a request's
// later samples ([Forks] keeps each parent's budget, spent once;
// [PlanFirstForks] and [PlanArrivalForks] say, within the room agreed in
// fork or pd_fork, which samples fork, wait without KV, or end at once).
// testdata/ holds their traces.
package rankcore
