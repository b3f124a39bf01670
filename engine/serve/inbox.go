package serve

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// inbox is what waits for rank 0's next step input: the submitted
// requests, the asked-for aborts and the operator's ops (a HiCache switch,
// an index-K switch, an offload). Any goroutine puts into it; only rank
// 0's loop takes from it (the supervisor too, with no loop running). It is
// its own type, with its own mutex, so that a caller of Submit or Abort
// shares nothing with the loop but this lock, which is never held across
// work: a put or a take is a few stores.
type inbox struct {
	// stop ends an idle wait: the engine is closing. heartbeat bounds
	// one.
	stop      <-chan struct{}
	heartbeat time.Duration
	wake      chan struct{} // capacity 1: the inbox changed

	mu      sync.Mutex // guards the fields below
	closed  bool
	pending []*request
	aborts  []abortMsg
	tierOp  *tierOp // a HiCache switch for the loops, nil when none
	// indexKOp is an index-K precision switch draining the engine, nil
	// when none (indexk.go).
	indexKOp *indexKOp
	// offloadOp is an Offload for the loops, nil when none (hicache.go).
	offloadOp *offloadOp

	// The inbox as Health sees it without the lock.
	numPending    atomic.Int64
	oldestPending atomic.Int64 // unix nanoseconds; 0 when none
}

func newInbox(stop <-chan struct{}, heartbeat time.Duration) *inbox {
	return &inbox{stop: stop, heartbeat: heartbeat, wake: make(chan struct{}, 1)}
}

// AbortBy says who asked for an abort. A PD request's abort carries it to
// the peer, so both sides' logs name the cause.
type AbortBy uint8

const (
	AbortByOperator   AbortBy = iota // an admin call (by request id or by room)
	AbortByClient                    // the client went: its context ended (a router that cut its upstream request included)
	AbortBySlowReader                // the stream's reader fell behind (see Stream)
	_                                // AbortBySwitch (indexk.go)
)

func (b AbortBy) String() string {
	switch b {
	case AbortByClient:
		return "aborted by the client"
	case AbortBySlowReader:
		return "aborted: the stream's reader fell behind"
	case AbortBySwitch:
		return "aborted: the server switched its index-K precision and the request did not finish within the drain bound"
	}
	return "aborted by an operator"
}

// abortMsg is one asked-for abort.
type abortMsg struct {
	id uint64
	by AbortBy
}

// push queues r (its later samples with it) for rank 0, unless the inbox
// is closed (ErrClosed). claim runs under the lock before r is queued:
// what it sets is set before the loop can see r, and its error refuses r.
func (b *inbox) push(r *request, claim func() error) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return ErrClosed
	}
	if err := claim(); err != nil {
		b.mu.Unlock()
		return err
	}
	if len(b.pending) == 0 {
		b.oldestPending.Store(r.submit.UnixNano())
	}
	b.pending = append(b.pending, r)
	b.numPending.Store(int64(len(b.pending)))
	b.mu.Unlock()
	b.poke()
	return nil
}

// abort queues the abort of request id; a closed inbox drops it.
func (b *inbox) abort(id uint64, by AbortBy) {
	b.mu.Lock()
	if !b.closed {
		b.aborts = append(b.aborts, abortMsg{id: id, by: by})
	}
	b.mu.Unlock()
	b.poke()
}

// cutSlow queues rank 0's own abort of a request whose reader was too slow
// for a held token; rank 0's loop is the caller, so nothing is woken.
func (b *inbox) cutSlow(id uint64) {
	b.mu.Lock()
	b.aborts = append(b.aborts, abortMsg{id: id, by: AbortBySlowReader})
	b.mu.Unlock()
}

// poke wakes rank 0's loop if it waits for work.
func (b *inbox) poke() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// idle waits, on rank 0, until the inbox changes, the heartbeat passes or
// the engine closes. The heartbeat is a real timer: it only paces the
// loop, and what the next iteration decides (every timeout) reads the
// engine's clock, so on a test's Manual clock an advance takes effect at
// the next beat without the loop stopping between advances.
func (b *inbox) idle() {
	t := time.NewTimer(b.heartbeat)
	defer t.Stop()
	select {
	case <-b.stop:
	case <-b.wake:
	case <-t.C:
	}
}

// take empties the inbox for a step input: the new requests, the aborts,
// the HiCache switch and an offload's prompt (the offload stays until rank
// 0 has run it: offloaded). Without admit (an index-K switch drains the
// engine) the new requests stay, and so do the aborts of requests the
// ranks do not know (known says which): they apply once the requests are
// taken.
func (b *inbox) take(admit bool, known func(id uint64) bool) (pending []*request, aborts []abortMsg, tier *tierOp, offload []int32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	pending, aborts = b.pending, b.aborts
	b.pending, b.aborts = nil, nil
	if admit {
		b.numPending.Store(0)
		b.oldestPending.Store(0)
	} else {
		b.pending, pending = pending, nil
		keep := aborts[:0]
		for _, a := range aborts {
			if !known(a.id) {
				b.aborts = append(b.aborts, a)
			} else {
				keep = append(keep, a)
			}
		}
		aborts = keep
	}
	tier, b.tierOp = b.tierOp, nil
	if op := b.offloadOp; op != nil {
		offload = op.prompt
	}
	return pending, aborts, tier, offload
}

// filterAborts keeps the queued aborts keep says to, in order. keep runs
// under the lock.
func (b *inbox) filterAborts(keep func(abortMsg) bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	kept := b.aborts[:0]
	for _, a := range b.aborts {
		if keep(a) {
			kept = append(kept, a)
		}
	}
	b.aborts = kept
}

// close refuses every later put and returns the requests rank 0 never
// took, for the shutdown to finish; the aborts are dropped.
func (b *inbox) close() []*request {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	pending := b.pending
	b.pending, b.aborts = nil, nil
	b.numPending.Store(0)
	b.oldestPending.Store(0)
	return pending
}

// counts is the inbox as Health reads it, lock-free: the requests waiting
// and when the oldest of them came (unix nanoseconds, 0 when none).
func (b *inbox) counts() (pending int, oldest int64) {
	return int(b.numPending.Load()), b.oldestPending.Load()
}

// putTier queues a HiCache switch for the loops, unless one waits already.
func (b *inbox) putTier(op *tierOp) error {
	b.mu.Lock()
	if b.tierOp != nil {
		b.mu.Unlock()
		return ErrHiCacheBusy
	}
	b.tierOp = op
	b.mu.Unlock()
	b.poke()
	return nil
}

// putIndexK queues an index-K switch for rank 0, unless the inbox is
// closed or a switch drains already; with noop (the server runs in the
// precision asked for already) it queues nothing once those pass. It
// reports whether it queued op.
func (b *inbox) putIndexK(op *indexKOp, noop bool) (bool, error) {
	b.mu.Lock()
	switch {
	case b.closed:
		b.mu.Unlock()
		return false, errors.New("serve: engine closed")
	case b.indexKOp != nil:
		b.mu.Unlock()
		return false, ErrIndexKBusy
	case noop:
		b.mu.Unlock()
		return false, nil
	}
	b.indexKOp = op
	b.mu.Unlock()
	b.poke()
	return true, nil
}

// draining is the index-K switch rank 0 is draining for, nil when none.
func (b *inbox) draining() *indexKOp {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.indexKOp
}

// doneIndexK takes the index-K switch the ranks just ran.
func (b *inbox) doneIndexK() *indexKOp {
	b.mu.Lock()
	defer b.mu.Unlock()
	op := b.indexKOp
	b.indexKOp = nil
	return op
}

// putOffload queues an offload for the loops, unless the inbox is closed
// or one waits already.
func (b *inbox) putOffload(op *offloadOp) error {
	b.mu.Lock()
	switch {
	case b.closed:
		b.mu.Unlock()
		return errors.New("serve: engine closed")
	case b.offloadOp != nil:
		b.mu.Unlock()
		return ErrOffloadBusy
	}
	b.offloadOp = op
	b.mu.Unlock()
	b.poke()
	return nil
}

// offloaded hands rank 0's offload result to the Offload waiting for it.
func (b *inbox) offloaded(res offloadResult) {
	b.mu.Lock()
	op := b.offloadOp
	b.offloadOp = nil
	b.mu.Unlock()
	if op != nil {
		op.done <- res
	}
}
