// Package dist is the tensor-parallel (TP) group through which a server's
// rank goroutines meet. Ranks are goroutines in one process; they never share
// variables, they only call collectives on their own [Comm].
//
// # Collectives and sequence numbers
//
// [Comm] offers AllReduceSum, AllReduceMin and AllReduceMax (float32),
// AllReduceMinInt and AllReduceMaxInt (int64, for scheduler decisions such as
// KVPoll states and batch sizes), Broadcast (float32, in place),
// BroadcastBytes, AllGather and Barrier. Every call carries a per-rank
// sequence number: the k-th collective a rank enters is seq k (the first is
// seq 1). All ranks must enter the same op with the same shape at the same
// seq. A difference (another op, another length, another root, a bad output
// length) is detected as soon as the second differing call arrives, without
// waiting for the rest of the group, and every rank that enters that seq gets
// a *[MismatchError] (errors.Is(err, [ErrMismatch])) naming the seq and each
// rank's call. This is the overlap-schedule desync: ranks that branched on
// rank-local state before a collective get an error, never a silent hang or
// a corrupted result.
//
// AllReduceSum is deterministic: the result is summed in rank order
// 0, 1, …, N-1 whatever order the ranks arrive in, so it is bitwise
// reproducible and identical on every rank. Min and Max are also taken in rank
// order; a NaN anywhere makes the float result NaN.
//
// # Rendezvous
//
// At most one round (one seq) is open at a time: round k cannot complete
// before every rank has entered it, so no rank can be at k+1 while a peer is
// still before k. The first rank to enter seq k opens the round under the
// group's mutex and registers its call and buffer; each later rank checks its
// call against the first; the last rank to arrive computes the result, in
// rank order, into the group's scratch buffer and closes the round's channel.
// Each rank then copies the result into its own buffer in parallel. The
// scratch is reused by round k+1 only when every rank has entered k+1, that
// is after every rank has finished copying round k. The group starts no
// goroutine for this; the only goroutine it owns is the watchdog's.
//
// # Failure: cancelled, broken, closed
//
// A call waits with its ctx. When the ctx ends before the round completes,
// the call returns the ctx's error (errors.Is(err, context.DeadlineExceeded)
// or context.Canceled), the flight recorder marks the call with it, and the
// group is broken: the peers waiting in that round wake at once and every
// later call, on any rank, returns [ErrGroupBroken]. A lock-step group cannot
// recover from a rank that left in the middle of a collective (its peers no
// longer agree on which seq comes next), so the server must tear the group
// down and build a new one. A mismatch breaks the group in the same way: the
// ranks no longer run the same program. [Group.Close] wakes every waiter with
// [ErrGroupClosed]; calls after Close return it too.
//
// # Flight recorder and snapshots
//
// Each rank keeps a ring of its last Options.FlightRecorderLen calls (seq,
// op, bytes, start, end, outcome). The ring is copy-on-write per record: a
// slot is an atomic pointer to an immutable [Record], and the rank (the only
// writer) publishes a fresh Record when a call starts and another when it
// ends. The rank's current call and its last entered and last completed seq
// are atomics too. [Comm.Records], [Group.Snapshot] and [Group.Stuck]
// therefore take no lock that a collective holds: a debug API can read them
// from any goroutine while the ranks are wedged. A reader racing with a
// writer may see a ring where the oldest slot was just replaced; every record
// it sees is whole, and records are returned sorted by seq. A call is
// published under the group's mutex as it registers in its round, so a reader
// that sees a rank waiting at seq k knows that rank has joined round k.
//
// # Watchdog
//
// [Group.Stuck] lists the calls that have waited longer than a threshold,
// with the ranks that have arrived at that seq and, for each rank that has
// not, where it is: in another collective, or not in one (with its last
// entered seq and op). With Options.Watchdog > 0 the group runs one goroutine
// that calls Stuck every Watchdog/2 and passes each stall, once, to
// Options.OnStall. Close stops it.
//
// # Faults
//
// Options.Inject is a hook for aimed faults in chaos tests: it runs on a
// rank's goroutine before each collective, may block (the rank stalls outside
// the collective) or fail it (the rank leaves, the group breaks).
//
// # Not done yet
//
// There is no typed event stream for collective waits; the flight recorder,
// Snapshot, Stuck and the watchdog callback are the only outputs.
package dist
