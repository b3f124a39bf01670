package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
)

// upstream is one prefill or decode server.
type upstream struct {
	role string // the role the router was given it as
	url  string

	inFlight atomic.Int64  // the router's requests in flight on it
	served   atomic.Uint64 // requests sent to it

	mu        sync.Mutex
	healthy   bool
	reason    string // why not healthy
	fails     int    // failed checks in a row
	info      pdproto.ServerInfo
	lastCheck time.Time
	// The last good check's load: the requests queued and running in the
	// server, the router's own in flight on it when the check was sent,
	// and why the server said it is busy ("" when it did not).
	queued, running int64
	inFlightAtCheck int64
	busy            string
}

// snapshot returns the state of u that routing needs.
func (u *upstream) state() (healthy bool, info pdproto.ServerInfo) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.healthy, u.info
}

func (rt *Router) healthLoop(ctx context.Context) {
	defer close(rt.done)
	t := time.NewTicker(rt.opts.HealthInterval)
	defer t.Stop()
	for {
		rt.round.Store(time.Now().UnixNano())
		rt.CheckNow(ctx)
		if ctx.Err() == nil {
			rt.ready.Store(true)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// CheckNow checks every server once, concurrently, and returns when all
// checks have ended (each is bounded by HealthTimeout and ctx).
func (rt *Router) CheckNow(ctx context.Context) {
	var wg sync.WaitGroup
	for _, u := range rt.servers() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rt.check(ctx, u)
		}()
	}
	wg.Wait()
}

func (rt *Router) servers() []*upstream {
	all := make([]*upstream, 0, len(rt.prefill)+len(rt.decode))
	return append(append(all, rt.prefill...), rt.decode...)
}

// check runs one health check of u and records its outcome. A role that
// does not match marks u down at once; other failures after FailThreshold
// checks in a row.
func (rt *Router) check(parent context.Context, u *upstream) {
	ctx, cancel := context.WithTimeout(parent, rt.opts.HealthTimeout)
	defer cancel()
	inFlight := u.inFlight.Load()
	info, load, mismatch, err := rt.probe(ctx, u)
	if parent.Err() != nil {
		return // the router is closing: not the server's fault
	}
	rt.setHealth(u, func() {
		u.lastCheck = time.Now()
		switch {
		case err == nil:
			u.healthy, u.reason, u.fails, u.info = true, "", 0, info
			u.queued, u.running, u.inFlightAtCheck, u.busy = int64(load.Queued), int64(load.Running), inFlight, ""
			if load.Status == statusBusy {
				u.busy = load.Reason
				if u.busy == "" {
					u.busy = "busy"
				}
			}
		case mismatch:
			u.fails++
			u.healthy, u.reason, u.info = false, err.Error(), info
		default:
			rt.failed(u, err.Error())
		}
	})
	if err != nil {
		rt.log.Debug("health check failed", "role", u.role, "url", u.url, "err", err)
	}
}

// failed counts one failure of u, a failed check or a refused or dropped
// connection, and marks u down once FailThreshold came in a row (at once
// if it is down already). u.mu is held.
func (rt *Router) failed(u *upstream, reason string) {
	u.fails++
	if u.fails >= rt.opts.FailThreshold || !u.healthy {
		u.healthy, u.reason = false, reason
	}
}

// setHealth runs update on u under its lock and logs and exports a change
// of its health.
func (rt *Router) setHealth(u *upstream, update func()) {
	u.mu.Lock()
	defer u.mu.Unlock()
	was := u.healthy
	update()
	if u.healthy == was {
		return
	}
	if u.healthy {
		rt.log.Info("server up", "role", u.role, "url", u.url, "model", u.info.Model, "tp_size", u.info.TPSize)
		rt.metrics.healthy.WithLabelValues(u.role, u.url).Set(1)
	} else {
		rt.log.Warn("server down", "role", u.role, "url", u.url, "reason", u.reason, "failed_checks", u.fails)
		rt.metrics.healthy.WithLabelValues(u.role, u.url).Set(0)
	}
}

// transportFailed takes a proxied call's error as evidence about u: a
// connection that could not be made, or was reset or closed by u, counts
// like a failed health check, so a server that died leaves the rotation
// after FailThreshold such calls instead of waiting for the checks (which
// bring it back once it answers). Cancellations (the client went, an
// abort) and errors of the router's own making say nothing about u.
func (rt *Router) transportFailed(ctx context.Context, u *upstream, err error) {
	if err == nil || ctx.Err() != nil || !connectionError(err) {
		return
	}
	rt.setHealth(u, func() { rt.failed(u, "request failed: "+err.Error()) })
}

// refused reports whether err is a failure to connect: nothing of the
// request reached the server.
func refused(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// connectionError reports whether err is a failure of the connection to
// the server: a refused or failed dial, a reset, an unexpected close.
func connectionError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED)
}

// serverHealth is what the router reads of a server's GET /health answer
// (internal/server.HealthResponse): its status and load. Fields a server
// does not send count as 0.
type serverHealth struct {
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Queued  int    `json:"queued"`
	Running int    `json:"running"`
}

// statusBusy is a server's /health status while a request has waited past
// its --max-queue-age: healthy (200), but admitting no new work.
const statusBusy = "busy"

// probe asks u for /health and its info. mismatch reports a server that
// answers but is not what the router takes it for.
func (rt *Router) probe(ctx context.Context, u *upstream) (info pdproto.ServerInfo, load serverHealth, mismatch bool, err error) {
	status, body, err := rt.get(ctx, u.url+"/health")
	if err != nil {
		return info, load, false, fmt.Errorf("health check: %v", err)
	}
	if status != http.StatusOK {
		return info, load, false, fmt.Errorf("health check: status %d: %s", status, summary(body))
	}
	_ = json.Unmarshal(body, &load) // a body without the load is a server without queues to report
	status, body, err = rt.get(ctx, u.url+pdproto.InfoPath)
	if err != nil {
		return info, load, false, fmt.Errorf("server info: %v", err)
	}
	if status != http.StatusOK {
		return info, load, false, fmt.Errorf("server info: status %d: %s", status, summary(body))
	}
	if err := json.Unmarshal(body, &info); err != nil {
		return info, load, false, fmt.Errorf("server info: %v", err)
	}
	if info.Role != u.role {
		return info, load, true, fmt.Errorf("role mismatch: given as a %s server, it says it is %q", u.role, info.Role)
	}
	if u.role == pdproto.RolePrefill && info.BootstrapURL == "" {
		return info, load, true, fmt.Errorf("prefill server reports no bootstrap_url")
	}
	return info, load, false, nil
}

// get fetches url, reading at most 1 MiB of its body.
func (rt *Router) get(ctx context.Context, url string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := rt.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, body, err
}

// summary shortens a response body for a reason string.
func summary(body []byte) string {
	s := strings.TrimSpace(string(body))
	if e := openai.ParseError(500, body); e.Message != "" && e.Message != s {
		s = e.Message
	} else {
		var h struct {
			Reason string `json:"reason"`
		}
		if json.Unmarshal(body, &h) == nil && h.Reason != "" {
			s = h.Reason
		}
	}
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}

// otherHealthy reports whether a prefill server other than u is healthy.
func (rt *Router) otherHealthy(u *upstream) bool {
	for _, o := range rt.prefill {
		if ok, _ := o.state(); ok && o != u {
			return true
		}
	}
	return false
}

// release ends a request that pick counted on u.
func (rt *Router) release(u *upstream) {
	u.inFlight.Add(-1)
	rt.metrics.inFlight.WithLabelValues(u.role, u.url).Dec()
}

// releaseProbe ends a canary that choose counted on u.
func (rt *Router) releaseProbe(u *upstream) { u.inFlight.Add(-1) }

// healthyCount counts the healthy servers of list.
func healthyCount(list []*upstream) int {
	n := 0
	for _, u := range list {
		if ok, _ := u.state(); ok {
			n++
		}
	}
	return n
}

// HealthResponse is the body of the router's GET /health.
type HealthResponse struct {
	Status         string `json:"status"` // ok, starting or unhealthy
	Reason         string `json:"reason,omitempty"`
	HealthyPrefill int    `json:"healthy_prefill"`
	HealthyDecode  int    `json:"healthy_decode"`
}

func (rt *Router) health(w http.ResponseWriter, _ *http.Request) {
	resp := HealthResponse{Status: "ok", HealthyPrefill: healthyCount(rt.prefill), HealthyDecode: healthyCount(rt.decode)}
	switch {
	case !rt.ready.Load():
		resp.Status, resp.Reason = "starting", errStarting.Message
	case resp.HealthyPrefill == 0:
		resp.Status, resp.Reason = "unhealthy", "no healthy prefill server"
	case resp.HealthyDecode == 0:
		resp.Status, resp.Reason = "unhealthy", "no healthy decode server"
	}
	status := http.StatusOK
	if resp.Reason != "" {
		status = http.StatusServiceUnavailable
		w.Header().Set("Retry-After", retryAfterSeconds(rt.opts.HealthInterval))
	}
	writeJSON(w, status, resp)
}

func (rt *Router) cluster(w http.ResponseWriter, _ *http.Request) {
	resp := debug.ClusterResponse{
		HealthyPrefill:   healthyCount(rt.prefill),
		HealthyDecode:    healthyCount(rt.decode),
		LiveRooms:        rt.rooms.count(),
		HealthIntervalMS: float64(rt.opts.HealthInterval) / float64(time.Millisecond),
		MaxQueued:        max(0, rt.opts.MaxQueued),
		Ready:            rt.ready.Load(),
		Servers:          []debug.ClusterServer{},
	}
	if rt.canaries != nil {
		resp.Canaries = rt.canaries.status()
	}
	if paused, left, waiting, _ := rt.gate.status(); paused {
		resp.Paused, resp.PausedUntilMS, resp.Waiting = true, ms(left), waiting
	}
	for _, u := range rt.servers() {
		u.mu.Lock()
		s := debug.ClusterServer{
			Role: u.role, URL: u.url, Healthy: u.healthy, Reason: u.reason, ConsecutiveFailures: u.fails,
			TPSize: u.info.TPSize, Model: u.info.Model, BootstrapURL: u.info.BootstrapURL,
			InFlight: u.inFlight.Load(), RequestsServed: u.served.Load(),
			Queued: u.queueDepth(), Running: u.running, Busy: u.busy != "",
		}
		if !u.lastCheck.IsZero() {
			t := u.lastCheck
			s.LastCheck = &t
		}
		u.mu.Unlock()
		resp.Servers = append(resp.Servers, s)
	}
	writeJSON(w, http.StatusOK, resp)
}

// models answers GET /v1/models from a healthy decode server.
func (rt *Router) models(w http.ResponseWriter, r *http.Request) {
	u, _ := rt.pick(pdproto.RoleDecode, nil, false)
	if u == nil {
		w.Header().Set("Retry-After", retryAfterSeconds(rt.opts.HealthInterval))
		noServer(pdproto.RoleDecode).WriteJSON(w)
		return
	}
	defer rt.release(u)
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	status, body, err := rt.get(ctx, u.url+"/v1/models")
	if err != nil {
		rt.metrics.upstreamErrors.WithLabelValues(u.role, u.url).Inc()
		(&openai.Error{Status: http.StatusBadGateway, Type: openai.TypeServer,
			Message: fmt.Sprintf("decode server %s: %v", u.url, err)}).WriteJSON(w)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}

// noServer is the 503 for a role without a healthy server.
func noServer(role string) *openai.Error {
	return &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer,
		Message: fmt.Sprintf("no healthy %s server", role)}
}
