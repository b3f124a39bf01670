package debug

import "time"

// A router's pause: it stops admitting new requests, which wait at its
// edge, queued, not refused, until it resumes or the pause's lease ends.
// No new prefill and decode pair is formed meanwhile, so an operator can
// change what every pair must agree on (the index-K precision) on every
// server at once, and no request meets two servers that disagree.

// The router's admin calls (POST, under the admin rule: the bearer token
// of --admin-token or the one the cluster secret derives).
const (
	// PausePath pauses admission, with ?drain=DURATION (how long the call
	// waits for the requests in flight to end; default 0: it answers at
	// once) and ?lease=DURATION (when the router resumes by itself if no
	// one calls ResumePath; default PauseDefaultLease, at most
	// PauseMaxLease). A second pause extends the lease. JSON
	// PauseResponse.
	PausePath = "/admin/v1/pause"
	// ResumePath resumes admission; the requests waiting are admitted.
	// JSON ResumeResponse.
	ResumePath = "/admin/v1/resume"
)

// The lease of a pause, when the call names none, and its bound: a pause
// whose caller died ends by itself.
const (
	PauseDefaultLease = 2 * time.Minute
	PauseMaxLease     = 30 * time.Minute
)

// PauseResponse answers POST /admin/v1/pause.
type PauseResponse struct {
	// InFlight is the requests admitted before the pause and still in
	// flight when the call answered; Drained says it reached 0 within the
	// drain bound.
	InFlight int  `json:"in_flight"`
	Drained  bool `json:"drained"`
	// WaitedMS is how long the call waited for the requests in flight.
	WaitedMS float64 `json:"waited_ms"`
	// LeaseMS is how long from now the router stays paused unless resumed.
	LeaseMS float64 `json:"lease_ms"`
}

// ResumeResponse answers POST /admin/v1/resume.
type ResumeResponse struct {
	// Resumed is false when the router was not paused (or its lease had
	// ended already).
	Resumed bool `json:"resumed"`
	// PausedMS is how long the pause lasted; Held counts the requests
	// that waited at the edge during it.
	PausedMS float64 `json:"paused_ms"`
	Held     uint64  `json:"held"`
}
