package serve

import "time"

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
func (e *Engine) emit(r *request, tok int32, at time.Time) bool {
	if e.holding {
		e.held = append(e.held, heldToken{r: r, tok: tok, gen: r.gen, at: at})
		return true
	}
	return e.send(r, tok, r.gen, at)
}

// send streams one token without blocking.
func (e *Engine) send(r *request, tok int32, gen int, at time.Time) bool {
	e.observeToken(r, gen, at)
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
func (e *Engine) streamHeld() {
	for i, h := range e.held {
		e.held[i] = heldToken{}
		if h.r.cut != "" {
			continue // cut since: the reader is not waiting for more
		}
		if !e.send(h.r, h.tok, h.gen, h.at) {
			e.mu.Lock()
			e.aborts = append(e.aborts, abortMsg{id: h.r.id, by: AbortBySlowReader})
			e.mu.Unlock()
		}
	}
	e.held = e.held[:0]
}
