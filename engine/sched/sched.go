package sched

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

type request struct {
	id          uint64
	promptLen   int
	maxTokens   int
	arrival     time.Duration
	since       time.Duration // entered the current state
	admitted    time.Duration // last admission
	state       State
	fed         int    // tokens whose KV the loop holds
	generated   int    // tokens sampled so far
	pending     int    // tokens in the newest planned step (the step in flight, or the step planned ahead)
	logits      bool   // the in-flight item wants logits
	older       int    // tokens in the older step in flight once its outcome is predicted (counted in fed)
	guess       int    // of generated, tokens predicted for the older step in flight (0 or 1)
	pages       int    // pages held: pagesFor(fed+pending)
	retractions int    // times preempted
	seq         uint64 // admission order, for LIFO retraction
	cut         Reason // why an Aborting request finishes at StepDone (ReasonLength: predicted)
	cached      int    // prompt tokens on shared prefix-cache pages (until retracted)
	shared      int    // (cached-loaded)/PageSize: pages the request reads but does not hold
	loaded      int    // of cached, tokens loaded back into pages of the request's own
	transferred int    // prompt tokens whose KV arrived with the request (until retracted)
}

// own is the number of pages the request holds for n tokens of KV: those
// beyond its shared prefix.
func (s *Scheduler) own(r *request, n int) int { return s.cfg.pagesFor(n) - r.shared }

// target is the number of tokens to prefill: the prompt plus, after a
// retraction, everything generated so far.
func (r *request) target() int { return r.promptLen + r.generated }

// Scheduler is one rank's scheduler: a deterministic state machine. Events
// (Add, Abort, Schedule, StepDone, Tick) go in; plans and finished requests
// come out. It starts no goroutines, reads no clock (time comes in as the
// now of each event, a duration since start; a now earlier than a previous
// one counts as the previous one) and touches no KV pool: the loop acts on
// its results. Identical event sequences give identical results, so every
// rank of a TP group may run its own copy on the same (reduced) inputs.
// Not safe for concurrent use.
type Scheduler struct {
	cfg        Config
	now        time.Duration
	reqs       map[uint64]*request // every request not yet finished
	waiting    []*request          // FIFO; retracted requests go to the front
	prefilling []*request          // admission order
	running    []*request          // admission order
	aborting   []*request          // left the queues during the step in flight
	step       []Item              // the step in flight (the older one), nil when none
	predicted  bool                // requests show step's predicted outcome (overlap)
	ahead      []Item              // the step planned ahead while step is in flight, nil when none
	voided     []uint64            // items dropped from the newest planned step
	held       int                 // pages held by all requests
	nextSeq    uint64
}

// New returns an empty scheduler for cfg.
func New(cfg Config) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Scheduler{cfg: cfg, reqs: make(map[uint64]*request)}, nil
}

// Config returns the scheduler's configuration.
func (s *Scheduler) Config() Config { return s.cfg }

func (s *Scheduler) advance(now time.Duration) {
	if now > s.now {
		s.now = now
	}
}

// Add queues a new request at the back of the waiting queue. It fails, and
// changes nothing, for a known id, an empty prompt or MaxTokens, or a
// request whose longest sequence would not fit the whole pool.
func (s *Scheduler) Add(req Request, now time.Duration) error {
	s.advance(now)
	if _, ok := s.reqs[req.ID]; ok {
		return fmt.Errorf("%w: %d", ErrDuplicate, req.ID)
	}
	if req.PromptLen < 1 || req.MaxTokens < 1 {
		return fmt.Errorf("%w: %d: prompt %d, max tokens %d", ErrInvalid, req.ID, req.PromptLen, req.MaxTokens)
	}
	if req.Cached < 0 || req.Cached%s.cfg.PageSize != 0 || req.Cached >= req.PromptLen {
		return fmt.Errorf("%w: %d: cached prefix of %d tokens (page size %d, prompt %d)", ErrInvalid, req.ID, req.Cached, s.cfg.PageSize, req.PromptLen)
	}
	if req.Loaded < 0 || req.Loaded > req.Cached || req.Loaded%s.cfg.PageSize != 0 {
		return fmt.Errorf("%w: %d: %d of %d cached tokens to load (page size %d)", ErrInvalid, req.ID, req.Loaded, req.Cached, s.cfg.PageSize)
	}
	if req.Transferred < 0 || req.Transferred >= req.PromptLen || (req.Transferred > 0 && req.Cached > 0) {
		return fmt.Errorf("%w: %d: %d transferred tokens (prompt %d, cached %d)", ErrInvalid, req.ID, req.Transferred, req.PromptLen, req.Cached)
	}
	// The last sampled token is never fed back, so the KV peaks at
	// PromptLen+MaxTokens-1 tokens.
	if p := s.cfg.pagesFor(req.PromptLen + req.MaxTokens - 1); p > s.cfg.TotalPages {
		return fmt.Errorf("%w: %d needs %d pages of %d", ErrTooLarge, req.ID, p, s.cfg.TotalPages)
	}
	if p := s.cfg.pagesFor(req.Transferred); s.held+p > s.cfg.TotalPages {
		return fmt.Errorf("%w: %d arrives holding %d pages, %d of %d are held already", ErrInvalid, req.ID, p, s.held, s.cfg.TotalPages)
	}
	r := &request{id: req.ID, promptLen: req.PromptLen, maxTokens: req.MaxTokens, arrival: s.now, since: s.now, state: Waiting,
		cached: req.Cached, shared: (req.Cached - req.Loaded) / s.cfg.PageSize, loaded: req.Loaded, transferred: req.Transferred}
	r.fed = r.transferred
	r.pages = s.cfg.pagesFor(r.fed)
	s.held += r.pages
	s.reqs[r.id] = r
	s.waiting = append(s.waiting, r)
	s.selfCheck()
	return nil
}

// Abort ends a request in any state. A request outside the step in flight
// finishes now and its Finish is returned; one in the step in flight leaves
// every queue now and finishes at StepDone (its outcome ignored), so Abort
// returns no Finish and a second Abort of it changes nothing. Either way its
// KV is released exactly once, through the one Finish. An unknown or
// already finished id gives ErrUnknown.
func (s *Scheduler) Abort(id uint64, now time.Duration) ([]Finish, error) {
	s.advance(now)
	r, ok := s.reqs[id]
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknown, id)
	}
	if r.state == Aborting {
		if r.cut == ReasonLength { // predicted to end by length; lock-step would abort it
			r.cut = ReasonAbort
			s.selfCheck()
		}
		return nil, nil
	}
	f := s.cut(r, ReasonAbort)
	s.selfCheck()
	return f, nil
}

// inStep reports whether r has tokens in the step in flight (the older
// one, when a step is planned ahead).
func (s *Scheduler) inStep(r *request) bool {
	return r.older > 0 || (!s.predicted && r.pending > 0)
}

// cut ends r for reason: now, or at StepDone when r is in the step.
func (s *Scheduler) cut(r *request, reason Reason) []Finish {
	s.unqueue(r)
	if s.inStep(r) {
		r.state, r.since, r.cut = Aborting, s.now, reason
		s.aborting = append(s.aborting, r)
		return nil
	}
	return []Finish{s.finish(r, reason)}
}

// unqueue removes r from its queue (not from reqs).
func (s *Scheduler) unqueue(r *request) {
	switch r.state {
	case Waiting:
		s.waiting = remove(s.waiting, r)
	case Prefilling:
		s.prefilling = remove(s.prefilling, r)
	case Running:
		s.running = remove(s.running, r)
	case Aborting:
		s.aborting = remove(s.aborting, r)
	}
}

func remove(q []*request, r *request) []*request {
	for i, x := range q {
		if x == r {
			return append(q[:i], q[i+1:]...)
		}
	}
	return q
}

// finish forgets r (already out of its queue) and reports it. An item of r
// in the step planned ahead is voided: dropped from that step and reported
// by Voided.
func (s *Scheduler) finish(r *request, reason Reason) Finish {
	if s.predicted && r.pending > 0 {
		s.ahead = slices.DeleteFunc(s.ahead, func(it Item) bool { return it.ID == r.id })
		s.voided = append(s.voided, r.id)
	}
	f := Finish{ID: r.id, Reason: reason, Generated: r.generated, Release: r.pages > 0, Pages: r.pages}
	s.held -= r.pages
	r.pages, r.pending, r.older, r.guess, r.state, r.since = 0, 0, 0, 0, Finished, s.now
	delete(s.reqs, r.id)
	return f
}

// Tick expires timeouts. Requests in the step in flight that expire finish
// at StepDone.
func (s *Scheduler) Tick(now time.Duration) []Finish {
	s.advance(now)
	f := s.expire()
	s.selfCheck()
	return f
}

func (s *Scheduler) expired(r *request) bool {
	c := &s.cfg
	switch {
	case c.RequestTimeout > 0 && s.now-r.arrival >= c.RequestTimeout:
		return true
	case r.state == Waiting && c.WaitingTimeout > 0 && s.now-r.since >= c.WaitingTimeout:
		return true
	case r.state == Prefilling && c.PrefillTimeout > 0 && s.now-r.admitted >= c.PrefillTimeout:
		return true
	}
	return false
}

func (s *Scheduler) expire() []Finish {
	var out []Finish
	for _, q := range [][]*request{s.running, s.prefilling, s.waiting, s.aborting} {
		var exp []*request
		for _, r := range q {
			// An Aborting request is ending already, unless it is only
			// predicted to end by length: lock-step would still run it.
			if (r.state != Aborting || r.cut == ReasonLength) && s.expired(r) {
				exp = append(exp, r)
			}
		}
		for _, r := range exp {
			out = append(out, s.cut(r, ReasonTimeout)...)
		}
	}
	return out
}

// Schedule plans the next step given the free pages of the pool (the
// minimum over the ranks). It first expires timeouts (Plan.Finished), then
// plans:
//
//  1. every decoding request gets one token; when their new pages exceed
//     the free pages, the most recently admitted requests (decoding or
//     prefilling) are retracted, newest first, until the rest fit;
//  2. prefilling requests get their next chunk (at most PrefillChunk, within
//     MaxBatchTokens, shrunk to the pages left), in admission order;
//  3. unless something was retracted, waiting requests are admitted in FIFO
//     order while MaxRunning and the token budget allow and the pages for
//     their whole prefill fit; the first that does not fit stops admission.
//
// If nothing could run while requests are admitted, the newest is retracted
// until something runs or none is left. A plan with Run items starts a
// step.
//
// With one step in flight, Schedule fails with ErrStepInFlight unless
// Config.Overlap is set; then it plans the next step ahead (the overlap
// schedule, see the package doc): it first predicts the step in flight's
// outcome (every item with logits emits one token and does not stop, a
// request that reaches MaxTokens is predicted finished and is not planned)
// and plans from there as above, except that it never retracts: where it
// would, it plans nothing (Plan.Run empty, no step started; the loop ends
// the step in flight and schedules again). Its Finished holds only
// requests outside the step in flight. With two steps in flight (one in
// flight, one planned ahead) it fails with ErrStepInFlight.
func (s *Scheduler) Schedule(now time.Duration, freePages int) (Plan, error) {
	if s.ahead != nil || s.step != nil && !s.cfg.Overlap {
		return Plan{}, ErrStepInFlight
	}
	s.advance(now)
	var p Plan
	p.Finished = s.expire()
	if s.step != nil && !s.predicted {
		s.predict()
	}
	ahead := s.step != nil
	free := min(freePages, s.cfg.TotalPages-s.held)
	for _, f := range p.Finished {
		free += f.Pages
	}
	free = max(free, 0)

	// 1. Decode, retracting newest first until every decode fits.
	for {
		need := 0
		for _, r := range s.running {
			need += s.own(r, r.fed+1) - r.pages
		}
		if need <= free || len(s.running) == 0 {
			break
		}
		if ahead {
			s.selfCheck()
			return p, nil
		}
		free += s.retractNewest(&p)
	}
	// budget is the step's tokens left for prefill chunks, after one per
	// decode; each pass sets it afresh, as a retraction may drop a decode.
	var budget int
	for {
		budget = s.cfg.MaxBatchTokens - len(s.running)
		left := free
		for _, r := range s.running {
			left -= s.own(r, r.fed+1) - r.pages
		}
		// 2. Continue prefills.
		var chunks []Item
		for _, r := range s.prefilling {
			n := min(s.cfg.PrefillChunk, r.target()-r.fed, budget, (r.shared+r.pages+left)*s.cfg.PageSize-r.fed)
			if n <= 0 {
				continue
			}
			grow := s.own(r, r.fed+n) - r.pages
			left -= grow
			budget -= n
			chunks = append(chunks, Item{ID: r.id, Start: r.fed, Tokens: n, WantLogits: r.fed+n == r.target(), Pages: r.pages + grow})
		}
		if len(s.running) > 0 || len(chunks) > 0 || len(s.prefilling) == 0 {
			free = left
			for _, r := range s.running {
				p.Run = append(p.Run, Item{ID: r.id, Start: r.fed, Tokens: 1, WantLogits: true, Pages: s.own(r, r.fed+1)})
			}
			p.Run = append(p.Run, chunks...)
			break
		}
		// Only prefills are admitted and none can take a token: free
		// pages for the older ones.
		if ahead {
			s.selfCheck()
			return p, nil
		}
		free += s.retractNewest(&p)
	}

	// 3. Admit from the waiting queue, in order. A request that does not
	// fit stops the others, except those already holding their pages (a
	// decode's transferred requests): they need a page or so more, and
	// running them is the only way their pages come back, so they pass a
	// blocked head; without that, a retracted head waiting for pages that
	// parked transferred requests hold would wait for ever.
	if len(p.Retract) == 0 {
		blocked := false
		for i := 0; i < len(s.waiting) && budget > 0 && len(s.prefilling)+len(s.running)+len(s.aborting) < s.cfg.MaxRunning; {
			r := s.waiting[i]
			if (blocked && r.pages == 0) || s.own(r, r.target())-r.pages > free {
				blocked = true
				i++
				continue
			}
			fresh := r.pages == 0 // no sequence yet: a transferred request has one
			if fresh {
				r.fed = r.cached
			}
			n := min(s.cfg.PrefillChunk, r.target()-r.fed, budget)
			s.waiting = slices.Delete(s.waiting, i, i+1)
			s.nextSeq++
			r.seq, r.state, r.since, r.admitted = s.nextSeq, Prefilling, s.now, s.now
			s.prefilling = append(s.prefilling, r)
			pg := s.own(r, r.fed+n)
			free -= pg - r.pages
			budget -= n
			it := Item{ID: r.id, Start: r.fed, Tokens: n, WantLogits: r.fed+n == r.target(), Pages: pg, Fresh: fresh}
			if fresh {
				it.Cached = r.cached
			}
			p.Run = append(p.Run, it)
		}
	}

	for _, it := range p.Run {
		r := s.reqs[it.ID]
		p.PagesNeeded += it.Pages - r.pages
		s.held += it.Pages - r.pages
		r.pages, r.pending, r.logits = it.Pages, it.Tokens, it.WantLogits
	}
	if len(p.Run) > 0 {
		s.voided = nil
		if ahead {
			s.ahead = slices.Clone(p.Run) // voiding edits it; the loop's plan stays as given
		} else {
			s.step = p.Run
		}
	}
	s.selfCheck()
	return p, nil
}

// predict moves the requests of the step in flight to its predicted
// outcome, so that the next step can be planned from there: their tokens
// count as fed (and as older, until StepDone), every item with logits
// emitted one token that did not stop, a finished prefill is decoding, and
// a request that reached MaxTokens is Aborting with ReasonLength (it holds
// its pages until StepDone). Requests aborted during the step predict
// nothing.
func (s *Scheduler) predict() {
	for _, it := range s.step {
		r := s.reqs[it.ID]
		r.fed += r.pending
		r.older, r.pending = r.pending, 0
		if r.state == Aborting || !it.WantLogits {
			continue
		}
		r.generated++
		r.guess = 1
		switch {
		case r.generated >= r.maxTokens:
			s.unqueue(r)
			r.state, r.since, r.cut = Aborting, s.now, ReasonLength
			s.aborting = append(s.aborting, r)
		case r.state == Prefilling:
			s.prefilling = remove(s.prefilling, r)
			r.state, r.since = Running, s.now
			s.running = insertBySeq(s.running, r)
		}
	}
	s.predicted = true
}

// retractNewest sends the most recently admitted request (prefilling or
// decoding) back to the front of the waiting queue, recording it in p, and
// returns the pages it frees.
func (s *Scheduler) retractNewest(p *Plan) int {
	var r *request
	for _, q := range [][]*request{s.prefilling, s.running} {
		for _, x := range q {
			if r == nil || x.seq > r.seq {
				r = x
			}
		}
	}
	if r == nil {
		return 0
	}
	s.unqueue(r)
	freed := r.pages
	p.Retract = append(p.Retract, Retract{ID: r.id, Generated: r.generated, Pages: freed})
	s.held -= freed
	r.pages, r.fed, r.state, r.since = 0, 0, Waiting, s.now
	r.cached, r.shared, r.loaded, r.transferred = 0, 0, 0, 0 // the loop released the prefix or transferred KV with the sequence
	r.retractions++
	s.waiting = append([]*request{r}, s.waiting...)
	return freed
}

// Uncache shrinks a waiting request's cached prefix to cached tokens (a
// whole number of pages, no more than its device part: the tokens it does
// not have to load): the loop lost the rest (e.g. its host tier was turned
// off) and the request will compute them. Only a request waiting without a
// sequence (never admitted, or retracted) can be uncached.
func (s *Scheduler) Uncache(id uint64, cached int, now time.Duration) error {
	s.advance(now)
	r, ok := s.reqs[id]
	switch {
	case !ok:
		return fmt.Errorf("%w: %d", ErrUnknown, id)
	case r.state != Waiting || r.pages != 0:
		return fmt.Errorf("%w: %d: uncache of a request that holds a sequence", ErrInvalid, id)
	case cached < 0 || cached%s.cfg.PageSize != 0 || cached > r.cached-r.loaded:
		return fmt.Errorf("%w: %d: uncache to %d of %d cached tokens (%d to load)", ErrInvalid, id, cached, r.cached, r.loaded)
	}
	r.cached, r.shared, r.loaded = cached, cached/s.cfg.PageSize, 0
	r.fed = r.transferred
	s.selfCheck()
	return nil
}

// StepDone ends the step in flight with the loop's outcomes, one per Run
// item (less the items Voided dropped from it). It returns the requests
// that finished: by a stop token, by length, and those aborted or timed
// out during the step (their outcomes ignored). A missing or impossible
// outcome finishes that request with ReasonError and is also reported in
// the error; outcomes for ids not in the step are reported in the error
// and otherwise ignored. The state is consistent whatever the error.
//
// With a step planned ahead, StepDone ends the older step and reconciles
// its prediction: a request that stopped, failed, was aborted or timed out,
// or reached MaxTokens finishes now, and its item in the planned step is
// voided (see Voided); the planned step becomes the step in flight (none
// when every item of it was voided).
func (s *Scheduler) StepDone(now time.Duration, outcomes []Outcome) ([]Finish, error) {
	if s.step == nil {
		return nil, ErrNoStep
	}
	s.advance(now)
	step := s.step
	s.step = nil
	var bad []string
	got := make(map[uint64]Outcome, len(outcomes))
	inStep := make(map[uint64]bool, len(step))
	for _, it := range step {
		inStep[it.ID] = true
	}
	for _, o := range outcomes {
		if !inStep[o.ID] {
			bad = append(bad, fmt.Sprintf("%d not in the step", o.ID))
			continue
		}
		if _, dup := got[o.ID]; dup {
			bad = append(bad, fmt.Sprintf("%d reported twice", o.ID))
			continue
		}
		got[o.ID] = o
	}
	var out []Finish
	for _, it := range step {
		r := s.reqs[it.ID]
		if s.predicted {
			r.older = 0 // counted in fed already
		} else {
			r.fed += r.pending
			r.pending = 0
		}
		guess := r.guess // a predicted token, counted in generated already
		r.guess = 0
		if r.state == Aborting && r.cut != ReasonLength {
			r.generated -= guess
			s.unqueue(r)
			out = append(out, s.finish(r, r.cut))
			continue
		}
		o, ok := got[it.ID]
		want := 0
		if it.WantLogits {
			want = 1
		}
		if !ok || o.Emitted != want || (o.Stop && want == 0) {
			if ok {
				bad = append(bad, fmt.Sprintf("%d emitted %d (stop %t), want %d", it.ID, o.Emitted, o.Stop, want))
			} else {
				bad = append(bad, fmt.Sprintf("%d has no outcome", it.ID))
			}
			r.generated -= guess
			s.unqueue(r)
			out = append(out, s.finish(r, ReasonError))
			continue
		}
		r.generated += o.Emitted - guess
		switch {
		case o.Stop:
			s.unqueue(r)
			out = append(out, s.finish(r, ReasonStop))
		case r.generated >= r.maxTokens:
			s.unqueue(r)
			out = append(out, s.finish(r, ReasonLength))
		case r.state == Prefilling && o.Emitted > 0:
			s.prefilling = remove(s.prefilling, r)
			r.state, r.since = Running, s.now
			s.running = insertBySeq(s.running, r)
		}
	}
	s.aborting = s.aborting[:0]
	if s.predicted {
		if len(s.ahead) > 0 {
			s.step = s.ahead
		}
		s.ahead, s.predicted = nil, false
	}
	s.selfCheck()
	if bad != nil {
		return out, fmt.Errorf("%w: %s", ErrOutcome, strings.Join(bad, "; "))
	}
	return out, nil
}

func insertBySeq(q []*request, r *request) []*request {
	i := len(q)
	for i > 0 && q[i-1].seq > r.seq {
		i--
	}
	q = append(q, nil)
	copy(q[i+1:], q[i:])
	q[i] = r
	return q
}

// Admitted is the number of admitted requests (prefilling, running, and
// aborting in the step in flight): those MaxRunning bounds.
// Reserve is the number of pages the requests in the scheduler may still
// need for their next growth tokens each: a request that holds its KV grows
// by up to growth more tokens (fewer when its max tokens end sooner); a
// waiting request without pages (retracted, or new) needs its whole
// prefill too. Aborting requests need nothing. A decode keeps this many
// pages out of the reach of new transfers.
func (s *Scheduler) Reserve(growth int) int {
	need := 0
	for _, r := range s.reqs {
		if r.state == Aborting {
			continue
		}
		peak := r.promptLen + r.maxTokens - 1 // the last sampled token is never fed back
		want := min(peak, max(r.fed+r.pending, r.target())+growth)
		need += max(0, s.own(r, want)-r.pages)
	}
	return need
}

func (s *Scheduler) Admitted() int { return len(s.prefilling) + len(s.running) + len(s.aborting) }

// InFlight reports whether a step is in flight (planned, StepDone not yet
// received).
func (s *Scheduler) InFlight() bool { return s.step != nil }

// Ahead reports whether a step is planned ahead: Schedule ran with a step
// in flight and returned Run items, and that step's StepDone has not come
// yet. Schedule then fails with ErrStepInFlight.
func (s *Scheduler) Ahead() bool { return s.ahead != nil }

// Voided returns the ids of the items dropped from the newest planned step
// (the one the last Schedule with Run items started), in the order they
// were dropped; the loop must not run them and passes no outcome for them.
// An item is voided when its request finishes before that step is
// launched: at the older step's StepDone (a stop, a failed outcome, a
// length finish, or an abort or timeout during the older step) or by an
// Abort or Tick that finishes it at once. The Finish that releases the
// request's pages (those of the voided item included) comes from the same
// event. In lock-step use it is always empty. Schedule clears it when it
// starts a step.
func (s *Scheduler) Voided() []uint64 { return slices.Clone(s.voided) }

// Head is the waiting queue's head and the pages it needs free to be
// admitted (beyond those it holds); ok is false when nothing waits.
func (s *Scheduler) Head() (id uint64, need int, ok bool) {
	if len(s.waiting) == 0 {
		return 0, 0, false
	}
	r := s.waiting[0]
	return r.id, s.own(r, r.target()) - r.pages, true
}

// WaitingIDs are the waiting requests' ids in queue order (the head first).
func (s *Scheduler) WaitingIDs() []uint64 {
	ids := make([]uint64, len(s.waiting))
	for i, r := range s.waiting {
		ids[i] = r.id
	}
	return ids
}

// Len is the number of requests not yet finished.
func (s *Scheduler) Len() int { return len(s.reqs) }

// HeldPages is the number of pages the scheduler counts as held by its
// requests.
func (s *Scheduler) HeldPages() int { return s.held }

// Snapshot returns the queues as plain values.
func (s *Scheduler) Snapshot() Snapshot {
	info := func(q []*request) []ReqInfo {
		out := make([]ReqInfo, 0, len(q))
		for _, r := range q {
			out = append(out, ReqInfo{
				ID: r.id, State: r.state, Age: s.now - r.arrival, InState: s.now - r.since,
				PromptLen: r.promptLen, MaxTokens: r.maxTokens, Generated: r.generated - r.guess,
				Fed: r.fed - r.older, InFlight: r.older + r.pending, Pages: r.pages, Retractions: r.retractions, Cached: r.cached,
			})
		}
		return out
	}
	return Snapshot{
		Now: s.now, Waiting: info(s.waiting), Prefilling: info(s.prefilling),
		Running: info(s.running), Aborting: info(s.aborting),
		StepInFlight: s.step != nil, StepAhead: s.ahead != nil, HeldPages: s.held, TotalPages: s.cfg.TotalPages,
	}
}
