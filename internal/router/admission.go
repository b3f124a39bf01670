package router

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
)

// Admission at the edge.
//
// Busy is not dead: a server whose requests wait stays healthy, and the
// router sheds load before the cluster does. Each server reports at
// GET /health the requests it holds queued (the scheduler's waiting and
// pending ones and its PD wait queue) and running; the router adds what it
// has sent since that check, so that a burst between two checks cannot
// overshoot the bound. A server is full when that depth has reached
// Options.MaxQueued, or when it reports itself busy (a request waited past
// its --max-queue-age). When every healthy server of a role is full, a new
// request is answered 429 with Retry-After before anything of it is sent:
// work is refused at the edge only, never half-way through the protocol.

// DefaultMaxQueued is the admission bound when Options.MaxQueued is 0: a
// queue depth of 256 requests per server, more than the 200 concurrent
// sessions `make run`'s cluster (one prefill, one decode) is meant to
// queue, all of which one server may hold at once.
const DefaultMaxQueued = 256

// retryAfterSeconds is the Retry-After hint for a router whose view of
// the servers is renewed every d: whole seconds, from 1 to 30.
func retryAfterSeconds(d time.Duration) string {
	return strconv.Itoa(min(30, max(1, int(math.Ceil(d.Seconds())))))
}

// queueDepth is u's queue depth as the router admits by it: the queued
// requests its last health check reported plus the growth of the router's
// own requests in flight on it since that check (a burst the check could
// not see), and at least the router's requests in flight on it less those
// it reported running (requests sent before the check that had not reached
// it yet). u.mu is held.
func (u *upstream) queueDepth() int64 {
	inFlight := u.inFlight.Load()
	return max(u.queued+max(0, inFlight-u.inFlightAtCheck), inFlight-u.running)
}

// refusal says why a request was not admitted: every healthy server of a
// role is full.
type refusal struct {
	role   string
	server string // the least loaded of them
	depth  int64
	busy   string // the server's own reason, when it said it is busy
	bound  int
}

func (f *refusal) error(retry time.Duration) *openai.Error {
	why := fmt.Sprintf("its queue holds %d requests (the router's bound is %d per server)", f.depth, f.bound)
	if f.busy != "" {
		why = "it reports itself busy: " + f.busy
	}
	return &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeServer, Code: "overloaded",
		Message: fmt.Sprintf("the cluster is at capacity: no %s server admits more work (the least loaded, %s: %s); retry after %ss",
			f.role, f.server, why, retryAfterSeconds(retry))}
}

// full reports whether u admits no new request, and the refusal if not.
// u.mu is held.
func (rt *Router) full(u *upstream) *refusal {
	depth := u.queueDepth()
	switch {
	case u.busy != "":
		return &refusal{role: u.role, server: u.url, depth: depth, busy: u.busy, bound: rt.opts.MaxQueued}
	case rt.opts.MaxQueued > 0 && depth >= int64(rt.opts.MaxQueued):
		return &refusal{role: u.role, server: u.url, depth: depth, bound: rt.opts.MaxQueued}
	}
	return nil
}

// pick chooses the healthy server of role with the fewest requests in
// flight, round-robin among equals, and counts one more request on it;
// avoid (when not nil) is left out. With admit, a full server is passed
// over; when every healthy one is full, pick returns nil and the refusal
// of the least loaded. Without a healthy server it returns nil, nil.
func (rt *Router) pick(role string, avoid *upstream, admit bool) (*upstream, *refusal) {
	u, f := rt.choose(role, avoid, admit)
	if u != nil {
		u.served.Add(1)
		rt.metrics.inFlight.WithLabelValues(u.role, u.url).Inc()
	}
	return u, f
}

// choose is pick without counting the request as served or in the
// in-flight gauge: the router's canaries (canary.go) hold a place while
// they run (their load counts in the choice of servers and admission) but
// are no client's request; they end with releaseProbe.
func (rt *Router) choose(role string, avoid *upstream, admit bool) (*upstream, *refusal) {
	list, i := rt.prefill, 0
	if role == pdproto.RoleDecode {
		list, i = rt.decode, 1
	}
	rt.pickMu.Lock()
	defer rt.pickMu.Unlock()
	var best *upstream
	var bestLoad int64
	var refused *refusal
	n := len(list)
	start := int(rt.rr[i] % uint64(n))
	for k := range n {
		u := list[(start+k)%n]
		if u == avoid {
			continue
		}
		u.mu.Lock()
		healthy := u.healthy
		var f *refusal
		if healthy && admit {
			f = rt.full(u)
		}
		u.mu.Unlock()
		if !healthy {
			continue
		}
		if f != nil {
			if refused == nil || f.depth < refused.depth {
				refused = f
			}
			continue
		}
		if l := u.inFlight.Load(); best == nil || l < bestLoad {
			best, bestLoad = u, l
		}
	}
	if best == nil {
		return nil, refused
	}
	rt.rr[i]++
	best.inFlight.Add(1)
	return best, nil
}

// refuse answers a request no server of a role admits: 429 with
// Retry-After, counted by role.
func (rt *Router) refuse(w http.ResponseWriter, f *refusal) {
	rt.count(outcomeOverloaded)
	rt.metrics.refusals.WithLabelValues(f.role).Inc()
	rt.log.Debug("refused at the edge", "role", f.role, "server", f.server, "queued", f.depth, "busy", f.busy)
	w.Header().Set("Retry-After", retryAfterSeconds(rt.opts.HealthInterval))
	f.error(rt.opts.HealthInterval).WriteJSON(w)
}

// unavailable answers 503 with Retry-After: the router is starting, or no
// server of a role is healthy.
func (rt *Router) unavailable(w http.ResponseWriter, outcome string, e *openai.Error) {
	rt.count(outcome)
	w.Header().Set("Retry-After", retryAfterSeconds(rt.opts.HealthInterval))
	e.WriteJSON(w)
}

// errStarting is the 503 of a router whose first health round has not
// ended: it does not know yet which servers are up.
var errStarting = &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer,
	Message: "the router is starting: its first health check of the servers has not finished"}
