// Package debug holds the wire types of pdserve's debug API (GET
// /debug/v1/...) and admin API (POST /admin/v1/...), as plain structs with
// snake_case JSON names. The server (internal/server) writes them and pdctl
// reads them; like the rest of api, the package depends on neither the
// engine nor the kernels.
//
// Times are RFC 3339 with nanoseconds (encoding/json's time.Time), durations
// are float milliseconds in fields ending in _ms, or seconds in fields
// ending in _seconds. Request ids are the engine's numeric ids: the N of a
// "cmpl-N" or "chatcmpl-N" response id.
package debug

import "time"

// Queue names of a request, as in RequestInfo.Queue and the queue filter of
// GET /debug/v1/requests.
const (
	QueueWaiting    = "waiting"    // queued, holds no KV (new or retracted)
	QueuePrefilling = "prefilling" // admitted, prompt not fully run
	QueueRunning    = "running"    // admitted, decoding
	QueueAborting   = "aborting"   // aborted while in the step in flight
)

// Queues lists the queue names in the order the requests are listed.
var Queues = []string{QueueWaiting, QueuePrefilling, QueueRunning, QueueAborting}

// StepsResponse is the body of GET /debug/v1/steps: every rank's last step
// record. Ranks in lock-step agree on step, digest and collective_seq after
// each iteration, but a reader may catch them one step apart in the middle
// of one: Spread says by how much they differ instead of judging.
type StepsResponse struct {
	// Agree: every rank has the same step, digest and collective_seq.
	Agree bool `json:"agree"`
	// Spread is the largest step less the smallest.
	Spread uint64 `json:"spread"`
	Ranks  []Step `json:"ranks"`
}

// Step is one rank's last finished loop iteration.
type Step struct {
	Rank        int    `json:"rank"`
	Step        uint64 `json:"step"`
	Phase       string `json:"phase"` // idle, prefill, decode or mixed
	BatchSize   int    `json:"batch_size"`
	BatchTokens int    `json:"batch_tokens"`
	Retracted   int    `json:"retracted"`
	Finished    int    `json:"finished"`
	// Digest is the plan's FNV-1a digest, 16 hex digits.
	Digest        string    `json:"digest"`
	CollectiveSeq uint64    `json:"collective_seq"`
	Start         time.Time `json:"start"`
	End           time.Time `json:"end"`
	DurationMS    float64   `json:"duration_ms"`
}

// CollectivesResponse is the body of GET /debug/v1/collectives: the TP
// group's flight recorders and the calls that have waited too long.
type CollectivesResponse struct {
	Size   int  `json:"size"`
	Closed bool `json:"closed"`
	Broken bool `json:"broken"`
	// BrokenReason says why the group broke; empty while healthy.
	BrokenReason string `json:"broken_reason,omitempty"`
	// StallThresholdMS is the wait beyond which a call is listed in Stalls.
	StallThresholdMS float64          `json:"stall_threshold_ms"`
	Stalls           []Stall          `json:"stalls"`
	Ranks            []CollectiveRank `json:"ranks"`
}

// CollectiveRank is one rank's collectives.
type CollectiveRank struct {
	Rank          int    `json:"rank"`
	LastEntered   uint64 `json:"last_entered"`   // 0 before the first call
	LastCompleted uint64 `json:"last_completed"` // the last seq that ended ok
	// Waiting is the call the rank waits in; null when not in a collective.
	Waiting *Collective `json:"waiting"`
	// WaitSeconds is the time the rank has spent inside collectives.
	WaitSeconds float64 `json:"wait_seconds"`
	// Records is the flight recorder, oldest first.
	Records []Collective `json:"records"`
}

// Collective is one collective call of one rank.
type Collective struct {
	Seq   uint64    `json:"seq"`
	Op    string    `json:"op"`
	Elem  string    `json:"elem"`
	Bytes int       `json:"bytes"`
	Start time.Time `json:"start"`
	// End is null while the call waits.
	End     *time.Time `json:"end"`
	Waiting bool       `json:"waiting"`
	// Outcome is "" while the call waits, "ok" on success, else the error.
	Outcome string `json:"outcome"`
	// DurationMS is end - start, or how long it has waited so far.
	DurationMS float64 `json:"duration_ms"`
}

// Stall is a collective call that has waited longer than the threshold.
type Stall struct {
	Seq      uint64    `json:"seq"`
	Op       string    `json:"op"`
	Since    time.Time `json:"since"` // when the first rank entered it
	WaitedMS float64   `json:"waited_ms"`
	Arrived  []int     `json:"arrived"` // ranks waiting in it
	Missing  []Peer    `json:"missing"` // the other ranks and where they are
}

// Peer is where a rank that has not arrived at a stalled call is.
type Peer struct {
	Rank         int    `json:"rank"`
	InCollective bool   `json:"in_collective"` // waiting in another call (seq, op)
	Seq          uint64 `json:"seq"`           // that call, or its last entered one; 0: none yet
	Op           string `json:"op"`
}

// RequestsResponse is the body of GET /debug/v1/requests: the requests of
// the engine's last published snapshot, queue by queue.
type RequestsResponse struct {
	Taken time.Time `json:"taken"` // when the snapshot was published
	Step  uint64    `json:"step"`
	// Queue is the filter asked for; empty: every queue.
	Queue string `json:"queue,omitempty"`
	// Counts has every queue's length, whatever the filter.
	Counts map[string]int `json:"counts"`
	// Pending counts requests submitted and not yet taken by the loop.
	Pending      int           `json:"pending"`
	StepInFlight bool          `json:"step_in_flight"`
	HeldPages    int           `json:"held_pages"` // pages the scheduler's requests hold
	TotalPages   int           `json:"total_pages"`
	Requests     []RequestInfo `json:"requests"`
	KV           []KVPages     `json:"kv"` // per rank, read now
}

// RequestInfo is one request in the scheduler.
type RequestInfo struct {
	ID           uint64  `json:"id"`
	Queue        string  `json:"queue"`
	AgeMS        float64 `json:"age_ms"`      // since arrival, as of the answer
	InStateMS    float64 `json:"in_state_ms"` // since entering the queue, as of the answer
	PromptTokens int     `json:"prompt_tokens"`
	MaxTokens    int     `json:"max_tokens"`
	Generated    int     `json:"generated"`
	Fed          int     `json:"fed"`       // tokens whose KV is held
	InFlight     int     `json:"in_flight"` // tokens in the step in flight
	Cached       int     `json:"cached"`    // prompt tokens read from prefix-cache pages
	Pages        int     `json:"pages"`
	Retractions  int     `json:"retractions"`
}

// KVPages is one rank's KV pool.
type KVPages struct {
	Rank   int `json:"rank"`
	Used   int `json:"used"`   // by sequences or the prefix cache
	Cached int `json:"cached"` // held by the prefix cache
	Total  int `json:"total"`
}

// AbortResponse is the body of POST /admin/v1/requests/{id}/abort.
type AbortResponse struct {
	Aborted uint64 `json:"aborted"`
}

// AbortAllResponse is the body of POST /admin/v1/abort_all: the ids of the
// requests aborted.
type AbortAllResponse struct {
	Aborted []uint64 `json:"aborted"`
}
