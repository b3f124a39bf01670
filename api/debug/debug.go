// Package debug holds the wire types of pdserve's debug API (GET
// /debug/v1/...) and admin API (POST /admin/v1/...), as plain structs with
// snake_case JSON names. The server (internal/server) writes them and pdctl
// reads them; like the rest of api, the package depends on neither the
// engine nor the kernels.
//
// # Units and numbers
//
// Times are RFC 3339 with nanoseconds (encoding/json's time.Time). Every
// duration is a float number of milliseconds in a field whose name ends in
// _ms (age_ms, wait_ms, heartbeat_ms, ...); no field of this package is in
// seconds. (The Prometheus metrics at /metrics keep Prometheus's own
// convention, seconds in names ending in _seconds.)
//
// Identifiers travel as strings, counts as numbers. An identifier is a
// 64-bit number that names something and is never added up: a bootstrap room
// (random over the whole 64 bits) and a request id (the N of a "cmpl-N" or
// "chatcmpl-N" response id). Both have the type ID, which writes a JSON
// string of decimal digits, "room": "12345678901234567890", so that jq and
// JavaScript, whose numbers are float64, do not round the ids above 2^53;
// ID reads a string or a number, so older answers still decode. Digests are
// strings already (16 hex digits). Everything else that is a 64-bit integer
// is a count or a sequence number that starts at 0 and grows by one per
// event (steps, seqs, messages, bytes, tokens, requests): they stay JSON
// numbers, and stay below 2^53 for the life of any server.
package debug

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// ID is a 64-bit identifier: a bootstrap room or a request id. It travels
// in JSON as a string of decimal digits and is read from such a string or
// from a JSON number (an unsigned integer).
type ID uint64

// String writes the id in decimal.
func (id ID) String() string { return strconv.FormatUint(uint64(id), 10) }

// MarshalJSON writes the id as a JSON string of decimal digits.
func (id ID) MarshalJSON() ([]byte, error) {
	return strconv.AppendQuote(nil, id.String()), nil
}

// UnmarshalJSON reads a JSON string of decimal digits or a JSON number, an
// unsigned integer of at most 64 bits either way; null leaves the id as it
// is, as encoding/json does for a number.
func (id *ID) UnmarshalJSON(b []byte) error {
	text := string(b)
	if text == "null" {
		return nil
	}
	if len(b) > 0 && b[0] == '"' {
		if err := json.Unmarshal(b, &text); err != nil {
			return err
		}
	}
	v, err := ParseID(text)
	if err != nil {
		return err
	}
	*id = v
	return nil
}

// ParseID reads an id written in decimal.
func ParseID(s string) (ID, error) {
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("debug: %q is not an id (an unsigned 64-bit integer in decimal)", s)
	}
	return ID(v), nil
}

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

// The communicators of a server's TP group, as in Communicator.Name,
// Stall.Comm and the comm label of pdkit_collective_wait_seconds_total.
// Each has its own sequence numbers: a seq names a call only together with
// its communicator.
const (
	// CommControl carries the loop's own agreements: the step-input and
	// step-output broadcasts, the poll and free-page MINs, the prefix-match
	// MIN and the plan-digest MAX. An idle loop still runs them every
	// iteration.
	CommControl = "control"
	// CommForward carries the model's collectives inside a forward pass;
	// an idle iteration runs none.
	CommForward = "forward"
)

// Comms lists the communicator names in the order CollectivesResponse
// lists them.
var Comms = []string{CommControl, CommForward}

// StepsResponse is the body of GET /debug/v1/steps: every rank's last step
// record. Ranks in lock-step agree on step, digest, control_seq and
// forward_seq after each iteration, but a reader may catch them one step
// apart in the middle of one: Spread says by how much they differ instead
// of judging.
type StepsResponse struct {
	// Agree: every rank has the same step, digest, control_seq and
	// forward_seq.
	Agree bool `json:"agree"`
	// Spread is the largest step less the smallest.
	Spread uint64 `json:"spread"`
	Ranks  []Step `json:"ranks"`
	// Rates are rank 0's step times by phase and batch size (batches of
	// more than Tokens/2 and at most Tokens tokens): the recent average
	// (the last few dozen steps) against the baseline (the last few
	// thousand), so that a slow server can be told from a busy one.
	Rates []StepRate `json:"rates,omitempty"`
	// Process is the server process's CPU time and its cgroup's quota
	// throttling, as of the answer; nil where they cannot be read.
	Process *ProcessCPU `json:"process,omitempty"`
}

// StepRate is one phase and batch-size bucket of a server's step times.
type StepRate struct {
	Phase      string  `json:"phase"`
	Tokens     int     `json:"tokens"`
	Steps      uint64  `json:"steps"`
	RecentMS   float64 `json:"recent_ms"`
	BaselineMS float64 `json:"baseline_ms"`
	// Cycles and the cycle times are the wall time from one decoding
	// step's end to the next's, while a batch runs on: the step and what
	// held the loop between steps (a cgroup's CPU quota, other work on the
	// cores). Absent for a bucket with no cycle.
	Cycles          uint64  `json:"cycles,omitempty"`
	CycleRecentMS   float64 `json:"cycle_recent_ms,omitempty"`
	CycleBaselineMS float64 `json:"cycle_baseline_ms,omitempty"`
}

// ProcessCPU is a process's CPU time, and what its cgroup's quota held
// back (cgroup v1 or v2 cpu.stat; zero without a quota).
type ProcessCPU struct {
	Taken       time.Time `json:"taken"`
	CPUMS       float64   `json:"cpu_ms"`
	Periods     uint64    `json:"periods"`
	Throttled   uint64    `json:"throttled"`
	ThrottledMS float64   `json:"throttled_ms"`
	Cgroup      string    `json:"cgroup,omitempty"`
}

// Step is one rank's last finished loop iteration.
type Step struct {
	Rank int `json:"rank"`
	// Loop is the rank's event loop ("lockstep").
	Loop        string `json:"loop"`
	Step        uint64 `json:"step"`
	Phase       string `json:"phase"` // idle, prefill, decode or mixed
	BatchSize   int    `json:"batch_size"`
	BatchTokens int    `json:"batch_tokens"`
	Retracted   int    `json:"retracted"`
	Finished    int    `json:"finished"`
	// Digest is the plan's FNV-1a digest, 16 hex digits.
	Digest string `json:"digest"`
	// ControlSeq and ForwardSeq are the seqs of the rank's last call on
	// the control and the forward communicator when the iteration ended.
	ControlSeq uint64    `json:"control_seq"`
	ForwardSeq uint64    `json:"forward_seq"`
	Start      time.Time `json:"start"`
	End        time.Time `json:"end"`
	DurationMS float64   `json:"duration_ms"`
}

// Seq is the step's seq on the communicator named comm; 0 for a name
// that is neither.
func (s Step) Seq(comm string) uint64 {
	switch comm {
	case CommControl:
		return s.ControlSeq
	case CommForward:
		return s.ForwardSeq
	}
	return 0
}

// CollectivesResponse is the body of GET /debug/v1/collectives: each
// communicator of the TP group with its flight recorders and the calls that
// have waited too long.
type CollectivesResponse struct {
	// StallThresholdMS is the wait beyond which a call is listed in its
	// communicator's Stalls.
	StallThresholdMS float64 `json:"stall_threshold_ms"`
	// Comms are the communicators, in the order of Comms: control, then
	// forward.
	Comms []Communicator `json:"comms"`
	// LastFailure is the last rank group the engine gave up and rebuilt
	// (a collective past --collective-timeout, or a broken group): when,
	// why, its boot number and its communicators as they were, flight
	// recorders included. Absent when the engine never recovered.
	LastFailure *GroupFailure `json:"last_failure,omitempty"`
	// Restarts counts the rank group's rebuilds since the server started
	// (pdkit_engine_restarts_total).
	Restarts uint64 `json:"restarts"`
}

// GroupFailure is a rank group the engine recovered from.
type GroupFailure struct {
	At     time.Time      `json:"at"`
	Reason string         `json:"reason"`
	Boot   string         `json:"boot"` // the failed incarnation's boot number
	Comms  []Communicator `json:"comms"`
}

// Comm is the communicator named name; nil when the answer has none.
func (c *CollectivesResponse) Comm(name string) *Communicator {
	if c == nil {
		return nil
	}
	for i := range c.Comms {
		if c.Comms[i].Name == name {
			return &c.Comms[i]
		}
	}
	return nil
}

// Communicator is one communicator of the TP group: its own sequence
// numbers, flight recorders, wait totals and watchdog.
type Communicator struct {
	Name   string `json:"name"` // CommControl or CommForward
	Size   int    `json:"size"`
	Closed bool   `json:"closed"`
	Broken bool   `json:"broken"`
	// BrokenReason says why the communicator broke; empty while healthy.
	BrokenReason string           `json:"broken_reason,omitempty"`
	Stalls       []Stall          `json:"stalls"`
	Ranks        []CollectiveRank `json:"ranks"`
}

// Rank is rank's state on the communicator; nil when it has none.
func (c *Communicator) Rank(rank int) *CollectiveRank {
	if c == nil {
		return nil
	}
	for i := range c.Ranks {
		if c.Ranks[i].Rank == rank {
			return &c.Ranks[i]
		}
	}
	return nil
}

// CollectiveRank is one rank's collectives on one communicator.
type CollectiveRank struct {
	Rank          int    `json:"rank"`
	LastEntered   uint64 `json:"last_entered"`   // 0 before the first call
	LastCompleted uint64 `json:"last_completed"` // the last seq that ended ok
	// Waiting is the call the rank waits in on this communicator; null
	// when not in one of its collectives.
	Waiting *Collective `json:"waiting"`
	// WaitMS is the time the rank has spent inside this communicator's
	// collectives since the server started.
	WaitMS float64 `json:"wait_ms"`
	// Records is the flight recorder, oldest first.
	Records []Collective `json:"records"`
}

// Collective is one collective call of one rank.
type Collective struct {
	Seq uint64 `json:"seq"`
	Op  string `json:"op"`
	// Phase is the rank loop's phase the call ran for (input, poll, ...;
	// engine/rankcore's tables); empty for the forward pass's calls.
	Phase string    `json:"phase,omitempty"`
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
	Comm     string    `json:"comm"` // the communicator of Seq
	Seq      uint64    `json:"seq"`
	Op       string    `json:"op"`
	Since    time.Time `json:"since"` // when the first rank entered it
	WaitedMS float64   `json:"waited_ms"`
	Arrived  []int     `json:"arrived"` // ranks waiting in it
	Missing  []Peer    `json:"missing"` // the other ranks and where they are
}

// Peer is where a rank that has not arrived at a stalled call is, on the
// stall's communicator.
type Peer struct {
	Rank         int    `json:"rank"`
	InCollective bool   `json:"in_collective"` // waiting in another call of the communicator (seq, op)
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
	Pending      int  `json:"pending"`
	StepInFlight bool `json:"step_in_flight"`
	HeldPages    int  `json:"held_pages"` // pages the scheduler's requests hold
	TotalPages   int  `json:"total_pages"`
	// ForwardSteps and Finished count, since the engine started, the
	// steps that ran a forward pass and the requests that ended: two
	// answers with the same counts bound a stretch in which the engine
	// served nothing (Step counts idle iterations too).
	ForwardSteps uint64        `json:"forward_steps"`
	Finished     uint64        `json:"finished"`
	Requests     []RequestInfo `json:"requests"`
	KV           []KVPages     `json:"kv"` // per rank, read now
}

// RequestInfo is one request in the scheduler.
type RequestInfo struct {
	ID ID `json:"id"`
	// ClientRequestID is the client's X-Request-Id, when it sent one (the
	// router passes it on, or its own id).
	ClientRequestID string  `json:"client_request_id,omitempty"`
	Queue           string  `json:"queue"`
	AgeMS           float64 `json:"age_ms"`      // since arrival, as of the answer
	InStateMS       float64 `json:"in_state_ms"` // since entering the queue, as of the answer
	PromptTokens    int     `json:"prompt_tokens"`
	MaxTokens       int     `json:"max_tokens"`
	Generated       int     `json:"generated"`
	Fed             int     `json:"fed"`       // tokens whose KV is held
	InFlight        int     `json:"in_flight"` // tokens in the step in flight
	Cached          int     `json:"cached"`    // prompt tokens read from prefix-cache pages
	Pages           int     `json:"pages"`
	Retractions     int     `json:"retractions"`
}

// KVPages is one rank's KV pool.
type KVPages struct {
	Rank   int `json:"rank"`
	Used   int `json:"used"`   // by sequences or the prefix cache
	Cached int `json:"cached"` // held by the prefix cache
	Total  int `json:"total"`
}

// Held is the pages sequences hold, cached pages apart: what
// pdkit_kv_pages_used counts, and what pdctl shows as used.
func (k KVPages) Held() int { return k.Used - k.Cached }

// AbortResponse is the body of POST /admin/v1/requests/{id}/abort.
type AbortResponse struct {
	Aborted ID `json:"aborted"`
}

// AbortAllResponse is the body of POST /admin/v1/abort_all: the ids of the
// requests aborted.
type AbortAllResponse struct {
	Aborted []ID `json:"aborted"`
}
