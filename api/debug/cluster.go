package debug

import "time"

// ClusterPath is where a router lists the servers it routes to (GET, JSON
// ClusterResponse), so that a tool can find every server of a PD cluster
// from the router alone.
const ClusterPath = "/debug/v1/cluster"

// ClusterResponse is the body of GET /debug/v1/cluster on a router.
type ClusterResponse struct {
	// HealthyPrefill and HealthyDecode count the servers of each role that
	// get new requests.
	HealthyPrefill int `json:"healthy_prefill"`
	HealthyDecode  int `json:"healthy_decode"`
	// LiveRooms is the number of bootstrap rooms of requests in flight.
	LiveRooms int `json:"live_rooms"`
	// HealthIntervalMS is the time between two health checks of a server.
	HealthIntervalMS float64 `json:"health_interval_ms"`
	// MaxQueued is the router's admission bound: the queue depth (Queued)
	// at which a server gets no new request and the router answers 429;
	// 0 when there is none.
	MaxQueued int `json:"max_queued"`
	// Ready is false until the router's first round of health checks has
	// ended; until then it answers 503 with Retry-After.
	Ready bool `json:"ready"`
	// Paused says an operator has paused admission (PausePath): new
	// requests wait at the edge until PausedUntilMS from now at most;
	// Waiting counts them.
	Paused        bool    `json:"paused,omitempty"`
	PausedUntilMS float64 `json:"paused_until_ms,omitempty"`
	Waiting       int     `json:"waiting,omitempty"`
	// Canaries are the router's correctness probes (--canary-interval);
	// nil when they are off or none has run yet.
	Canaries *Canaries `json:"canaries,omitempty"`
	// Servers lists the prefill servers, then the decode servers, in the
	// order the router was given them.
	Servers []ClusterServer `json:"servers"`
}

// ClusterServer is one server as its router sees it.
type ClusterServer struct {
	// Role is the role the router was told (prefill or decode).
	Role string `json:"role"`
	URL  string `json:"url"`
	// Healthy: the server gets new requests.
	Healthy bool `json:"healthy"`
	// Reason says why the server is not healthy; empty while healthy.
	Reason string `json:"reason,omitempty"`
	// ConsecutiveFailures counts the failed health checks since the last
	// good one.
	ConsecutiveFailures int `json:"consecutive_failures"`
	// TPSize, Model and BootstrapURL come from the server's last
	// /pd/v1/info answer (BootstrapURL only on a prefill server).
	TPSize       int    `json:"tp_size"`
	Model        string `json:"model"`
	BootstrapURL string `json:"bootstrap_url,omitempty"`
	// LastCheck is when the last health check ended; null before the
	// first one.
	LastCheck *time.Time `json:"last_check"`
	// InFlight counts the router's requests in flight on the server, and
	// RequestsServed those it has sent there since the router started.
	InFlight       int64  `json:"in_flight"`
	RequestsServed uint64 `json:"requests_served"`
	// Queued is the server's queue depth as the router admits by it: the
	// requests waiting in the server (scheduler and PD wait queue) at its
	// last health check, plus the router's requests sent to it since, and
	// at least the router's requests in flight on it that the server did
	// not report running. Running is what the last check reported running.
	Queued  int64 `json:"queued"`
	Running int64 `json:"running"`
	// Busy: the server's last health check said a request has waited past
	// its --max-queue-age; it gets no new request until it says otherwise.
	Busy bool `json:"busy"`
}

// RouterReady is the body of the router's GET /readyz (200 when ready, 503
// when not): the verdict and what it was judged on.
type RouterReady struct {
	Status         string `json:"status"` // ok or not_ready
	Reason         string `json:"reason,omitempty"`
	HealthyPrefill int    `json:"healthy_prefill"`
	HealthyDecode  int    `json:"healthy_decode"`
	// RecentRequests are the proxied requests of the readiness window
	// whose outcome says whether the cluster served them (ok or
	// upstream_error), RecentFailed those that failed upstream.
	RecentRequests int `json:"recent_requests"`
	RecentFailed   int `json:"recent_failed"`
}

// Canaries are a router's correctness probes: their counts by result
// (match, mismatch, skipped, failed) and the last mismatch.
type Canaries struct {
	Results      map[string]uint64 `json:"results"`
	LastMismatch *CanaryMismatch   `json:"last_mismatch,omitempty"`
}

// CanaryMismatch is a canary whose cached (or host-loaded) output differed
// from the one computed without the cache.
type CanaryMismatch struct {
	At       time.Time `json:"at"`
	Prefill  string    `json:"prefill"`
	Decode   string    `json:"decode"`
	Seed     uint64    `json:"seed"`
	Cached   string    `json:"cached"`
	Computed string    `json:"computed"`
}
