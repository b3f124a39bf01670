// Package serve is the colocated serving engine core: one loop goroutine
// that admits requests, schedules them with engine/sched, runs each step as
// one batch through a tensor-parallel engine/tp.Engine, samples every
// request with its own seeded sampler and streams the tokens out. There is
// no HTTP here; the HTTP server calls [Engine.Submit].
//
// # The loop
//
// The loop is lock-step (no overlap of scheduling with compute): drain new
// requests and aborts, Tick, Schedule from the MIN over the ranks of their
// free pages, release the KV of finished and retracted requests, run the
// plan as one forward batch (prompt chunks and decode tokens together; a
// retracted request recomputes its prompt plus what it generated), apply the
// aborts that arrived during the step, sample, stream, StepDone, publish.
//
// # Streams
//
// Each [Stream] carries an event channel of capacity MaxTokens+1: one slot
// per token it can ever produce plus one for the Finish, after which the
// channel is closed. A slow reader therefore never stalls the loop; should a
// send ever find the buffer full all the same, the loop does not block: it
// aborts the request with reason "error: reader too slow".
//
// # Reading the engine from outside
//
// After every iteration the loop publishes an immutable [StepRecord] and an
// [EngineSnapshot] (with the scheduler's queues, copied by the loop itself)
// through atomic pointers, plus a heartbeat time. [Engine.LastStep],
// [Engine.Snapshot] and [Engine.Health] read only those: no locks, no help
// from the loop, so they answer while the loop is stuck. [Engine.KVPages]
// reads a rank's pool through its atomic counter, equally lock-free. For
// latencies, [Config.Observer] is told of every token, finished request
// and forward step, on the loop's goroutine, with the loop's timestamps.
//
// Not yet here: the step record has no last-collective sequence number
// because tp.Engine does not expose its dist.Group's flight recorder; the
// loop runs on the driver goroutine and hands each rank the same plan (the
// per-rank loops with a broadcast plan and the overlap variant come later);
// no prefix cache; stop sequences are token ids (Request.Stop), stop
// strings belong to the HTTP layer that owns detokenization; an engine
// whose forward step fails finishes every request with an error and must be
// rebuilt.
package serve

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/tp"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// ErrClosed is returned by Submit on a closed Engine.
var ErrClosed = errors.New("serve: engine closed")

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
}

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
}

// Abort ends the request in whatever state it is; it never blocks and may
// be called any number of times, also after the request finished.
func (s *Stream) Abort() {
	s.once.Do(func() { s.e.abort(s.ID) })
}

// StepRecord describes one loop iteration. It is immutable once published.
// Step counts iterations, idle ones (no batch, Phase "idle") included.
type StepRecord struct {
	Step        uint64
	Phase       string // idle, prefill, decode or mixed
	BatchSize   int    // requests in the batch
	BatchTokens int    // tokens in the batch
	Retracted   int    // requests retracted by the plan
	Finished    int    // requests that finished in the iteration
	Digest      uint64 // FNV-1a of (id, start, tokens) of every batch item, in order
	Start, End  time.Time
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
}

// Health reports progress, not only liveness.
type Health struct {
	LoopAge       time.Duration // since the loop's last iteration began
	Step          uint64
	Waiting       int           // requests queued in the scheduler
	Running       int           // admitted requests (prefilling and decoding)
	Pending       int           // submitted, not yet taken by the loop
	OldestWaiting time.Duration // age of the oldest waiting or pending request
	Err           string
}

// Engine is the serving engine. Its methods are safe for concurrent use.
type Engine struct {
	m     *model.Model
	cfg   Config
	tp    *tp.Engine
	sched *sched.Scheduler
	epoch time.Time
	vocab int

	nextID atomic.Uint64

	mu      sync.Mutex // guards the inbox; never held across work
	closed  bool
	pending []*request
	aborts  []uint64
	wake    chan struct{} // capacity 1: the inbox changed

	// The inbox as Health sees it without the lock.
	numPending    atomic.Int64
	oldestPending atomic.Int64 // unix nanoseconds; 0 when none

	stop chan struct{}
	done chan struct{}
	once sync.Once

	beat atomic.Int64 // unix nanoseconds of the last iteration's start
	last atomic.Pointer[StepRecord]
	snap atomic.Pointer[EngineSnapshot]

	// Loop-owned.
	reqs   map[uint64]*request
	step   uint64
	totals Totals
	logits []float32
	err    error
}

type request struct {
	id       uint64
	req      Request
	submit   time.Time
	events   chan Event
	sampler  *sample.Sampler
	all      []int32 // prompt, then generated tokens
	gen      int
	decoding bool   // prefilled since its last admission
	cut      string // why an abort was asked for
	stop     func() bool
	lastTok  time.Time // when the previous token was emitted
}

// New builds the ranks (cfg.TP of them, each with a cpu backend of
// cfg.Threads threads) and the scheduler, and starts the loop goroutine
// (pprof label role=engine), which runs until Close.
func New(m *model.Model, cfg Config) (*Engine, error) {
	cfg.setDefaults(m)
	if err := cfg.Validate(m); err != nil {
		return nil, err
	}
	sc, err := sched.New(sched.Config{
		MaxRunning: cfg.MaxRunning, MaxBatchTokens: cfg.MaxBatchTokens, PrefillChunk: cfg.PrefillChunk,
		PageSize: cfg.PageSize, TotalPages: cfg.Pages(),
		WaitingTimeout: cfg.WaitingTimeout, PrefillTimeout: cfg.PrefillTimeout, RequestTimeout: cfg.RequestTimeout,
	})
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	threads := cfg.Threads
	te, err := tp.New(m, func(int) kernels.Backend { return cpu.New(threads) }, cfg.TP, cfg.PageSize, cfg.KVTokens, cfg.MaxRunning, cfg.IndexK)
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	e := &Engine{
		m: m, cfg: cfg, tp: te, sched: sc, epoch: time.Now(), vocab: m.Config.VocabSize,
		wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
		reqs: make(map[uint64]*request),
	}
	e.beat.Store(time.Now().UnixNano())
	e.publish(StepRecord{Phase: "idle", Start: e.epoch, End: e.epoch})
	go pprof.Do(context.Background(), pprof.Labels("role", "engine"), func(context.Context) { e.loop() })
	return e, nil
}

// Config returns the effective configuration.
func (e *Engine) Config() Config { return e.cfg }

// Submit queues a request. The request is aborted as soon as ctx ends (a
// client that disconnects).
func (e *Engine) Submit(ctx context.Context, q Request) (*Stream, error) {
	c := &e.m.Config
	if len(q.Prompt) == 0 {
		return nil, errors.New("serve: empty prompt")
	}
	if q.MaxTokens < 1 {
		return nil, fmt.Errorf("serve: max tokens %d must be positive", q.MaxTokens)
	}
	if n := len(q.Prompt) + q.MaxTokens; n > c.ContextLen {
		return nil, fmt.Errorf("serve: prompt of %d tokens plus %d to generate exceeds the context length %d", len(q.Prompt), q.MaxTokens, c.ContextLen)
	}
	if pages := (len(q.Prompt) + q.MaxTokens - 1 + e.cfg.PageSize - 1) / e.cfg.PageSize; pages > e.cfg.Pages() {
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
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	q.Prompt = slices.Clone(q.Prompt)
	q.Stop = slices.Clone(q.Stop)
	r := &request{
		id: e.nextID.Add(1), req: q, submit: time.Now(),
		events:  make(chan Event, q.MaxTokens+1),
		sampler: sample.New(q.Sampling),
		all:     append(make([]int32, 0, len(q.Prompt)+q.MaxTokens), q.Prompt...),
	}
	s := &Stream{ID: r.id, Events: r.events, e: e}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	// Registered before the loop can see the request, so that the loop's
	// call of stop at the finish always finds it set.
	r.stop = context.AfterFunc(ctx, s.Abort)
	if len(e.pending) == 0 {
		e.oldestPending.Store(r.submit.UnixNano())
	}
	e.pending = append(e.pending, r)
	e.numPending.Store(int64(len(e.pending)))
	e.mu.Unlock()
	e.poke()
	return s, nil
}

// Abort aborts request id (a Stream's ID) in whatever state it is, for an
// abort by id from an admin call. It never blocks; an unknown or finished
// id is ignored.
func (e *Engine) Abort(id uint64) { e.abort(id) }

func (e *Engine) abort(id uint64) {
	e.mu.Lock()
	if !e.closed {
		e.aborts = append(e.aborts, id)
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

// Close stops the loop, finishes every request still known with
// "error: engine closed" and closes the ranks. It is idempotent.
func (e *Engine) Close() error {
	var err error
	e.once.Do(func() {
		close(e.stop)
		<-e.done
		err = e.tp.Close()
	})
	return err
}

// LastStep returns the record of the last finished iteration.
func (e *Engine) LastStep() StepRecord { return *e.last.Load() }

// Snapshot returns the state the loop last published.
func (e *Engine) Snapshot() *EngineSnapshot { return e.snap.Load() }

// Ranks is the number of tensor-parallel ranks.
func (e *Engine) Ranks() int { return e.tp.Size() }

// KVPages reports rank r's KV pool: pages in use and pages in all. It
// reads the pool's atomic counter, so it is safe from any goroutine and
// answers while the loop is stuck.
func (e *Engine) KVPages(r int) (used, total int) {
	p := e.tp.Pool(r)
	total = p.TotalPages()
	return total - p.FreePages(), total
}

// Health reports the loop's liveness and the age of the oldest request
// that waits, as of now.
func (e *Engine) Health(now time.Time) Health {
	s := e.snap.Load()
	h := Health{
		LoopAge: now.Sub(time.Unix(0, e.beat.Load())),
		Step:    s.Step.Step,
		Waiting: len(s.Queue.Waiting),
		Running: len(s.Queue.Prefilling) + len(s.Queue.Running),
		Err:     s.Err,
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

func (e *Engine) publish(rec StepRecord) {
	e.last.Store(&rec)
	s := &EngineSnapshot{Taken: time.Now(), Step: rec, Queue: e.sched.Snapshot(), Totals: e.totals}
	if e.err != nil {
		s.Err = e.err.Error()
	}
	e.snap.Store(s)
}

func (e *Engine) now() time.Duration { return time.Since(e.epoch) }

// loop is the engine's goroutine.
//
// The rule: every decision that precedes a collective or changes queue or
// allocator state is taken from values all ranks agree on. Here the
// scheduler runs once, on this goroutine, from reduced inputs (free pages
// are the MIN over the ranks' pools, which is what every rank could
// allocate), and every rank executes the same plan: the same releases, the
// same batch. No rank ever branches on its own state before a collective;
// a rank that cannot reserve its share says so through the agreement inside
// tp's step, not by skipping it.
func (e *Engine) loop() {
	defer close(e.done)
	defer e.shutdown()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-e.stop:
			cancel()
		case <-e.done:
		}
	}()
	timer := time.NewTimer(e.cfg.Heartbeat)
	defer timer.Stop()
	for {
		select {
		case <-e.stop:
			return
		default:
		}
		start := time.Now()
		e.beat.Store(start.UnixNano())
		ran, err := e.iterate(ctx, start)
		if err != nil {
			select {
			case <-e.stop:
				// Close cut the step short; that is no engine failure.
			default:
				e.err = err
				e.publish(*e.last.Load())
			}
			return
		}
		if ran {
			continue
		}
		timer.Reset(e.cfg.Heartbeat)
		select {
		case <-e.stop:
			return
		case <-e.wake:
		case <-timer.C:
		}
	}
}

// iterate runs one iteration; ran says a forward step was run.
func (e *Engine) iterate(ctx context.Context, start time.Time) (bool, error) {
	rec := StepRecord{Step: e.step + 1, Phase: "idle", Start: start}
	finished := 0
	fin := func(fs []sched.Finish) error {
		for _, f := range fs {
			if err := e.finish(ctx, f); err != nil {
				return err
			}
			finished++
		}
		return nil
	}
	if err := e.intake(ctx, fin); err != nil {
		return false, err
	}
	if err := fin(e.sched.Tick(e.now())); err != nil {
		return false, err
	}
	if e.sched.Len() == 0 {
		rec.Finished, rec.End = finished, time.Now()
		e.step++
		e.publish(rec)
		return false, nil
	}
	free := e.tp.Pool(0).FreePages()
	for r := 1; r < e.tp.Size(); r++ {
		free = min(free, e.tp.Pool(r).FreePages())
	}
	plan, err := e.sched.Schedule(e.now(), free)
	if err != nil {
		return false, fmt.Errorf("serve: schedule: %w", err)
	}
	if err := fin(plan.Finished); err != nil {
		return false, err
	}
	for _, rt := range plan.Retract {
		if err := e.tp.Release(ctx, rt.ID); err != nil {
			return false, fmt.Errorf("serve: release retracted %d: %w", rt.ID, err)
		}
		e.reqs[rt.ID].decoding = false
		e.totals.Retractions++
	}
	rec.Retracted = len(plan.Retract)
	if len(plan.Run) == 0 {
		rec.Finished, rec.End = finished, time.Now()
		e.step++
		e.publish(rec)
		return false, nil
	}

	batch := make([]tp.Input, len(plan.Run))
	h := fnv.New64a()
	var buf [24]byte
	nl, prefill, decode := 0, 0, 0
	for i, it := range plan.Run {
		r := e.reqs[it.ID]
		n := 0
		if it.WantLogits {
			n = 1
		}
		batch[i] = tp.Input{SeqID: it.ID, Tokens: r.all[it.Start : it.Start+it.Tokens], NumLogits: n}
		nl += n
		rec.BatchTokens += it.Tokens
		if r.decoding {
			decode++
		} else {
			prefill++
		}
		put64(buf[0:], it.ID)
		put64(buf[8:], uint64(it.Start))
		put64(buf[16:], uint64(it.Tokens))
		h.Write(buf[:])
	}
	rec.BatchSize, rec.Digest = len(plan.Run), h.Sum64()
	switch {
	case decode == 0:
		rec.Phase = "prefill"
	case prefill == 0:
		rec.Phase = "decode"
	default:
		rec.Phase = "mixed"
	}
	if cap(e.logits) < nl*e.vocab {
		e.logits = make([]float32, nl*e.vocab)
	}
	logits := e.logits[:nl*e.vocab]
	if err := e.tp.Forward(ctx, batch, logits); err != nil {
		return false, fmt.Errorf("serve: step %d: %w", rec.Step, err)
	}
	e.totals.Steps++
	e.totals.Tokens += uint64(rec.BatchTokens)
	// Aborts that came during the step: the scheduler holds those in the
	// step as Aborting and finishes them at StepDone.
	if err := e.intake(ctx, fin); err != nil {
		return false, err
	}
	outcomes := make([]sched.Outcome, 0, len(plan.Run))
	emitted := time.Now() // one timestamp for every token of the step
	j := 0
	for _, it := range plan.Run {
		if !it.WantLogits {
			outcomes = append(outcomes, sched.Outcome{ID: it.ID})
			continue
		}
		lg := logits[j*e.vocab : (j+1)*e.vocab]
		j++
		r := e.reqs[it.ID]
		if r.cut != "" {
			// Aborted in the step: its outcome is ignored.
			outcomes = append(outcomes, sched.Outcome{ID: it.ID, Emitted: 1})
			continue
		}
		tok := r.sampler.Sample(lg)
		e.totals.Sampled++
		r.all = append(r.all, tok)
		r.gen++
		r.decoding = true
		stop := (!r.req.IgnoreEOS && e.m.Tokenizer.IsEOG(tok)) || slices.Contains(r.req.Stop, tok)
		e.observeToken(r, emitted) // counted even if the reader proves too slow, as CompletionTokens does
		select {
		case r.events <- Event{Token: tok}:
		default:
			// Never blocks: the request goes instead.
			fs, err := e.cutReq(r, ReasonSlowReader)
			if err == nil {
				err = fin(fs) // none: it is in the step, finished at StepDone
			}
			if err != nil {
				return false, err
			}
		}
		outcomes = append(outcomes, sched.Outcome{ID: it.ID, Emitted: 1, Stop: stop})
	}
	fs, err := e.sched.StepDone(e.now(), outcomes)
	if ferr := fin(fs); ferr != nil {
		return false, ferr
	}
	if err != nil {
		return false, fmt.Errorf("serve: step %d: %w", rec.Step, err)
	}
	rec.Finished, rec.End = finished, time.Now()
	e.step++
	e.publish(rec)
	if o := e.cfg.Observer; o != nil {
		o.StepFinished(rec)
	}
	return true, nil
}

// observeToken tells the observer of r's latest token, emitted at t.
func (e *Engine) observeToken(r *request, t time.Time) {
	o := e.cfg.Observer
	if o == nil {
		return
	}
	prev := r.lastTok
	if r.gen == 1 || prev.IsZero() {
		prev = r.submit
	}
	r.lastTok = t
	o.TokenEmitted(r.id, r.gen, t.Sub(prev))
}

func put64(b []byte, v uint64) {
	for i := range 8 {
		b[i] = byte(v >> (8 * i))
	}
}

// intake takes the new requests and the aborts from the inbox.
func (e *Engine) intake(ctx context.Context, fin func([]sched.Finish) error) error {
	e.mu.Lock()
	pending, aborts := e.pending, e.aborts
	e.pending, e.aborts = nil, nil
	e.numPending.Store(0)
	e.oldestPending.Store(0)
	e.mu.Unlock()
	now := e.now()
	for _, r := range pending {
		if err := e.sched.Add(sched.Request{ID: r.id, PromptLen: len(r.req.Prompt), MaxTokens: r.req.MaxTokens}, now); err != nil {
			e.deliver(r, Finish{Reason: "error: " + err.Error(), PromptTokens: len(r.req.Prompt)})
			continue
		}
		e.reqs[r.id] = r
	}
	for _, id := range aborts {
		r, ok := e.reqs[id]
		if !ok || r.cut != "" {
			continue
		}
		fs, err := e.cutReq(r, ReasonAbort)
		if err != nil {
			return err
		}
		if err := fin(fs); err != nil {
			return err
		}
	}
	return nil
}

// cutReq aborts r in the scheduler, remembering why.
func (e *Engine) cutReq(r *request, why string) ([]sched.Finish, error) {
	if r.cut != "" {
		return nil, nil
	}
	r.cut = why
	fs, err := e.sched.Abort(r.id, e.now())
	if err != nil {
		return nil, fmt.Errorf("serve: abort %d: %w", r.id, err)
	}
	if len(fs) == 0 {
		e.totals.AbortsInStep++
	}
	return fs, nil
}

// finish releases a finished request's KV (once: the scheduler reports
// every request in exactly one Finish) and ends its stream.
func (e *Engine) finish(ctx context.Context, f sched.Finish) error {
	r := e.reqs[f.ID]
	delete(e.reqs, f.ID)
	if f.Release {
		if err := e.tp.Release(ctx, f.ID); err != nil {
			if r != nil {
				e.deliver(r, Finish{Reason: "error: " + err.Error(), PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
			}
			return fmt.Errorf("serve: release %d: %w", f.ID, err)
		}
	}
	if r == nil {
		return fmt.Errorf("serve: finish of unknown request %d", f.ID)
	}
	var reason string
	switch f.Reason {
	case sched.ReasonStop:
		reason = ReasonStop
	case sched.ReasonLength:
		reason = ReasonLength
	case sched.ReasonAbort:
		reason = r.cut
		e.totals.Aborts++
	case sched.ReasonTimeout:
		reason = ReasonTimeout
	default:
		reason = "error: " + f.Reason.String()
	}
	e.totals.Finished++
	e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
	return nil
}

// deliver sends the Finish and closes the stream. The buffer always has
// room for it: a slot per possible token plus one.
func (e *Engine) deliver(r *request, f Finish) {
	if r.stop != nil {
		r.stop()
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

// shutdown finishes every request the loop still knows or has not taken,
// releasing their KV when the ranks still answer.
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
	ctx := context.Background()
	// After a failed or interrupted step the ranks may disagree with the
	// scheduler; then nothing is released (the ranks are closed anyway).
	release := e.err == nil && !e.sched.InFlight()
	ids := make([]uint64, 0, len(e.reqs))
	for id := range e.reqs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		r := e.reqs[id]
		delete(e.reqs, id)
		if release {
			// The scheduler forgets it; its Finish says whether KV is held.
			if fs, err := e.sched.Abort(id, e.now()); err == nil {
				for _, f := range fs {
					if f.Release {
						if e.tp.Release(ctx, f.ID) != nil {
							release = false
						}
					}
				}
			}
		}
		e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
	}
	for _, r := range pending {
		e.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt)})
	}
	e.publish(*e.last.Load())
}
