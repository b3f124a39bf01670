package dist

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Op names a collective.
type Op uint8

// The collectives.
const (
	OpNone Op = iota // no call; the zero value
	OpAllReduceSum
	OpAllReduceMin
	OpAllReduceMax
	OpBroadcast
	OpAllGather
	OpBarrier
)

func (o Op) String() string {
	switch o {
	case OpNone:
		return "None"
	case OpAllReduceSum:
		return "AllReduceSum"
	case OpAllReduceMin:
		return "AllReduceMin"
	case OpAllReduceMax:
		return "AllReduceMax"
	case OpBroadcast:
		return "Broadcast"
	case OpAllGather:
		return "AllGather"
	case OpBarrier:
		return "Barrier"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// DefaultFlightRecorderLen is the flight recorder's length when
// Options.FlightRecorderLen is zero.
const DefaultFlightRecorderLen = 256

// Options configure a Group. The zero value is valid.
type Options struct {
	// Name says which communicator the group is (a server runs a "control"
	// one for its loop's agreements and a "forward" one for the model's
	// collectives); snapshots and stalls carry it.
	Name string
	// FlightRecorderLen is how many calls each rank's flight recorder keeps;
	// 0 means DefaultFlightRecorderLen.
	FlightRecorderLen int
	// Clock stamps the flight recorder's start and end times and gives the
	// watchdog its "now"; nil means time.Now.
	Clock func() time.Time
	// Watchdog, when positive, is the stall threshold of a watchdog goroutine
	// that checks every Watchdog/2 (on real time, or a synctest bubble's) and
	// calls OnStall once per stalled seq. Zero: no watchdog.
	Watchdog time.Duration
	// OnStall receives the watchdog's reports, on the watchdog's goroutine.
	// It must return promptly and must not call the group's collectives.
	// Required when Watchdog > 0.
	OnStall func(Stall)
	// Inject, when set, is a fault hook for chaos tests, called on a rank's
	// goroutine before each collective it enters. Blocking in it stalls the
	// rank outside the collective (its peers wait, the watchdog sees it
	// missing). A non-nil error makes the rank skip the collective as if it
	// had left mid-call: the call returns that error and the group breaks.
	Inject func(rank int, seq uint64, op Op) error
}

// Group is one TP group of Size ranks. Each rank's goroutine uses its own
// Comm, from Rank. Snapshot, Stuck and Close may be called from any goroutine.
type Group struct {
	name   string
	size   int
	clock  func() time.Time
	inject func(rank int, seq uint64, op Op) error
	comms  []*Comm

	mu     sync.Mutex
	cur    *round // the open round; nil between rounds
	closed bool
	broken error          // non-nil once broken; wraps ErrGroupBroken
	failed uint64         // the seq at which the group broke
	late   *MismatchError // that seq's mismatch, if any, with the calls of ranks that came later
	f32    []float32
	i64    []int64
	bytes  []byte

	// Copies of closed and broken for readers that must not take mu.
	closedFlag atomic.Bool
	brokenMsg  atomic.Pointer[string]

	closeOnce sync.Once
	stop      chan struct{}
	wg        sync.WaitGroup
}

// round is one seq's rendezvous. Its fields are guarded by the group's mu
// until done is closed; after that err and the res* slices are read-only.
type round struct {
	seq     uint64
	calls   []Call
	args    []arg
	n       int // ranks arrived
	done    chan struct{}
	settled bool // done is closed
	err     error

	resF32   []float32 // in the group's scratch
	resI64   []int64
	resBytes []byte
}

// arg holds one rank's buffers for the round.
type arg struct {
	f32 []float32
	i64 []int64
	b   []byte
}

// NewGroup makes a TP group of size ranks.
func NewGroup(size int, opts Options) (*Group, error) {
	if size < 1 {
		return nil, fmt.Errorf("dist: group size %d, want at least 1", size)
	}
	if opts.FlightRecorderLen < 0 {
		return nil, fmt.Errorf("dist: FlightRecorderLen %d is negative", opts.FlightRecorderLen)
	}
	if opts.FlightRecorderLen == 0 {
		opts.FlightRecorderLen = DefaultFlightRecorderLen
	}
	if opts.Watchdog < 0 {
		return nil, fmt.Errorf("dist: Watchdog %v is negative", opts.Watchdog)
	}
	if opts.Watchdog > 0 && opts.OnStall == nil {
		return nil, errors.New("dist: Watchdog set without OnStall")
	}
	if opts.Clock == nil {
		opts.Clock = time.Now
	}
	g := &Group{name: opts.Name, size: size, clock: opts.Clock, inject: opts.Inject, stop: make(chan struct{})}
	g.comms = make([]*Comm, size)
	for r := range g.comms {
		g.comms[r] = &Comm{g: g, rank: r, ring: make([]atomic.Pointer[Record], opts.FlightRecorderLen)}
	}
	if opts.Watchdog > 0 {
		g.wg.Add(1)
		go g.watch(opts.Watchdog, opts.OnStall)
	}
	return g, nil
}

// Size is the number of ranks.
func (g *Group) Size() int { return g.size }

// Name is the communicator's name from Options.Name.
func (g *Group) Name() string { return g.name }

// Rank returns rank r's communicator; the same one on every call. It panics
// when r is out of range.
func (g *Group) Rank(r int) *Comm {
	if r < 0 || r >= g.size {
		panic(fmt.Sprintf("dist: rank %d of a group of %d", r, g.size))
	}
	return g.comms[r]
}

// Close wakes every waiting call with ErrGroupClosed, makes later calls
// return it and stops the watchdog. It is idempotent and returns nil.
func (g *Group) Close() error {
	g.closeOnce.Do(func() {
		g.mu.Lock()
		g.closed = true
		g.closedFlag.Store(true)
		if r := g.cur; r != nil {
			g.settle(r, ErrGroupClosed)
		}
		g.mu.Unlock()
		close(g.stop)
		g.wg.Wait()
	})
	return nil
}

// join enters rank's call at seq. On success the caller waits on the
// returned round's done channel; it may already be closed.
//
// The call is published to rank's flight recorder under mu, so a rank seen
// waiting by a lock-free reader has registered in the round by the time the
// reader can take mu.
func (g *Group) join(rank int, seq uint64, c Call, a arg, start time.Time) (*round, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.comms[rank].begin(seq, c, start)
	if g.closed {
		return nil, ErrGroupClosed
	}
	if g.broken != nil {
		// A late rank at the seq of a mismatch hears of the mismatch, with
		// its own call added; anything else hears that the group is broken.
		if g.late != nil && g.failed == seq {
			g.late.Calls[rank] = c
			return nil, g.late.clone()
		}
		return nil, g.broken
	}
	r := g.cur
	if r == nil {
		r = &round{seq: seq, calls: make([]Call, g.size), args: make([]arg, g.size), done: make(chan struct{})}
		for i := range r.calls {
			r.calls[i] = Call{Rank: i}
		}
		g.cur = r
	}
	if invariants && (r.seq != seq || r.calls[rank].Arrived) {
		panic(fmt.Sprintf("dist: rank %d entered seq %d while round %d is open (arrived twice: %v)",
			rank, seq, r.seq, r.calls[rank].Arrived))
	}
	r.calls[rank] = c
	r.args[rank] = a
	r.n++
	if reason := g.check(r, rank); reason != "" {
		err := &MismatchError{Seq: seq, Reason: reason, Calls: append([]Call(nil), r.calls...)}
		g.settle(r, err)
		g.breakAt(seq, err)
		g.late = err.clone()
		return r, nil
	}
	if r.n == g.size {
		g.compute(r)
		g.settle(r, nil)
	}
	return r, nil
}

// leave is called by a rank that gives up on its call at seq: its ctx ended
// while it waited in round r, or (r nil) an injected fault made it skip the
// call. Unless r settled first (then leave reports true and the rank takes
// its result), the open round fails and the group breaks.
func (g *Group) leave(r *round, rank int, seq uint64, op Op, cause error) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if r != nil && r.settled {
		return true
	}
	if g.closed || g.broken != nil {
		return false
	}
	err := fmt.Errorf("%w: rank %d left seq %d (%v): %v", ErrGroupBroken, rank, seq, op, cause)
	if g.cur != nil {
		g.settle(g.cur, err)
	}
	g.breakAt(seq, err)
	return false
}

// settle ends round r with err (nil: success) and wakes its waiters.
func (g *Group) settle(r *round, err error) {
	r.err = err
	r.settled = true
	close(r.done)
	if g.cur == r {
		g.cur = nil
	}
}

// breakAt marks the group broken by a failure at seq.
func (g *Group) breakAt(seq uint64, cause error) {
	if g.broken != nil {
		return
	}
	if errors.Is(cause, ErrGroupBroken) {
		g.broken = cause
	} else {
		g.broken = fmt.Errorf("%w at seq %d: %v", ErrGroupBroken, seq, cause)
	}
	g.failed = seq
	msg := g.broken.Error()
	g.brokenMsg.Store(&msg)
}

// check validates rank's call on its own and against the first other rank
// that arrived. It returns what differs, or "".
func (g *Group) check(r *round, rank int) string {
	c := r.calls[rank]
	if c.Op == OpBroadcast && (c.Root < 0 || c.Root >= g.size) {
		return fmt.Sprintf("rank %d: root %d out of range", rank, c.Root)
	}
	if c.Op == OpAllGather && c.Out != g.size*c.Count {
		return fmt.Sprintf("rank %d: AllGather out has %d elements, want %d×%d", rank, c.Out, g.size, c.Count)
	}
	for i, o := range r.calls {
		if i == rank || !o.Arrived {
			continue
		}
		switch {
		case o.Op != c.Op:
			return "op"
		case o.Elem != c.Elem:
			return "element type"
		case o.Root != c.Root:
			return "root"
		case o.Tag != c.Tag && o.Tag != "" && c.Tag != "":
			// The same operation for another purpose: the ranks are in
			// different phases of their protocol, which a collective
			// layer that checks only shapes would let pass or hang.
			return "tag"
		case c.Elem == ElemByte:
			// BroadcastBytes: only the root knows the length.
		case o.Count != c.Count:
			return "length"
		}
		return ""
	}
	return ""
}

// compute produces round r's result, in rank order, into the group's
// scratch. Every rank has arrived and is waiting, so its buffer is stable.
// The scratch is free: every rank has left the previous round.
func (g *Group) compute(r *round) {
	c := r.calls[0]
	switch c.Op {
	case OpAllReduceSum, OpAllReduceMin, OpAllReduceMax:
		switch c.Elem {
		case ElemFloat32:
			r.resF32 = reduceRanks(c.Op, &g.f32, c.Count, len(r.args), func(i int) []float32 { return r.args[i].f32 })
		case ElemInt64:
			r.resI64 = reduceRanks(c.Op, &g.i64, c.Count, len(r.args), func(i int) []int64 { return r.args[i].i64 })
		}
	case OpBroadcast:
		root := r.args[c.Root]
		switch c.Elem {
		case ElemFloat32:
			out := grow(&g.f32, len(root.f32))
			copy(out, root.f32)
			r.resF32 = out
		case ElemByte:
			out := grow(&g.bytes, len(root.b))
			copy(out, root.b)
			r.resBytes = out
		}
	case OpAllGather:
		n := c.Count
		out := grow(&g.f32, n*g.size)
		for i, a := range r.args {
			copy(out[i*n:(i+1)*n], a.f32)
		}
		r.resF32 = out
	case OpBarrier:
	}
}

// reduceRanks folds every rank's buffer into scratch in rank order 0..N-1,
// so the result does not depend on the order the ranks arrived in.
func reduceRanks[T float32 | int64](op Op, scratch *[]T, count, ranks int, buf func(rank int) []T) []T {
	out := grow(scratch, count)
	copy(out, buf(0))
	for r := 1; r < ranks; r++ {
		src := buf(r)[:count]
		switch op {
		case OpAllReduceSum:
			for i, v := range src {
				out[i] += v
			}
		case OpAllReduceMin: // the builtin propagates NaN
			for i, v := range src {
				out[i] = min(out[i], v)
			}
		case OpAllReduceMax:
			for i, v := range src {
				out[i] = max(out[i], v)
			}
		}
	}
	return out
}

// grow returns (*s)[:n], reallocating when the capacity is short.
func grow[T any](s *[]T, n int) []T {
	if cap(*s) < n {
		*s = make([]T, n)
	}
	return (*s)[:n]
}
