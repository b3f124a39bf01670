// Package serve is the colocated serving engine: prefill and decode in one
// process, over TP ranks. There is no HTTP here; the HTTP server calls
// [Engine.Submit].
//
// # One loop per rank
//
// Each TP rank runs its own event loop goroutine (pprof labels server, role
// and rank) with its own scheduler (engine/sched), its own KV pool, its own
// radix prefix cache (engine/prefix), its shard of the weights (engine/tp)
// and, on a prefill or decode server, its own PD queue machine
// (engine/pd/rooms). The loops move in lock-step through two communicators
// of the rank group (engine/dist): "control" for the loop's agreements and
// "forward" for the model's collectives. The order of an iteration's
// collectives is a table in engine/rankcore (rankcore.Lockstep,
// rankcore.Overlap; its package doc prints both): in each phase every rank
// proposes a value (its PD votes, its prefix matches, its free pages, its
// plan's digest; rank 0 its inbox and its sampled tokens), the group
// reduces or broadcasts it, and every rank applies the agreed value. The
// loop enters each phase through its rank's rankcore.Cursor (agreeInts,
// agreeBytes and enterForward in loop.go), which refuses a phase out of
// the table's order, and tags the collective with the phase's name, which
// the flight recorder keeps and the collective layer checks across ranks.
// In words: rank 0 broadcasts the step input; every rank applies it (PD
// requests to the PD machine, aborts, timeouts, its own PD mail); the
// ranks agree on the PD votes, the prefix matches of the requests that
// join, the room (a decode grants pages to its transfers within it) and
// the plan's digest (a divergence stops the engine); each rank runs its
// shard of the batch; rank 0 samples, streams and broadcasts the tokens
// with the aborts that came during the step; every rank applies them,
// sends the step's KV (prefill), forks samples, finishes what stopped and
// publishes its step record.
//
// # PD
//
// On a prefill or decode server each rank's engine/pd/rooms machine holds
// the PD life of every request (its package doc and testdata/ traces tell
// it); this package is its executor: it files mail and peer liveness into
// the machine, reduces the machine's votes across the ranks, and carries
// out the actions it returns (reserve and release pages, write landed KV,
// send messages, join the scheduler, end streams). A send that fails is
// the rank's vote of Failed with the send error, so every rank fails the
// room in the same iteration with the real cause.
//
// The rule, which every change to the loop must keep: every decision that
// precedes a collective or changes queue or allocator state is taken from
// values all ranks agree on: broadcast by rank 0 or reduced over the
// group. No rank branches on its own state (its clock, its inbox, its
// pool) before a collective. Rank 0's local state (the inbox, the streams,
// its clock) enters the other ranks only through its broadcasts.
//
// # Streams
//
// Each [Stream] carries an event channel of capacity MaxTokens+1: one slot
// per token it can ever produce plus one for the Finish, after which the
// channel is closed. A slow reader therefore never stalls the loop; should a
// send ever find the buffer full all the same, rank 0 does not block: it
// aborts the request with reason "error: reader too slow".
//
// # Samples
//
// A request of N > 1 samples ([Engine.SubmitN]) reserves N consecutive ids
// and gives one stream per sample; aborting any of them, or its context
// ending, aborts all. The ranks admit and prefill the first sample only. On
// a colocated server, at its first token rank 0 samples N first tokens from
// the same logits (sample i seeded with Seed+i) and broadcasts them, and
// every rank forks N-1 sequences holding a copy of the prompt's KV, which
// join the scheduler as a PD decode arrival does. On a decode server the
// one transfer brings the prompt's KV and the first sample's token; each
// other sample starts on a copy of all but the prompt's last token and
// samples its own first token after running that one token. The room to
// fork in is MIN-reduced over the ranks; fork.go tells the rest.
//
// # Reading the engine from outside
//
// After every iteration each rank publishes an immutable [StepRecord] (with
// the sequence numbers of its last collective on each communicator) and rank 0 an
// [EngineSnapshot] (its scheduler's queues, copied by the loop itself),
// through atomic pointers, plus heartbeat times. [Engine.LastStep],
// [Engine.RankSteps], [Engine.Snapshot], [Engine.Health], [Engine.KVPages]
// and [Engine.Collectives] read only atomics: no locks, no help from the
// loops, so they answer while a loop is stuck. Each rank also keeps a
// decision log, its last iterations' agreed inputs and decisions, which
// [Engine.Decisions] reads, stuck loops included (decisions.go). For latencies,
// [Config.Observer] is told of every token, finished request and forward
// step, on rank 0's goroutine, with the loop's timestamps.
//
// # Prefix cache
//
// A new request's prompt (all but its last token) is matched against each
// rank's cache when it arrives; the matched pages stay locked while it
// waits, it is admitted at the matched length and shares those pages. A
// finished or retracted sequence gives its full pages to the cache; a
// retracted request gives its prefix up and is recomputed from position 0.
// Cached pages that nothing uses are evicted, least recently used first,
// when a step needs the room. When nothing runs and the head of the queue
// does not fit because the requests waiting behind it hold the pool's
// pages locked, the newest of them give their cached prefixes up until it
// fits (Totals.Unstalls).
//
// With HiCache (Config.HiCache) each rank's cache has a host tier: pages are
// backed up to host memory by a writer goroutine and loaded back, layer by
// layer, while the forward pass runs; host hits are MIN-reduced with the
// match in step 3, the load starts at the request's first admission, the
// forward pass reads its pages through per-layer KV and index-K gates, and
// the load settles before anything else reads them. hicache.go tells it.
//
// # Recovery
//
// With Config.CollectiveTimeout set, a collective that waits past it, or a
// group that broke on a mismatch, does not end the engine: the supervisor
// gives the group up, ends the requests in flight with the reason, frees
// their pages, rebuilds the ranks with a new PD boot number and serves again
// (recover.go; Engine.LastFailure keeps what the failed group looked like).
// Without it, an engine whose step fails finishes every request with an
// error and must be rebuilt.
//
// # Overlap
//
// With Config.Schedule = ScheduleOverlap a goroutine beside each rank's
// forward pass runs the next iteration's front half and plans it against
// the step's predicted outcome; the step lands before the next one starts,
// and what stopped in it leaves the next batch (overlap.go). The decisions
// and their values are the lock-step loop's. ResolveSchedule says which
// loop suits a machine.
//
// Stop sequences are token ids (Request.Stop); stop strings belong to the
// HTTP layer that owns detokenization.
package serve

import (
	"context"
	"errors"
	"fmt"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/tp"
)

// ErrClosed is returned by Submit on a closed Engine.
var ErrClosed = errors.New("serve: engine closed")

// ErrRoomInUse is returned by Submit for a PD request whose bootstrap room
// belongs to another live request of this server.
var ErrRoomInUse = errors.New("serve: bootstrap room in use")

// Finish reasons besides "error: ..." texts.
const (
	ReasonStop    = "stop"
	ReasonLength  = "length"
	ReasonAbort   = "abort"
	ReasonTimeout = "timeout"
	// ReasonSlowReader finishes a request whose event buffer was full.
	ReasonSlowReader = "error: reader too slow"
	ReasonClosed     = "error: engine closed"
)

// Request is one generation.
type Request struct {
	Prompt    []int32
	MaxTokens int
	Sampling  sample.Params
	IgnoreEOS bool    // keep generating past end-of-generation tokens
	Stop      []int32 // further token ids that end the generation
	// PD is set, and required, on a prefill or decode server: the request
	// is one side of a disaggregated request (see PDConfig). A prefill
	// server computes the prompt's KV and the first token only.
	PD *PDRequest
	// N is the number of samples of the prompt (0 or 1: one); more go
	// through SubmitN. The prompt is prefilled once: at its first token
	// rank 0 samples N first tokens from the same logits (sample i with
	// seed Sampling.Seed+i) and every rank forks N-1 sequences from the
	// prompt's KV, which then decode on their own.
	N int
	// NoCache computes the whole prompt: the request reads nothing from the
	// prefix cache or its host tier (its pages still go to the cache when
	// it ends). A reference, or a canary, that must not depend on cached KV.
	NoCache bool
}

// MaxN bounds Request.N.
const MaxN = 16

// Event is one token (Finish nil) or the request's end (Finish set; the
// last event, after which the channel is closed).
type Event struct {
	Token  int32
	Finish *Finish
}

// Finish ends a stream. The token that stopped a generation (an EOG or Stop
// token) was sent as a Token event before it and counts as a completion
// token.
type Finish struct {
	Reason           string // stop, length, abort, timeout or "error: ..."
	PromptTokens     int
	CompletionTokens int
}

// Stream is one submitted request's output.
type Stream struct {
	ID     uint64
	Events <-chan Event
	e      *Engine
	once   sync.Once
	n      int // samples of the request (ids ID-Index .. ID-Index+n-1)
	// Index is the stream's sample (0 for the first) of a request with
	// Request.N > 1.
	Index int
}

// Abort ends the request in whatever state it is, every sample of it; it
// never blocks and may be called any number of times, also after the
// request finished.
func (s *Stream) Abort() {
	s.once.Do(func() {
		base := s.ID - uint64(s.Index)
		for i := range max(1, s.n) {
			s.e.abort(base+uint64(i), AbortByClient)
		}
	})
}

// AbortSample ends this stream's sample only, leaving the request's other
// samples running (a sample that met a stop string); with one sample it is
// Abort.
func (s *Stream) AbortSample() {
	if s.n <= 1 {
		s.Abort()
		return
	}
	s.e.abort(s.ID, AbortByClient)
}

// StepRecord describes one loop iteration of one rank. It is immutable once
// published. Step counts iterations, idle ones (no batch, Phase "idle")
// included; ranks in lock-step have equal Step, Digest, ControlSeq and ForwardSeq
// after each iteration.
type StepRecord struct {
	Rank int
	// Loop is the event loop the rank runs: LoopLockstep or LoopOverlap.
	Loop        string
	Step        uint64
	Phase       string // idle, prefill, decode or mixed
	BatchSize   int    // requests in the batch
	BatchTokens int    // tokens in the batch
	Retracted   int    // requests retracted by the plan
	Finished    int    // requests that finished in the iteration
	Digest      uint64 // FNV-1a of (id, start, tokens) of every batch item, in order
	// ControlSeq and ForwardSeq are the sequence numbers of the rank's
	// last collective on each communicator when the iteration ended.
	ControlSeq, ForwardSeq uint64
	Start, End             time.Time
	// ForwardStart and ForwardEnd bound the step's forward pass on this
	// rank (zero when none ran): in the overlap loop it runs while the
	// next iteration has started, so it is not inside Start..End.
	ForwardStart, ForwardEnd time.Time
}

// EngineSnapshot is the engine's state as the loop last published it.
// Readers must not modify it.
type EngineSnapshot struct {
	Taken  time.Time
	Step   StepRecord
	Queue  sched.Snapshot
	Totals Totals
	Err    string // the error that stopped the engine, if any
}

// Totals count since the engine started.
type Totals struct {
	Steps        uint64 // forward steps run
	Tokens       uint64 // tokens run through the model (prefill and decode)
	Sampled      uint64 // tokens sampled
	Retractions  uint64 // requests retracted to free KV
	Aborts       uint64 // requests finished by an abort
	AbortsInStep uint64 // of those, aborted while in the step in flight
	Finished     uint64 // requests finished, by any reason
	// Prefix cache: prompt tokens of admitted requests, and of those the
	// ones read from cached pages instead of computed.
	PromptTokens    uint64
	CachedTokens    uint64
	PrefixHits      uint64 // requests that matched at least one cached page
	PrefixEvictions uint64 // cached pages evicted (rank 0)
	IndexKSwitches  uint64 // live index-K precision switches done
	// PlannedAhead counts steps the overlap loop planned while the step
	// before them was in flight (and ran).
	PlannedAhead uint64
	// Unstalls counts waiting requests that gave their cached prefix up
	// because nothing ran and the queue's head did not fit (loop.go).
	Unstalls uint64
	// Restarts counts the rank group's rebuilds after a stalled
	// collective or a broken group (recover.go).
	Restarts uint64
}

// LoopLockstep names the rank loop that runs each iteration's forward pass
// in line with the rest of it (the engine's only loop today).
const LoopLockstep = "lockstep"

// Health reports progress, not only liveness.
type Health struct {
	LoopAge       time.Duration // since the least recent start of an iteration over the ranks
	Step          uint64
	Waiting       int           // requests queued in the scheduler
	Running       int           // admitted requests (prefilling and decoding)
	Pending       int           // submitted, not yet taken by the loop
	OldestWaiting time.Duration // age of the oldest waiting or pending request
	Err           string
}

// clock is the engine's time: rank 0 reads it and broadcasts it, and
// every deadline (scheduler and PD timeouts) is judged on it.
func (e *Engine) clock() time.Duration {
	return time.Since(e.epoch) + time.Duration(e.skew.Load())
}

// Engine is the serving engine. Its methods are safe for concurrent use.
type Engine struct {
	m      *model.Model
	cfg    Config
	shards *tp.Shards
	epoch  time.Time
	vocab  int
	loops  []*rankLoop
	// held are the tokens the overlap loop sampled but has not streamed
	// yet (emit.go); rank 0's loop owns them.
	held    []heldToken
	holding bool // the step being sampled holds its tokens (emit.go)
	// skew is added to the engine's clock: the tests move it forward to
	// reach a timeout without waiting for it.
	skew atomic.Int64

	nextID atomic.Uint64

	mu      sync.Mutex // guards the inbox; never held across work
	closed  bool
	pending []*request
	aborts  []abortMsg
	tierOp  *tierOp // a HiCache switch for the loops, nil when none
	// indexKOp is an index-K precision switch draining the engine, nil
	// when none (indexk.go).
	indexKOp *indexKOp
	// offloadOp is an Offload for the loops, nil when none (hicache.go).
	offloadOp *offloadOp
	wake      chan struct{} // capacity 1: the inbox changed

	// The inbox as Health sees it without the lock.
	numPending    atomic.Int64
	oldestPending atomic.Int64 // unix nanoseconds; 0 when none

	stop     chan struct{}
	done     chan struct{} // closed once every loop has stopped and shutdown ran
	once     sync.Once
	closeErr error

	// control is the loops' communicator; the forward pass's is the
	// shards' group.
	control *dist.Group

	snap atomic.Pointer[EngineSnapshot]
	// inc is the incarnation serving now, for readers off the loops
	// (recover.go); lastFailure the failure of the last one given up.
	inc         atomic.Pointer[incarnation]
	lastFailure atomic.Pointer[Failure]
	restarts    atomic.Uint64
	stalls      atomic.Uint64 // collectives the watchdog reported
	pd          *pdEngine     // nil on a colocated server
	faults      faultSet

	hicacheBandwidth atomic.Int64 // the loaders' pacing, bytes/s (0 unlimited)
	indexK           atomic.Int32 // the index-K precision now (kernels.IndexKDType)
	rooms            sync.Map     // bootstrap room -> request id, for live PD requests

	// Rank 0's: the front of every request the ranks know (stream,
	// sampler), and the totals. Owned by rank 0's loop while it runs, then
	// by the shutdown.
	front  map[uint64]*request
	totals Totals
	err    error // the failure that stopped the loops
}

// request is rank 0's view of a request: what only the rank that samples
// and streams needs.
type request struct {
	id      uint64
	req     Request
	submit  time.Time
	events  chan Event
	sampler *sample.Sampler
	gen     int
	cut     string // why an abort was asked for
	stop    func() bool
	lastTok time.Time  // when the previous token was emitted
	served  bool       // its queue wait was reported (QueueObserver)
	forks   []*request // the later samples (Request.N > 1), first sample only
	// roomHeld: the stream ended while the PD machine still holds the
	// room (a decode waiting for its abort's ack); the room stays taken
	// until the machine forgets it (pdexec.go).
	roomHeld bool
}

// New builds the ranks (cfg.TP of them, each with the kernels of
// cfg.Backend), their schedulers and prefix caches, and the two
// communicators of the TP group, and starts one loop goroutine per rank,
// which run until Close.
//
// The ranks talk over two communicators: "forward", the model's own
// collectives inside a forward pass, and "control", the loop's agreements
// (the step input, the poll and free-page reductions, the prefix match,
// the plan digest and the step output). Each has its own sequence numbers,
// flight recorder and watchdog, so an operator sees which of the two a
// wedged rank waits in, and a loop that prepares the next step while the
// forward runs never interleaves its calls with the model's.
func New(m *model.Model, cfg Config) (*Engine, error) {
	cfg.setDefaults(m)
	if err := cfg.Validate(m); err != nil {
		return nil, err
	}
	e := &Engine{
		m: m, cfg: cfg, epoch: time.Now(), vocab: m.Config.VocabSize,
		wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
		front: make(map[uint64]*request),
	}
	for _, name := range cfg.Faults {
		e.faults.set(faultIndex(name), true) // checked by Validate
	}
	e.hicacheBandwidth.Store(cfg.HiCache.LoadBandwidth)
	e.indexK.Store(int32(cfg.IndexK))
	if cfg.Role != pdproto.RoleColocated {
		pd, err := newPDEngine(cfg.PD)
		if err != nil {
			return nil, err
		}
		e.pd = pd
	}
	if err := e.build(nil); err != nil {
		if e.pd != nil {
			e.pd.stop()
			e.pd.wg.Wait()
		}
		return nil, err
	}
	go pprof.Do(context.Background(), pprof.Labels("server", cfg.Name, "role", cfg.Role), func(ctx context.Context) { e.run(ctx) })
	return e, nil
}

// run is the engine's supervisor goroutine: it starts the rank loops, waits
// for all of them and finishes what they left.
func (e *Engine) run(ctx context.Context) {
	defer close(e.done)
	for {
		errs, stalled, snaps := e.runLoops(ctx)
		closing := false
		select {
		case <-e.stop:
			closing = true
		default:
		}
		var failed error
		for _, err := range errs {
			if err == nil || (closing && errors.Is(err, dist.ErrGroupClosed)) {
				continue
			}
			// A rank's own failure comes before what its peers saw of it.
			if failed == nil || errors.Is(failed, dist.ErrGroupClosed) || errors.Is(failed, dist.ErrGroupBroken) {
				failed = err
			}
		}
		// Recovery (recover.go): a stalled collective, or a group broken
		// on a mismatch or a divergence, rebuilds the rank group.
		reason := ""
		switch {
		case closing:
		case stalled != nil:
			reason = stallReason(*stalled, e.cfg.CollectiveTimeout)
		case e.cfg.CollectiveTimeout > 0 && failed != nil && recoverable(failed):
			reason = failed.Error()
		}
		if reason == "" {
			e.err = failed
			break
		}
		if !e.restart(reason, snaps) {
			break
		}
	}
	e.shutdown()
}

// Config returns the effective configuration.
func (e *Engine) Config() Config { return e.cfg }

// Submit queues a request. The request is aborted as soon as ctx ends (a
// client that disconnects).
func (e *Engine) Submit(ctx context.Context, q Request) (*Stream, error) {
	if q.N > 1 {
		return nil, fmt.Errorf("serve: a request of %d samples goes through SubmitN", q.N)
	}
	ss, err := e.SubmitN(ctx, q)
	if err != nil {
		return nil, err
	}
	return ss[0], nil
}

// SubmitN queues a request of q.N samples (at least one) and returns one
// stream per sample, in order. Aborting any of them, or ctx ending, aborts
// all of them.
func (e *Engine) SubmitN(ctx context.Context, q Request) ([]*Stream, error) {
	c := &e.m.Config
	n := max(1, q.N)
	if q.N < 0 || q.N > MaxN {
		return nil, fmt.Errorf("serve: n %d must be between 1 and %d", q.N, MaxN)
	}
	if e.cfg.Role == pdproto.RolePrefill {
		// The prefill computes the prompt and the first sample's first
		// token once; the decode forks the other samples.
		n, q.N = 1, 0
	}
	if n > e.cfg.MaxRunning {
		return nil, fmt.Errorf("serve: %d samples exceed the %d requests the engine runs at once", n, e.cfg.MaxRunning)
	}
	if len(q.Prompt) == 0 {
		return nil, errors.New("serve: empty prompt")
	}
	if q.MaxTokens < 1 {
		return nil, fmt.Errorf("serve: max tokens %d must be positive", q.MaxTokens)
	}
	if n := len(q.Prompt) + q.MaxTokens; n > c.ContextLen {
		return nil, fmt.Errorf("serve: prompt of %d tokens plus %d to generate exceeds the context length %d", len(q.Prompt), q.MaxTokens, c.ContextLen)
	}
	if pages := n * ((len(q.Prompt) + q.MaxTokens - 1 + e.cfg.PageSize - 1) / e.cfg.PageSize); pages > e.cfg.Pages() {
		if n > 1 {
			return nil, fmt.Errorf("serve: %d samples need %d KV pages, the pool has %d", n, pages, e.cfg.Pages())
		}
		return nil, fmt.Errorf("serve: request needs %d KV pages, the pool has %d", pages, e.cfg.Pages())
	}
	for _, t := range q.Prompt {
		if t < 0 || int(t) >= c.VocabSize {
			return nil, fmt.Errorf("serve: prompt token %d out of vocabulary (%d)", t, c.VocabSize)
		}
	}
	if err := q.Sampling.Validate(); err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	switch role := e.cfg.Role; {
	case role == pdproto.RoleColocated && q.PD != nil:
		return nil, errors.New("serve: a colocated server takes no bootstrap room")
	case role != pdproto.RoleColocated && q.PD == nil:
		return nil, fmt.Errorf("serve: a %s server takes only PD requests (with a bootstrap room): send requests through the router", role)
	case role == pdproto.RoleDecode && q.PD.BootstrapURL == "":
		return nil, errors.New("serve: a PD request to a decode server needs the prefill's bootstrap URL")
	case role == pdproto.RolePrefill && q.PD.BootstrapURL != "":
		return nil, errors.New("serve: a prefill server takes no bootstrap URL")
	}
	if q.PD != nil {
		pd := *q.PD
		q.PD = &pd
	}
	if role := e.cfg.Role; role == pdproto.RoleDecode {
		url, err := e.checkBootstrapURL(q.PD.BootstrapURL)
		if err != nil {
			return nil, err
		}
		q.PD.BootstrapURL = url
		e.resolved(url) // start the lookup now
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	q.Prompt = slices.Clone(q.Prompt)
	q.Stop = slices.Clone(q.Stop)
	// n consecutive ids: sample i is the first's id plus i on every rank.
	first := e.nextID.Add(uint64(n)) - uint64(n) + 1
	var r *request
	streams := make([]*Stream, n)
	for i := range n {
		sp := q.Sampling
		sp.Seed += uint64(i)
		x := &request{
			id: first + uint64(i), req: q, submit: time.Now(),
			events:  make(chan Event, q.MaxTokens+1),
			sampler: sample.New(sp),
		}
		streams[i] = &Stream{ID: x.id, Events: x.events, e: e, n: n, Index: i}
		if i == 0 {
			r = x
		} else {
			r.forks = append(r.forks, x)
		}
	}
	s := streams[0]
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	if q.PD != nil {
		// A room belongs to one live request on each side: two would
		// share one mailbox, and one's KV could land in the other.
		if other, taken := e.rooms.LoadOrStore(q.PD.Room, r.id); taken {
			e.mu.Unlock()
			e.pd.roomsInUse.Add(1)
			return nil, fmt.Errorf("%w: bootstrap room %d belongs to live request %d", ErrRoomInUse, q.PD.Room, other)
		}
	}
	// Registered before the loop can see the request, so that the loop's
	// call of stop at the finish always finds it set.
	r.stop = context.AfterFunc(ctx, s.Abort)
	if n > 1 {
		// The client's context aborts every sample until the last ends.
		stop, left := r.stop, new(atomic.Int32)
		left.Store(int32(n))
		last := func() bool {
			if left.Add(-1) == 0 {
				return stop()
			}
			return true
		}
		r.stop = last
		for _, f := range r.forks {
			f.stop = last
		}
	}
	if len(e.pending) == 0 {
		e.oldestPending.Store(r.submit.UnixNano())
	}
	e.pending = append(e.pending, r)
	e.numPending.Store(int64(len(e.pending)))
	e.mu.Unlock()
	e.poke()
	return streams, nil
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

// Abort aborts request id (a Stream's ID) in whatever state it is, for an
// abort by id from an admin call. It never blocks; an unknown or finished
// id is ignored.
func (e *Engine) Abort(id uint64) { e.abort(id, AbortByOperator) }

func (e *Engine) abort(id uint64, by AbortBy) {
	e.mu.Lock()
	if !e.closed {
		e.aborts = append(e.aborts, abortMsg{id: id, by: by})
	}
	e.mu.Unlock()
	e.poke()
}

func (e *Engine) poke() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Close stops the loops at their next iteration, finishes every request
// still known with "error: engine closed" and closes the ranks. A loop that
// does not stop within Config.CloseTimeout (stuck in a collective) is woken
// by closing the rank group. It is idempotent.
func (e *Engine) Close() error {
	e.once.Do(func() {
		close(e.stop)
		e.poke()
		t := time.NewTimer(e.cfg.CloseTimeout)
		select {
		case <-e.done:
		case <-t.C:
			e.closeGroups()
			<-e.done
		}
		t.Stop()
		e.closeErr = errors.Join(e.closeTiers(), e.closePD(), e.control.Close(), e.shards.Close())
	})
	return e.closeErr
}

// closeTiers stops every rank's HiCache loader and writer once the loops
// are gone (or were never started), checks each tier's accounting against
// its cache, and gives the host pools' memory back to the OS. It returns
// what the checks found; a pool it could not close keeps its memory.
func (e *Engine) closeTiers() error {
	var errs []error
	for _, l := range e.loops {
		if l.cache == nil {
			continue
		}
		if ld := l.cache.Loader(); ld != nil {
			ld.Close()
		}
		if w := l.cache.Writer(); w != nil {
			w.Close()
		}
		h := l.cache.Host()
		if h == nil {
			continue
		}
		if err := errors.Join(l.cache.Check(), h.Check(), h.Close()); err != nil {
			errs = append(errs, fmt.Errorf("serve: rank %d: closing the host tier: %w", l.r, err))
		}
	}
	return errors.Join(errs...)
}

// closePD stops the registry lookups and closes the ranks' sockets.
func (e *Engine) closePD() error {
	if e.pd == nil {
		return nil
	}
	e.pd.stop()
	e.pd.wg.Wait()
	var errs []error
	for _, l := range e.loops {
		if l.pd != nil {
			errs = append(errs, l.pd.close())
		}
	}
	return errors.Join(errs...)
}

// LastStep returns the record of rank 0's last finished iteration.
func (e *Engine) LastStep() StepRecord { return *e.cur().loops[0].last.Load() }

// RankSteps returns every rank's last step record, in rank order.
func (e *Engine) RankSteps() []StepRecord {
	loops := e.cur().loops
	out := make([]StepRecord, len(loops))
	for i, l := range loops {
		out[i] = *l.last.Load()
	}
	return out
}

// The names of the two communicators of the TP group (see New).
const (
	CommControl = "control"
	CommForward = "forward"
)

// groups are the communicators, control first.
func (e *Engine) groups() []*dist.Group { return e.cur().groups() }

// closeGroups wakes every rank waiting in a collective of either
// communicator; both are idempotent to close.
func (e *Engine) closeGroups() {
	for _, g := range e.groups() {
		g.Close()
	}
}

// Collectives copies both communicators' state (control, then forward):
// every rank's flight recorder, the call it waits in, whether the group
// broke. Lock-free.
func (e *Engine) Collectives() []dist.Snapshot {
	gs := e.groups()
	out := make([]dist.Snapshot, len(gs))
	for i, g := range gs {
		out[i] = g.Snapshot()
	}
	return out
}

// Stalls lists the collectives of either communicator that have waited
// longer than threshold, with the ranks that have not arrived; each names
// its communicator.
func (e *Engine) Stalls(now time.Time, threshold time.Duration) []dist.Stall {
	var out []dist.Stall
	for _, g := range e.groups() {
		out = append(out, g.Stuck(now, threshold)...)
	}
	return out
}

// StallsReported counts the collectives the watchdog reported as stalled.
func (e *Engine) StallsReported() uint64 { return e.stalls.Load() }

// CollectiveWait is the time rank r has spent inside collectives of the
// communicator named comm (CommControl or CommForward).
func (e *Engine) CollectiveWait(comm string, r int) time.Duration {
	for _, g := range e.groups() {
		if g.Name() == comm {
			return g.Rank(r).WaitTotal()
		}
	}
	return 0
}

// Snapshot returns the state rank 0's loop last published.
func (e *Engine) Snapshot() *EngineSnapshot { return e.snap.Load() }

// Ranks is the number of tensor-parallel ranks.
func (e *Engine) Ranks() int { return len(e.cur().loops) }

// KVPages reports rank r's KV pool: pages in use (by sequences or the
// prefix cache), pages the prefix cache holds, and pages in all. It reads
// the pool's atomic counters, so it is safe from any goroutine and answers
// while the loop is stuck.
func (e *Engine) KVPages(r int) (used, cached, total int) {
	p := e.cur().shards.Rank(r).Pool()
	total = p.TotalPages()
	return total - p.FreePages(), p.CachedPages(), total
}

// Health reports the loops' liveness and the age of the oldest request
// that waits, as of now.
func (e *Engine) Health(now time.Time) Health {
	s := e.snap.Load()
	h := Health{
		Step:    s.Step.Step,
		Waiting: len(s.Queue.Waiting),
		Running: len(s.Queue.Prefilling) + len(s.Queue.Running),
		Err:     s.Err,
	}
	for _, l := range e.cur().loops {
		h.LoopAge = max(h.LoopAge, now.Sub(time.Unix(0, l.beat.Load())))
	}
	for _, w := range s.Queue.Waiting {
		h.OldestWaiting = max(h.OldestWaiting, w.Age+now.Sub(s.Taken))
	}
	h.Pending = int(e.numPending.Load())
	if t := e.oldestPending.Load(); t != 0 {
		h.OldestWaiting = max(h.OldestWaiting, now.Sub(time.Unix(0, t)))
	}
	return h
}

// publish stores rank 0's snapshot; called by rank 0's loop and by the
// shutdown after it.
func (e *Engine) publish(rec StepRecord) {
	s := &EngineSnapshot{Taken: time.Now(), Step: rec, Queue: e.loops[0].sched.Snapshot(), Totals: e.totals}
	if e.err != nil {
		s.Err = e.err.Error()
	}
	e.snap.Store(s)
}

// QueueObserver is implemented by a Config.Observer that also wants each
// request's queue wait: from Submit until the server first gives it its
// resources, so how long it waited its turn. On a colocated or prefill
// server that is its first forward step (a prefill's includes the wait for
// its decode's TRANSFER_INFO, which is the decode queueing it); on a
// decode, the moment its pages are reserved for the transfer. Called once
// per request, on rank 0's loop goroutine; it must not block.
type QueueObserver interface {
	QueueWaited(id uint64, waited time.Duration)
}

// observeServed reports request id's queue wait, once.
func (e *Engine) observeServed(id uint64, now time.Time) {
	r := e.front[id]
	if r == nil || r.served {
		return
	}
	r.served = true
	if o, ok := e.cfg.Observer.(QueueObserver); ok {
		o.QueueWaited(id, now.Sub(r.submit))
	}
}

// observeToken tells the observer of r's latest token, emitted at t.
func (e *Engine) observeToken(r *request, gen int, t time.Time) {
	o := e.cfg.Observer
	if o == nil {
		return
	}
	prev := r.lastTok
	if gen == 1 || prev.IsZero() {
		prev = r.submit
	}
	r.lastTok = t
	o.TokenEmitted(r.id, gen, t.Sub(prev))
}

// deliver sends the Finish and closes the stream. The buffer always has
// room for it: a slot per possible token plus one.
func (e *Engine) deliver(r *request, f Finish) {
	e.streamHeld()
	if r.stop != nil {
		r.stop()
	}
	if r.req.PD != nil && !r.roomHeld {
		e.rooms.CompareAndDelete(r.req.PD.Room, r.id)
	}
	if o := e.cfg.Observer; o != nil {
		o.RequestFinished(r.id, f)
	}
	select {
	case r.events <- Event{Finish: &f}:
	default:
	}
	close(r.events)
}

// shutdown runs once every loop has stopped: it finishes every request
// the ranks still know or rank 0 has not taken, releasing their KV when the
// ranks stopped cleanly between steps.
func (e *Engine) shutdown() {
	e.mu.Lock()
	e.closed = true
	pending := e.pending
	e.pending, e.aborts = nil, nil
	e.numPending.Store(0)
	e.oldestPending.Store(0)
	e.mu.Unlock()
	reason := ReasonClosed
	if e.err != nil {
		reason = "error: " + e.err.Error()
	}
	for _, l := range e.loops {
		l.drop(e.err == nil)
	}
	ids := make([]uint64, 0, len(e.front))
	for id := range e.front {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		r := e.front[id]
		delete(e.front, id)
		e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
	}
	for _, r := range pending {
		e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt)})
		for _, f := range r.forks {
			e.deliver(f, Finish{Reason: reason, PromptTokens: len(f.req.Prompt)})
		}
	}
	e.publish(*e.loops[0].last.Load())
}
