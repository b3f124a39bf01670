package server

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/pdkit/pdkit/internal/httpx"
)

// Probes configure GET /livez and /readyz, which split liveness (restart
// the process when it fails) from readiness (send it no traffic while it
// fails). Zero values take the defaults noted per field.
type Probes struct {
	// LiveAfter is how long the engine loop may go without iterating
	// before /livez answers 503 (default 2 minutes, longer than a stalled
	// collective takes to be recovered from, so that recovery gets its
	// chance before a restart).
	LiveAfter time.Duration
	// ReadyFailureRate, ReadyWindow and ReadyMinRequests judge readiness
	// by the requests the engine finished lately: /readyz answers 503
	// while at least ReadyMinRequests finished within ReadyWindow and more
	// than ReadyFailureRate of them failed (an error or a timeout; aborts
	// are the client's and do not count). Defaults: the httpx.DefaultReady*
	// values; a rate of 1 turns it off.
	ReadyFailureRate float64
	ReadyWindow      time.Duration
	ReadyMinRequests int
}

// DefaultLiveAfter is Probes.LiveAfter's default.
const DefaultLiveAfter = 2 * time.Minute

// ProbeResponse is the body of GET /livez and /readyz: ok, or not_live or
// not_ready with the reason. /readyz also says what it judged on: the
// /health status and the requests finished in its window.
type ProbeResponse struct {
	Status         string `json:"status"`
	Reason         string `json:"reason,omitempty"`
	Health         string `json:"health,omitempty"`
	RecentRequests *int   `json:"recent_requests,omitempty"`
	RecentFailed   *int   `json:"recent_failed,omitempty"`
}

// registerProbes routes /livez and /readyz and has the metrics tell the
// readiness window of every finished request.
func (s *Server) registerProbes() {
	p := &s.opts.Probes
	if p.LiveAfter <= 0 {
		p.LiveAfter = DefaultLiveAfter
	}
	s.recent = httpx.NewRecentFailures(p.ReadyFailureRate, p.ReadyWindow, p.ReadyMinRequests)
	s.opts.Metrics.OnFinish(func(reason string) {
		switch {
		case reason == "timeout" || strings.HasPrefix(reason, "error"):
			s.recent.Record(true)
		case reason != "abort":
			s.recent.Record(false)
		}
	})
	s.handle("GET", "/livez", s.livez)
	s.handle("GET", "/readyz", s.readyz)
}

// livez answers 200 while the process can serve: this handler runs and
// the engine has neither failed for good nor stopped iterating for
// LiveAfter. A busy, stalled-for-a-while or failing-requests server is
// live: restarting it is not the cure.
func (s *Server) livez(w http.ResponseWriter, _ *http.Request) {
	resp := ProbeResponse{Status: "ok"}
	if why := s.notLive(time.Now()); why != "" {
		resp.Status, resp.Reason = "not_live", why
	}
	writeProbe(w, resp)
}

// notLive says why the server is not live at now ("" when it is).
func (s *Server) notLive(now time.Time) string {
	h := s.eng.View().Health(now)
	switch {
	case h.Err != "":
		return "engine failed: " + h.Err
	case h.LoopAge > s.opts.Probes.LiveAfter:
		return fmt.Sprintf("engine loop has not iterated for %v (limit %v)", h.LoopAge.Round(time.Millisecond), s.opts.Probes.LiveAfter)
	}
	return ""
}

// readyz answers 200 while the server should get traffic: it is live,
// /health says 200 and its recent requests did not fail past the limit.
func (s *Server) readyz(w http.ResponseWriter, _ *http.Request) {
	now := time.Now()
	health, status := s.judge(now)
	failed, total := s.recent.Count(now)
	resp := ProbeResponse{Status: "ok", Health: health.Status, RecentRequests: &total, RecentFailed: &failed}
	switch why := s.notLive(now); {
	case why != "":
		resp.Status, resp.Reason = "not_ready", "not live: "+why
	case status != http.StatusOK:
		resp.Status, resp.Reason = "not_ready", "unhealthy: "+health.Reason
	default:
		if v := s.recent.Verdict(now); v != "" {
			resp.Status, resp.Reason = "not_ready", v
		}
	}
	writeProbe(w, resp)
}

func writeProbe(w http.ResponseWriter, resp ProbeResponse) {
	status := http.StatusOK
	if resp.Status != "ok" {
		status = http.StatusServiceUnavailable
	}
	writeJSON(w, status, resp)
}
