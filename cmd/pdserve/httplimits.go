package main

import (
	"log/slog"
	"time"

	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/internal/httpx"
)

// httpFlags are the HTTP listener's limits and the readiness judgement,
// shared by the router and the engine roles.
type httpFlags struct {
	limits           httpx.Limits
	readyFailureRate float64
	readyWindow      time.Duration
	g                *httpx.Guard // guard's, once called: every listener of the process shares its counts
}

func (h *httpFlags) register(f *pflag.FlagSet) {
	f.DurationVar(&h.limits.HeaderTimeout, "header-timeout", httpx.DefaultHeaderTimeout, "longest reading a request's headers may take; the connection is then closed (counted: pdkit_http_limit_hits_total{limit=\"header_timeout\"})")
	f.DurationVar(&h.limits.BodyTimeout, "body-timeout", httpx.DefaultBodyTimeout, "longest reading a request's body may take; it is then answered 408 (counted: limit=\"body_timeout\"); never bounds the response, streams included")
	f.IntVar(&h.limits.MaxConns, "max-connections", httpx.DefaultMaxConns, "connections open at once on the HTTP listener; one past it takes the place of the connection that has waited longest without sending a whole request, else of the kept-alive connection idle the longest, or, when there is neither, is answered 503 and closed at once (counted: limit=\"connections\")")
	f.IntVar(&h.limits.MaxConnsPerAddr, "max-connections-per-address", 0, "connections one remote address holds at once, by the same rule within its own (counted: limit=\"connections_per_address\"); 0: a quarter of --max-connections, and no fewer than 64 or --max-connections")
	f.Float64Var(&h.readyFailureRate, "ready-failure-rate", httpx.DefaultReadyFailureRate, "GET /readyz answers 503 while more than this share of the recent requests failed (1: never)")
	f.DurationVar(&h.readyWindow, "ready-window", httpx.DefaultReadyWindow, "how far back /readyz looks at requests (the last 100 at most, and at least 10 before it judges)")
}

// guard checks the flags and returns the listener guard, also kept in h.g
// for the process's other listeners.
func (h *httpFlags) guard() (*httpx.Guard, error) {
	if h.limits.HeaderTimeout <= 0 || h.limits.BodyTimeout <= 0 || h.limits.MaxConns <= 0 || h.limits.MaxConnsPerAddr < 0 {
		return nil, usagef("--header-timeout, --body-timeout and --max-connections must be positive, --max-connections-per-address not negative")
	}
	if h.readyFailureRate <= 0 || h.readyFailureRate > 1 || h.readyWindow <= 0 {
		return nil, usagef("--ready-failure-rate must be in (0, 1] and --ready-window positive")
	}
	h.g = httpx.NewGuard(h.limits)
	return h.g, nil
}

// logClamped warns when the process's descriptor limit lowered
// --max-connections (httpx.ConnsWithin): a flood then meets the cap, where
// silent connections are shed, before the process runs out of descriptors.
func logClamped(log *slog.Logger, g *httpx.Guard) {
	if asked, taken, ok := g.Clamped(); ok {
		log.Warn("--max-connections lowered to fit the open-file limit (ulimit -n) less a reserve", "asked", asked, "taken", taken)
	}
}
