package serve

import (
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sample"
)

// streams is rank 0's side of every request the ranks know: its front
// (stream, sampler, counts), the tokens the overlap loop holds back, and
// the engine's totals. It is the state only the rank that samples and
// streams keeps, and it has one owner at a time: rank 0's loop while it
// runs, the supervisor between incarnations and after the last. Nothing
// else reads it: the totals leave it in rank 0's published snapshot.
type streams struct {
	observer Observer         // Config.Observer
	inbox    *inbox           // where a reader too slow for a held token is cut
	pd       *pdEngine        // the bootstrap rooms a finished stream frees; nil on a colocated server
	prefill  bool             // a prefill server: a request samples its first token only
	now      func() time.Time // the engine's clock, for the tokens' timestamps

	front map[uint64]*request
	// held are the tokens the overlap loop sampled but has not streamed
	// yet (see emit); holding says the step being sampled holds them.
	held    []heldToken
	holding bool
	totals  Totals
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

// known says whether the ranks know request id.
func (s *streams) known(id uint64) bool { return s.front[id] != nil }

// register takes the new requests (and their later samples) from the inbox
// into the front and returns them as the ranks need them.
func (s *streams) register(pending []*request, adds []addMsg) []addMsg {
	for _, r := range pending {
		s.front[r.id] = r
		for _, f := range r.forks {
			s.front[f.id] = f
		}
		a := addMsg{id: r.id, maxTokens: r.req.MaxTokens, ignoreEOS: r.req.IgnoreEOS, prompt: r.req.Prompt, stop: r.req.Stop, n: 1 + len(r.forks), noCache: r.req.NoCache, probe: r.req.Probe, tag: r.req.Tag}
		if pd := r.req.PD; pd != nil {
			a.pd, a.room, a.url = true, pd.Room, pd.BootstrapURL
			if s.prefill {
				a.maxTokens = 1 // the prefill samples the first token only
			}
		}
		adds = append(adds, a)
	}
	return adds
}

// cut marks the requests aborts name that the ranks know and no abort cut
// yet, and returns those aborts, for the step input.
func (s *streams) cut(aborts, cuts []abortMsg) []abortMsg {
	for _, a := range aborts {
		if r := s.front[a.id]; r != nil && r.cut == "" {
			r.cut = ReasonAbort
			cuts = append(cuts, a)
		}
	}
	return cuts
}

// takeAborts, on rank 0 during a step, takes the aborts of requests the
// ranks know and leaves the others (for requests still in the inbox) for
// the next step input.
func (s *streams) takeAborts() []abortMsg {
	var cuts []abortMsg
	s.inbox.filterAborts(func(a abortMsg) bool {
		r, known := s.front[a.id]
		switch {
		case !known:
			return true
		case r.cut == "":
			r.cut = ReasonAbort
			if a.by == AbortBySlowReader {
				r.cut = ReasonSlowReader
			}
			cuts = append(cuts, a)
		}
		return false
	})
	return cuts
}

// Streaming a sampled token to its reader (rank 0).
//
// The lock-step loop streams each token as it is sampled. The overlap loop
// holds a step's tokens back until the next step's forward pass has
// started (landBack), so that waking the readers is not on the path from
// one forward pass to the next, when the step samples at least
// holdFromTokens of them; fewer go at once: waking a reader or two costs
// the next step a few microseconds, while held, with the forward pass on
// every core, they wait for a core (measured at one request and every
// CPU: the client's inter-token p50 2.7 times lock-step's). Every token
// keeps the time it was sampled at. Whatever finishes a request streams
// its held tokens first (deliver), so a reader never sees a token after
// its Finish.

// holdFromTokens is the fewest tokens of a step the overlap loop holds.
const holdFromTokens = 8

// heldToken is a sampled token not yet streamed.
type heldToken struct {
	r   *request
	tok int32
	gen int // the request's count of tokens with this one
	at  time.Time
}

// emit streams tok to r, or holds it in the overlap loop. It reports false
// when r's event buffer was full (the reader is too slow): the caller cuts
// the request. Held tokens never report false here: see streamHeld.
func (s *streams) emit(r *request, tok int32, at time.Time) bool {
	if s.holding {
		s.held = append(s.held, heldToken{r: r, tok: tok, gen: r.gen, at: at})
		return true
	}
	return s.send(r, tok, r.gen, at)
}

// send streams one token without blocking.
func (s *streams) send(r *request, tok int32, gen int, at time.Time) bool {
	s.observeToken(r, gen, at)
	select {
	case r.events <- Event{Token: tok}:
		return true
	default:
		return false
	}
}

// streamHeld streams the held tokens in the order they were sampled. A
// reader too slow for one is cut through the abort queue, as a client's
// abort is: the step that sampled the token has already been agreed on, so
// the next step's results carry the cut to every rank.
func (s *streams) streamHeld() {
	for i, h := range s.held {
		s.held[i] = heldToken{}
		if h.r.cut != "" {
			continue // cut since: the reader is not waiting for more
		}
		if !s.send(h.r, h.tok, h.gen, h.at) {
			s.inbox.cutSlow(h.r.id)
		}
	}
	s.held = s.held[:0]
}

// emitFirst streams a decode request's first token, which came from the
// prefill, on rank 0.
func (s *streams) emitFirst(id uint64, tok int32) {
	r := s.front[id]
	if r == nil {
		return
	}
	r.gen++
	s.totals.Sampled++
	s.emit(r, tok, s.now())
}

// sampleForks, on rank 0, samples the first tokens of a parent's later
// samples from the parent's logits and streams them.
func (s *streams) sampleForks(parent uint64, n int, lg []float32, stops func(int32) bool, at time.Time, out []rankcore.Sampled) []rankcore.Sampled {
	for i := range n {
		r := s.front[parent+uint64(i)+1]
		if r == nil {
			out = append(out, rankcore.Sampled{Tok: 0, Stop: true}) // cannot happen: a fork's front lives until it ends
			continue
		}
		tok := r.sampler.Sample(lg)
		s.totals.Sampled++
		r.gen++
		s.emit(r, tok, at)
		out = append(out, rankcore.Sampled{Tok: tok, Stop: stops(tok)})
	}
	return out
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
func (s *streams) observeServed(id uint64, now time.Time) {
	r := s.front[id]
	if r == nil || r.served {
		return
	}
	r.served = true
	if o, ok := s.observer.(QueueObserver); ok {
		o.QueueWaited(id, now.Sub(r.submit))
	}
}

// observeToken tells the observer of r's latest token, emitted at t.
func (s *streams) observeToken(r *request, gen int, t time.Time) {
	o := s.observer
	if o == nil || r.req.Probe {
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
func (s *streams) deliver(r *request, f Finish) {
	s.streamHeld()
	if r.stop != nil {
		r.stop()
	}
	if r.req.PD != nil && !r.roomHeld {
		s.pd.rooms.CompareAndDelete(r.req.PD.Room, r.id)
	}
	if o := s.observer; o != nil && !r.req.Probe {
		o.RequestFinished(r.id, f)
	}
	select {
	case r.events <- Event{Finish: &f}:
	default:
	}
	close(r.events)
}

// endAll ends every request the ranks knew with reason, in id order, and
// returns how many it ended.
func (s *streams) endAll(reason string) int {
	ids := slices.Sorted(maps.Keys(s.front))
	for _, id := range ids {
		r := s.front[id]
		delete(s.front, id)
		s.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
	}
	return len(ids)
}

// Stream is one submitted request's output.
type Stream struct {
	ID     uint64
	Events <-chan Event
	inbox  *inbox // where its aborts go
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
			s.inbox.abort(base+uint64(i), AbortByClient)
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
	s.inbox.abort(s.ID, AbortByClient)
}
