package debug

import "time"

// Index-K: the sparse indexer's keys (a llama-dsa model's), stored per
// token in one of two precisions, fp8 (e4m3 and a scale per token) or bf16.
// Settings.IndexK says which a server runs now; it is switched live through
// the admin API. A switch drains the server (it stops admitting, lets the
// requests in flight finish, or aborts them once the drain bound has
// passed), reallocates the index keys, drops the cached prefixes (device
// and host tier) written in the old precision, and resumes. The two sides
// of a PD pair must run the same precision (the handshake refuses a
// mismatch), so a cluster is switched with its router paused (PausePath),
// prefill servers first, then decode servers.

// The index-K precisions, as the API names them.
const (
	IndexKFP8  = "fp8"
	IndexKBF16 = "bf16"
)

// IndexKPath is the admin call that switches a server to precision dtype
// (POST, JSON IndexKSwitchResponse): /admin/v1/indexk/fp8 or
// /admin/v1/indexk/bf16, with an optional ?drain=DURATION (Go syntax:
// 30s, 2m; default IndexKDefaultDrain).
func IndexKPath(dtype string) string { return "/admin/v1/indexk/" + dtype }

// IndexKDefaultDrain is how long a switch lets the requests in flight
// finish before it aborts them, when the call names no drain.
const IndexKDefaultDrain = 30 * time.Second

// IndexKSwitchMargin is how long past its drain bound a switch call waits
// for the switch to be done (the aborts settle, every rank switches) before
// the server answers 202, the switch still under way: a server answers
// within drain + IndexKSwitchMargin.
const IndexKSwitchMargin = 10 * time.Second

// IndexKSwitchResponse answers POST /admin/v1/indexk/{fp8|bf16}.
type IndexKSwitchResponse struct {
	From string `json:"from"` // the precision before the switch
	To   string `json:"to"`
	// Changed is false when the server already ran To (nothing drained).
	Changed bool `json:"changed"`
	// PausedMS is how long the server did not admit new requests, from
	// the call to the switch (so far, when Pending).
	PausedMS float64 `json:"paused_ms"`
	// Aborted counts the requests in flight that the drain bound cut
	// (each ended with an abort).
	Aborted int `json:"aborted"`
	// Pending says the switch was not done within the drain bound and
	// IndexKSwitchMargin (202): it goes on, and GET /debug/v1/settings
	// shows index_k To once it is done (index_k_switch To until then).
	Pending bool `json:"pending"`
}
