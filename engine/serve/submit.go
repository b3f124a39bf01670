package serve

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/sample"
)

// The request API: what a caller submits, what it gets back, and how it
// aborts. Submit checks a request on the caller's goroutine and puts it
// into the inbox; rank 0 takes it from there (streams.go).

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
	// Tag is the client's id of the request (its X-Request-Id), named in
	// the engine's log lines of it on every rank; it decides nothing.
	Tag string
	// Probe marks a canary of the router's (a correctness probe): the
	// Observer is not told of it, so it is in no client metric and no
	// readiness window.
	Probe bool
}

// MaxTagBytes bounds Request.Tag.
const MaxTagBytes = 128

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
	n, err := e.prepare(&q)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	q.Prompt = slices.Clone(q.Prompt)
	q.Stop = slices.Clone(q.Stop)
	r, streams := e.newRequests(q, n)
	s := streams[0]
	err = e.inbox.push(r, func() error {
		if q.PD != nil {
			if err := e.pd.claimRoom(q.PD.Room, r.id); err != nil {
				return err
			}
		}
		// Registered before the loop can see the request, so that the
		// loop's call of stop at the finish always finds it set.
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
		return nil
	})
	if errors.Is(err, ErrRoomInUse) {
		e.pd.roomsInUse.Add(1)
	}
	if err != nil {
		return nil, err
	}
	return streams, nil
}

// prepare checks q against the model, the pool and the server's role and
// puts it in the form the engine keeps (its own PD part, a decode's
// bootstrap URL canonical, whose lookup it starts). It returns the samples
// the engine runs of it.
func (e *Engine) prepare(q *Request) (int, error) {
	c := &e.m.Config
	n := max(1, q.N)
	if len(q.Tag) > MaxTagBytes {
		return 0, fmt.Errorf("serve: a tag of %d bytes, more than %d", len(q.Tag), MaxTagBytes)
	}
	if q.N < 0 || q.N > MaxN {
		return 0, fmt.Errorf("serve: n %d must be between 1 and %d", q.N, MaxN)
	}
	if e.cfg.Role == pdproto.RolePrefill {
		// The prefill computes the prompt and the first sample's first
		// token once; the decode forks the other samples.
		n, q.N = 1, 0
	}
	if len(q.Prompt) == 0 {
		return 0, errors.New("serve: empty prompt")
	}
	if q.MaxTokens < 1 {
		return 0, fmt.Errorf("serve: max tokens %d must be positive", q.MaxTokens)
	}
	if n := len(q.Prompt) + q.MaxTokens; n > c.ContextLen {
		return 0, fmt.Errorf("serve: prompt of %d tokens plus %d to generate exceeds the context length %d", len(q.Prompt), q.MaxTokens, c.ContextLen)
	}
	// The samples that run at once (at most MaxRunning: the others wait
	// their turn without KV, busy is not dead) must fit the pool together.
	if pages := min(n, e.cfg.MaxRunning) * ((len(q.Prompt) + q.MaxTokens - 1 + e.cfg.PageSize - 1) / e.cfg.PageSize); pages > e.cfg.Pages() {
		if n > 1 {
			return 0, fmt.Errorf("serve: %d samples, %d of them at once, need %d KV pages, the pool has %d", n, min(n, e.cfg.MaxRunning), pages, e.cfg.Pages())
		}
		return 0, fmt.Errorf("serve: request needs %d KV pages, the pool has %d", pages, e.cfg.Pages())
	}
	for _, t := range q.Prompt {
		if t < 0 || int(t) >= c.VocabSize {
			return 0, fmt.Errorf("serve: prompt token %d out of vocabulary (%d)", t, c.VocabSize)
		}
	}
	if err := q.Sampling.Validate(); err != nil {
		return 0, fmt.Errorf("serve: %w", err)
	}
	switch role := e.cfg.Role; {
	case role == pdproto.RoleColocated && q.PD != nil:
		return 0, errors.New("serve: a colocated server takes no bootstrap room")
	case role != pdproto.RoleColocated && q.PD == nil:
		return 0, fmt.Errorf("serve: a %s server takes only PD requests (with a bootstrap room): send requests through the router", role)
	case role == pdproto.RoleDecode && q.PD.BootstrapURL == "":
		return 0, errors.New("serve: a PD request to a decode server needs the prefill's bootstrap URL")
	case role == pdproto.RolePrefill && q.PD.BootstrapURL != "":
		return 0, errors.New("serve: a prefill server takes no bootstrap URL")
	}
	if q.PD != nil {
		pd := *q.PD
		q.PD = &pd
	}
	if role := e.cfg.Role; role == pdproto.RoleDecode {
		url, err := e.pd.reg.admit(q.PD.BootstrapURL)
		if err != nil {
			return 0, err
		}
		q.PD.BootstrapURL = url
		e.pd.resolved(url) // start the lookup now
	}
	return n, nil
}

// newRequests makes the fronts of q's n samples, with n consecutive ids
// (sample i is the first's id plus i on every rank), and their streams;
// the later samples are the first's forks.
func (e *Engine) newRequests(q Request, n int) (*request, []*Stream) {
	first := e.nextID.Add(uint64(n)) - uint64(n) + 1
	var r *request
	streams := make([]*Stream, n)
	for i := range n {
		sp := q.Sampling
		sp.Seed += uint64(i)
		x := &request{
			id: first + uint64(i), req: q, submit: e.now(),
			events:  make(chan Event, q.MaxTokens+1),
			sampler: sample.New(sp),
		}
		streams[i] = &Stream{ID: x.id, Events: x.events, inbox: e.inbox, n: n, Index: i}
		if i == 0 {
			r = x
		} else {
			r.forks = append(r.forks, x)
		}
	}
	return r, streams
}

// Abort aborts request id (a Stream's ID) in whatever state it is, for an
// abort by id from an admin call. It never blocks; an unknown or finished
// id is ignored.
func (e *Engine) Abort(id uint64) { e.inbox.abort(id, AbortByOperator) }
