package router

import (
	"fmt"

	"net/http"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// Probe statuses of GET /livez and /readyz.
const (
	probeOK       = "ok"
	probeNotLive  = "not_live"
	probeNotReady = "not_ready"
)

// LiveResponse is the body of the router's GET /livez.
type LiveResponse struct {
	Status string `json:"status"` // ok or not_live
	Reason string `json:"reason,omitempty"`
}

// ReadyResponse is the body of the router's GET /readyz: the verdict and
// what it was judged on (api/debug's, which pdctl reads).
type ReadyResponse = debug.RouterReady

// livez answers 200 while the router can serve: its HTTP server answers
// (this handler runs) and its health loop is not stuck. What its servers
// do never makes it 503: restarting the router would not mend them.
func (rt *Router) livez(w http.ResponseWriter, _ *http.Request) {
	resp := LiveResponse{Status: probeOK}
	// A round takes at most HealthTimeout and starts every HealthInterval.
	limit := 3 * (rt.opts.HealthInterval + rt.opts.HealthTimeout)
	select {
	case <-rt.done:
		resp.Status, resp.Reason = probeNotLive, "the health loop has stopped (the router is closing)"
	default:
		if age := time.Since(time.Unix(0, rt.round.Load())); age > limit {
			resp.Status, resp.Reason = probeNotLive, fmt.Sprintf("the health loop has not begun a round for %v (limit %v)", age.Round(time.Millisecond), limit)
		}
	}
	status := http.StatusOK
	if resp.Status != probeOK {
		status = http.StatusServiceUnavailable
	}
	writeJSON(w, status, resp)
}

// readyz answers 200 while the router should get traffic: its first
// health round has ended, a prefill and a decode server are healthy, and
// its recent proxied requests did not fail upstream past the limit.
func (rt *Router) readyz(w http.ResponseWriter, _ *http.Request) {
	now := time.Now()
	resp := ReadyResponse{Status: probeOK, HealthyPrefill: healthyCount(rt.prefill), HealthyDecode: healthyCount(rt.decode)}
	resp.RecentFailed, resp.RecentRequests = rt.recent.Count(now)
	switch {
	case !rt.ready.Load():
		resp.Reason = errStarting.Message
	case resp.HealthyPrefill == 0:
		resp.Reason = "no healthy prefill server"
	case resp.HealthyDecode == 0:
		resp.Reason = "no healthy decode server"
	default:
		resp.Reason = rt.recent.Verdict(now)
	}
	status := http.StatusOK
	if resp.Reason != "" {
		resp.Status, status = probeNotReady, http.StatusServiceUnavailable
		w.Header().Set("Retry-After", retryAfterSeconds(rt.opts.HealthInterval))
	}
	writeJSON(w, status, resp)
}
