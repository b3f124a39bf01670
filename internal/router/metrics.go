package router

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Outcomes of a routed request, the label of pdkit_router_requests_total.
const (
	outcomeOK            = "ok"             // the decode side answered 2xx to its end
	outcomeUpstreamError = "upstream_error" // a server failed (its error was returned or the stream cut)
	outcomeUpstreamReply = "upstream_reply" // the decode side answered non-2xx, passed through
	outcomeInvalid       = "invalid"        // the router refused the body
	outcomeNoServer      = "no_server"      // no healthy prefill or decode server
	outcomeAborted       = "aborted"        // POST /abort_request
	outcomeClientGone    = "client_gone"    // the client disconnected
)

// metrics are the router's Prometheus metrics, on a registry of their own.
type metrics struct {
	reg            *prometheus.Registry
	requests       *prometheus.CounterVec
	upstreamErrors *prometheus.CounterVec
	inFlight       *prometheus.GaugeVec
	healthy        *prometheus.GaugeVec
	liveRooms      prometheus.Gauge
	retries        prometheus.Counter
}

func newMetrics() *metrics {
	const ns, sub = "pdkit", "router"
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Requests routed, by outcome (ok, upstream_error, upstream_reply, invalid, no_server, aborted, client_gone)."},
			[]string{"outcome"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "upstream_errors_total",
			Help: "Failed upstream requests (transport errors and 5xx answers), by server."},
			[]string{"role", "server"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "in_flight_requests",
			Help: "The router's requests in flight, by server."}, []string{"role", "server"}),
		healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "server_healthy",
			Help: "1 when a server gets new requests, else 0."}, []string{"role", "server"}),
		liveRooms: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "live_rooms",
			Help: "Bootstrap rooms of the requests in flight."}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "retries_total",
			Help: "Requests routed again because their prefill server refused the connection."}),
	}
	m.reg.MustRegister(m.requests, m.upstreamErrors, m.inFlight, m.healthy, m.liveRooms, m.retries)
	return m
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}
