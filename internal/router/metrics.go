package router

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Outcomes of a routed request, the label of pdkit_router_requests_total.
const (
	outcomeOK            = "ok"             // the decode side answered 2xx to its end
	outcomeClientError   = "client_error"   // a server answered 4xx: the request's fault, passed through
	outcomeUpstreamError = "upstream_error" // a server failed: a 5xx, a transport error, a stream cut or ended early
	outcomeInvalid       = "invalid"        // the router refused the body
	outcomeStarting      = "starting"       // 503: the first round of health checks had not ended
	outcomeNoServer      = "no_server"      // 503: no healthy prefill or decode server
	outcomeOverloaded    = "overloaded"     // 429: no server of a role admitted more work
	outcomeAborted       = "aborted"        // POST /abort_request, or an answer that ended with finish_reason "abort"
	outcomeClientGone    = "client_gone"    // the client disconnected
	outcomeShutdown      = "shutdown"       // cut by the router's shutdown deadline
)

// Outcomes lists every outcome label value, for the help text and tests.
var Outcomes = []string{outcomeOK, outcomeClientError, outcomeUpstreamError, outcomeInvalid, outcomeStarting,
	outcomeNoServer, outcomeOverloaded, outcomeAborted, outcomeClientGone, outcomeShutdown}

// metrics are the router's Prometheus metrics, on a registry of their own.
type metrics struct {
	reg            *prometheus.Registry
	requests       *prometheus.CounterVec
	upstreamErrors *prometheus.CounterVec
	inFlight       *prometheus.GaugeVec
	healthy        *prometheus.GaugeVec
	liveRooms      prometheus.Gauge
	retries        prometheus.Counter
	refusals       *prometheus.CounterVec
	pauseWaits     prometheus.Counter
	ttft           *prometheus.HistogramVec
	itl            *prometheus.HistogramVec
	e2e            *prometheus.HistogramVec
}

// Latency buckets in seconds, the servers' (internal/metrics): 1ms to
// about 33s for tokens, 10ms to about 41 minutes for whole requests.
var (
	tokenBuckets   = prometheus.ExponentialBuckets(0.001, 2, 16)
	requestBuckets = prometheus.ExponentialBuckets(0.01, 2, 18)
)

func newMetrics() *metrics {
	const ns, sub = "pdkit", "router"
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Requests routed, by outcome: ok; client_error (a server answered 4xx); upstream_error (a server's 5xx or transport error, or a stream cut or ended early); invalid (the router refused the body); starting (503 before the first health round); no_server (503); overloaded (429 at the admission bound); aborted; client_gone; shutdown (cut by the shutdown deadline)."},
			[]string{"outcome"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "upstream_errors_total",
			Help: "Failed upstream requests (transport errors, 5xx answers, streams cut or ended early), by server; a server's 4xx is the client's error and not counted."},
			[]string{"role", "server"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "in_flight_requests",
			Help: "The router's requests in flight, by server."}, []string{"role", "server"}),
		healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "server_healthy",
			Help: "1 when a server gets new requests, else 0."}, []string{"role", "server"}),
		liveRooms: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "live_rooms",
			Help: "Bootstrap rooms of the requests in flight."}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "retries_total",
			Help: "Requests routed again before any answer: their prefill server refused the connection, or a server restarted under them (it refused a request signed for its old id)."}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "admission_refusals_total",
			Help: "Requests answered 429 at the edge because every healthy server of role was at the admission bound or busy."},
			[]string{"role"}),
		pauseWaits: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "paused_waits_total",
			Help: "Requests that waited at the edge while an operator had paused admission (POST /admin/v1/pause)."}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "time_to_first_token_seconds",
			Help:    "Streams: time from a request's arrival at the router to its first token event sent to the client, queueing in the cluster included, by model (mirrors sglang:time_to_first_token_seconds).",
			Buckets: tokenBuckets}, []string{"model"}),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "inter_token_latency_seconds",
			Help:    "Streams: time between consecutive token events sent to the client, by model (mirrors sglang:inter_token_latency_seconds).",
			Buckets: tokenBuckets}, []string{"model"}),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "e2e_request_latency_seconds",
			Help:    "Time from a request's arrival at the router to the end of its answer, for requests answered 2xx to their end, by model (mirrors sglang:e2e_request_latency_seconds).",
			Buckets: requestBuckets}, []string{"model"}),
	}
	m.reg.MustRegister(m.requests, m.upstreamErrors, m.inFlight, m.healthy, m.liveRooms, m.retries, m.refusals, m.pauseWaits, m.ttft, m.itl, m.e2e)
	// The Go runtime, the process and the build, as on every server.
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewBuildInfoCollector())
	for _, o := range Outcomes {
		m.requests.WithLabelValues(o) // every outcome exported from the start, at 0
	}
	return m
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// queueCollector exports each server's queue depth as the router admits by
// it, read at scrape time.
type queueCollector struct{ rt *Router }

var queuedDesc = prometheus.NewDesc("pdkit_router_server_queued_requests",
	"A server's queue depth as the router admits by it: the requests queued in it at its last health check, plus the router's requests sent to it since, and at least the router's requests in flight on it that it did not report running.",
	[]string{"role", "server"}, nil)

var busyDesc = prometheus.NewDesc("pdkit_router_server_busy",
	"1 while a server's last health check said a request has waited past its --max-queue-age (it gets no new request), else 0.",
	[]string{"role", "server"}, nil)

func (c queueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- queuedDesc
	ch <- busyDesc
}

func (c queueCollector) Collect(ch chan<- prometheus.Metric) {
	for _, u := range c.rt.servers() {
		u.mu.Lock()
		depth, busy := u.queueDepth(), 0.0
		if u.busy != "" {
			busy = 1
		}
		u.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(queuedDesc, prometheus.GaugeValue, float64(depth), u.role, u.url)
		ch <- prometheus.MustNewConstMetric(busyDesc, prometheus.GaugeValue, busy, u.role, u.url)
	}
}
