// Package router is the OpenAI-compatible front of a PD cluster: for each
// request it picks a healthy prefill and a healthy decode server (the least
// loaded by its own count of requests in flight, round-robin among equals),
// assigns a bootstrap room no live request holds, sends the request to both
// at once and streams the decode side's answer back. The prefill side's
// answer is awaited only for its errors: a prefill failure before the decode
// side has produced anything cancels the decode side and is returned to the
// client.
//
// Aborts fan out: when the client disconnects, or on POST /abort_request
// with the router's request id, both upstream requests are cancelled, and
// the servers abort a request whose client went away. The router's id (the
// X-Pdkit-Abort-Id response header) carries 130 random bits, and possession of it
// is the authorization to abort: /abort_request accepts no other id (not
// the decode side's response id, which servers number in sequence), so a
// client cannot cancel another's request. Operators abort any request on
// the servers' admin API (POST /admin/v1/requests/{id}/abort, behind
// --admin-token).
//
// A goroutine owned by the Router checks every server's /health and
// /pd/v1/info at an interval; a server that fails FailThreshold checks in a
// row, or whose info names another role than the one it was given as, gets
// no new requests until it is healthy again. Until the first round of
// checks has ended, requests are answered 503 with Retry-After.
//
// Busy is not dead: each check also reads the server's queue depth, and a
// server whose depth (with the router's own requests sent since) has
// reached Options.MaxQueued, or that says it is busy, gets no new request;
// when no server of a role admits one, the request is answered 429 with
// Retry-After before any of it is sent (admission.go).
//
// A stream cut before its end (a decode server that died or ended it
// early, an abort, the router's shutdown) ends with an SSE error event,
// data: {"error": {...}}, so that the client knows it was cut.
//
// Liveness is not readiness (probes.go): GET /livez answers 200 while the
// router serves HTTP and its health loop runs, whatever its servers do, so
// that an orchestrator never restarts a router because its upstreams
// fail; GET /readyz answers 503 with a reason while it should get no
// traffic: no healthy prefill or decode server, or more than
// Options.ReadyFailureRate of its recent proxied requests failed upstream.
//
// Routes: POST /v1/completions, /v1/chat/completions and /generate (proxied),
// POST /abort_request, GET /v1/models (from a healthy decode server),
// GET /health, /livez and /readyz, GET /metrics (Prometheus, namespace
// pdkit), GET /debug/v1/cluster (api/debug.ClusterResponse), GET
// /pd/v1/info, and the admin calls POST /admin/v1/pause and /resume
// (pause.go).
package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/httpx"
)

// Options configure a Router. Zero values take the defaults noted per field.
type Options struct {
	// Prefill and Decode are the servers' base URLs (http://host:port); at
	// least one of each is required.
	Prefill []string
	Decode  []string
	// HealthInterval is the time between two health checks of a server
	// (default 1s).
	HealthInterval time.Duration
	// HealthTimeout bounds one health check (default 2s).
	HealthTimeout time.Duration
	// FailThreshold is how many health checks in a row a server must fail
	// to be marked down (default 2).
	FailThreshold int
	// PrefillGrace is how long a finished decode response waits for its
	// prefill side's answer before cancelling it (default 2s).
	PrefillGrace time.Duration
	// MaxBodyBytes bounds request bodies (default 4 MiB).
	MaxBodyBytes int64
	// MaxQueued is the admission bound: the queue depth at which a server
	// admits no new request (default DefaultMaxQueued; negative: no
	// bound). When every healthy server of a role is at it, requests are
	// answered 429 with Retry-After.
	MaxQueued int
	// ReadyFailureRate, ReadyWindow and ReadyMinRequests judge readiness
	// by the recent proxied requests: GET /readyz answers 503 while at
	// least ReadyMinRequests requests ended within ReadyWindow and more
	// than ReadyFailureRate of them failed upstream (defaults: the
	// httpx.DefaultReady* values; a rate of 1 turns it off).
	ReadyFailureRate float64
	ReadyWindow      time.Duration
	ReadyMinRequests int
	// ClusterSecret is the PD cluster's shared secret (nil without one).
	// With it set, every request the router sends to a prefill or decode
	// server's generation endpoints is signed with it
	// (clusterauth.SignRequest): servers with the secret refuse unsigned PD
	// requests.
	ClusterSecret *clusterauth.Secret
	// CanaryInterval is the time between two of the router's correctness
	// probes (canary.go; default DefaultCanaryInterval, negative: none).
	CanaryInterval time.Duration
	// Admin is who may call the router's admin API (POST /admin/v1/pause
	// and /admin/v1/resume): the zero rule lets no one.
	Admin httpx.AdminRule
	// Guard, when set, is the listener guard the router is served behind;
	// GET /metrics exports its limit hits.
	Guard *httpx.Guard
	// Logger receives the router's logs (default slog.Default()).
	Logger *slog.Logger
	// Client sends the upstream requests (default: a client with dial,
	// TLS and idle timeouts but no overall timeout, since responses
	// stream; every request carries a context).
	Client *http.Client
}

// Router is the HTTP handler of a PD router. It is safe for concurrent use.
// Close stops its health checks.
type Router struct {
	opts    Options
	log     *slog.Logger
	client  *http.Client
	mux     *httpx.Mux
	metrics *metrics
	created int64

	prefill []*upstream
	decode  []*upstream

	pickMu sync.Mutex // makes choosing a server and counting it one step
	rr     [2]uint64  // round-robin offsets: prefill, decode

	rooms  rooms
	reqs   requests
	ready  atomic.Bool  // the first round of health checks has ended
	round  atomic.Int64 // when the health loop last began a round (unix ns)
	recent *httpx.RecentFailures
	gate   *gate // the operator's pause of admission (pause.go)

	canaries   *canaries     // nil when off
	canaryDone chan struct{} // closed when the canary loop has returned

	stop   context.CancelFunc
	done   chan struct{} // closed when the health loop has returned
	closed sync.Once
}

// New checks opts, starts the health checks and returns the router. The
// servers count as down until their first good check; CheckNow runs one
// round at once.
func New(opts Options) (*Router, error) {
	if len(opts.Prefill) == 0 || len(opts.Decode) == 0 {
		return nil, errors.New("router: at least one prefill and one decode server are required")
	}
	if opts.HealthInterval <= 0 {
		opts.HealthInterval = time.Second
	}
	if opts.HealthTimeout <= 0 {
		opts.HealthTimeout = 2 * time.Second
	}
	if opts.FailThreshold <= 0 {
		opts.FailThreshold = 2
	}
	if opts.PrefillGrace <= 0 {
		opts.PrefillGrace = 2 * time.Second
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = openai.DefaultMaxBodyBytes
	}
	if opts.MaxQueued == 0 {
		opts.MaxQueued = DefaultMaxQueued
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.CanaryInterval == 0 {
		opts.CanaryInterval = DefaultCanaryInterval
	}
	if opts.Client == nil {
		opts.Client = defaultClient()
	}
	rt := &Router{
		opts: opts, log: opts.Logger, client: opts.Client,
		mux:     httpx.NewMux(opts.Logger),
		metrics: newMetrics(), created: time.Now().Unix(),
		rooms:  rooms{live: map[uint64]struct{}{}},
		reqs:   requests{byID: map[string]*tracked{}},
		recent: httpx.NewRecentFailures(opts.ReadyFailureRate, opts.ReadyWindow, opts.ReadyMinRequests),
		done:   make(chan struct{}),
		gate:   newGate(),
	}
	rt.round.Store(time.Now().UnixNano())
	seen := map[string]bool{}
	for _, role := range []string{pdproto.RolePrefill, pdproto.RoleDecode} {
		urls := opts.Prefill
		if role == pdproto.RoleDecode {
			urls = opts.Decode
		}
		for _, raw := range urls {
			u, err := ParseServerURL(raw)
			if err != nil {
				return nil, err
			}
			if seen[u] {
				return nil, fmt.Errorf("router: server %s given twice", u)
			}
			seen[u] = true
			up := &upstream{role: role, url: u, reason: "not checked yet"}
			if role == pdproto.RolePrefill {
				rt.prefill = append(rt.prefill, up)
			} else {
				rt.decode = append(rt.decode, up)
			}
			rt.metrics.healthy.WithLabelValues(role, u).Set(0)
			rt.metrics.inFlight.WithLabelValues(role, u).Set(0)
		}
	}
	rt.metrics.reg.MustRegister(queueCollector{rt}, pauseCollector{rt.gate})
	if opts.Guard != nil {
		rt.metrics.reg.MustRegister(opts.Guard)
	}
	rt.handle("POST", "/v1/completions", rt.proxy)
	rt.handle("POST", "/v1/chat/completions", rt.proxy)
	rt.handle("POST", "/generate", rt.proxy)
	rt.handle("POST", "/abort_request", rt.abort)
	rt.handle("GET", "/v1/models", rt.models)
	rt.handle("GET", "/health", rt.health)
	rt.handle("GET", "/livez", rt.livez)
	rt.handle("GET", "/readyz", rt.readyz)
	rt.handle("GET", "/metrics", rt.metrics.handler().ServeHTTP)
	rt.handle("GET", "/debug/v1/cluster", rt.cluster)
	rt.handle("GET", pdproto.InfoPath, rt.info)
	rt.adminRoutes()

	ctx, cancel := context.WithCancel(context.Background())
	rt.stop = cancel
	go rt.healthLoop(ctx)
	if opts.CanaryInterval > 0 {
		rt.canaries, rt.canaryDone = newCanaries(rt), make(chan struct{})
		rt.metrics.reg.MustRegister(rt.canaries.counts)
		go rt.canaries.loop(ctx, opts.CanaryInterval, rt.canaryDone)
	}
	return rt, nil
}

// ParseServerURL checks a server's base URL (http or https, with a host)
// and returns it without a trailing slash.
func ParseServerURL(raw string) (string, error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	if err != nil {
		return "", fmt.Errorf("server URL %q: %v", raw, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("server URL %q: want http://host:port", raw)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return "", fmt.Errorf("server URL %q: want a base URL without user, query or fragment", raw)
	}
	return strings.TrimRight(u.String(), "/"), nil
}

func defaultClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:                 nil, // the servers are the cluster's own
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout:   5 * time.Second,
		ExpectContinueTimeout: time.Second,
		IdleConnTimeout:       90 * time.Second,
		MaxIdleConns:          1024,
		MaxIdleConnsPerHost:   256,
		ForceAttemptHTTP2:     true,
	}}
}

// Cut ends every request in flight at once, as a shutdown's deadline
// does: each is cancelled on both servers, and its client gets an SSE
// error event (a stream already begun) or a 503 saying the router shut
// down. The handlers return soon after; the http.Server owns them.
func (rt *Router) Cut() int { return rt.reqs.cancelAll(errShutdown) }

// Close stops the health checks and waits for their goroutine. Requests in
// flight are not affected; the http.Server that serves the Router owns them.
func (rt *Router) Close() error {
	rt.closed.Do(func() {
		rt.stop()
		<-rt.done
		if rt.canaryDone != nil {
			<-rt.canaryDone
		}
		if t, ok := rt.client.Transport.(*http.Transport); ok && rt.opts.Client == nil {
			t.CloseIdleConnections()
		}
	})
	return nil
}

func (rt *Router) handle(method, path string, h http.HandlerFunc) { rt.mux.Handle(method, path, h) }

// ServeHTTP serves r, turning a handler panic into a logged 500.
func (rt *Router) ServeHTTP(w http.ResponseWriter, r *http.Request) { rt.mux.ServeHTTP(w, r) }

func writeJSON(w http.ResponseWriter, status int, v any) { httpx.WriteJSON(w, status, v) }

func (rt *Router) info(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, pdproto.ServerInfo{Role: pdproto.RoleRouter})
}
