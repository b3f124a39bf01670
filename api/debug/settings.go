package debug

import (
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// SettingsPath is a server's effective settings (GET, JSON Settings).
const SettingsPath = "/debug/v1/settings"

// StatePath is a server's configuration, last step and engine snapshot in
// one answer (GET, JSON StateResponse).
const StatePath = "/debug/v1/state"

// Settings is the body of GET /debug/v1/settings: what a server runs with,
// after every default is applied, as the engine itself uses it (not as its
// flags were typed), and the fault switches on at the moment of the answer.
// It is the one place a tool reads a server's timeouts from: pdctl diagnose
// judges each server's queues by the timeouts that server publishes here.
type Settings struct {
	Role string `json:"role"` // colocated, prefill or decode
	// Name labels the engine's goroutines (pprof label server).
	Name   string `json:"name"`
	TPSize int    `json:"tp_size"`

	// KV pool and batching, per rank.
	PageSize int `json:"page_size"` // tokens per KV page
	KVTokens int `json:"kv_tokens"` // KV capacity per rank in tokens
	// KVMemoryBytes is the memory budget the pools were sized from
	// (--kv-memory, every rank together); 0 when sized in tokens.
	KVMemoryBytes  int64 `json:"kv_memory_bytes"`
	KVPages        int   `json:"kv_pages"` // pages of each rank's pool
	MaxRunning     int   `json:"max_running"`
	MaxBatchTokens int   `json:"max_batch_tokens"` // tokens per step, prefill and decode together
	PrefillChunk   int   `json:"prefill_chunk"`    // prompt tokens per request per step
	PrefixCache    bool  `json:"prefix_cache"`     // the radix prefix cache is on
	// Schedule is the rank loop: lockstep or overlap.
	Schedule string `json:"schedule"`
	// KVDType is the element type the pools store K and V in (f32, bf16
	// or f16; --kv-dtype): fixed for the server's life, and the same on a
	// prefill and its decodes.
	KVDType string `json:"kv_dtype"`

	// IndexK is the storage precision of the sparse indexer's keys (fp8 or
	// bf16) now (it is switched live); it matters only when Indexer says
	// the model has an indexer.
	IndexK  string `json:"index_k"`
	Indexer bool   `json:"indexer"`
	// IndexKSwitch is the precision a live switch under way goes to (POST
	// /admin/v1/indexk/...: the server drains, then switches); empty when
	// none is.
	IndexKSwitch string `json:"index_k_switch,omitempty"`
	// Handshake is what a PD handshake compares between a prefill and a
	// decode (pdproto.Differences: TP size, page size, KV and index-K
	// element types, the model and its KV shape), with the precision in
	// use now; PDProtocol is the PD wire protocol's version. pdctl
	// diagnose compares every pair by them before any request fails.
	Handshake  *pdproto.DecodeInfo `json:"handshake,omitempty"`
	PDProtocol int                 `json:"pd_protocol,omitempty"`
	// ModelFile is the model's file as the server last checked it; nil
	// for a model not opened from a file.
	ModelFile *ModelFile `json:"model_file,omitempty"`
	// Canaries are a colocated server's own correctness probes
	// (--canary-interval); nil when none has run.
	Canaries *Canaries `json:"canaries,omitempty"`

	// HeartbeatMS is the loop heartbeat: how long a loop waits for work
	// before it iterates anyway, so an idle server still finishes a step
	// that often and idle ranks wait in a collective up to that long.
	HeartbeatMS float64 `json:"heartbeat_ms"`
	// CollectiveWatchdogMS is the wait beyond which the rank group's
	// watchdog reports a collective; 0: the watchdog is off.
	CollectiveWatchdogMS float64 `json:"collective_watchdog_ms"`
	// CollectiveTimeoutMS is the wait beyond which the server gives the
	// rank group up and rebuilds it (--collective-timeout); 0: off.
	CollectiveTimeoutMS float64 `json:"collective_timeout_ms"`
	// FlightRecorderLen is the collectives each rank's flight recorder keeps.
	FlightRecorderLen int `json:"flight_recorder_len"`
	// DecisionLogLen is the iterations each rank's decision log keeps
	// (GET /debug/v1/decisions).
	DecisionLogLen int `json:"decision_log_len"`
	// CloseTimeoutMS is how long a shutdown waits for the loops to stop.
	CloseTimeoutMS float64 `json:"close_timeout_ms"`

	// The scheduler's timeouts; 0: no limit.
	WaitingTimeoutMS float64 `json:"waiting_timeout_ms"` // waiting for admission
	PrefillTimeoutMS float64 `json:"prefill_timeout_ms"` // prefilling a prompt
	RequestTimeoutMS float64 `json:"request_timeout_ms"` // a request in all

	// The HTTP server's own: /health answers 503 once the loop has not
	// iterated for StallAfterMS, and says "busy" (still 200) while a
	// request has waited MaxQueueAgeMS for admission (0: never). Zero when
	// the engine answers without a server.
	StallAfterMS  float64 `json:"stall_after_ms"`
	MaxQueueAgeMS float64 `json:"max_queue_age_ms"`

	// PD is the prefill and decode roles' configuration; null on a
	// colocated server.
	PD *PDSettings `json:"pd"`

	// HiCache is the host tier's configuration; null without a prefix
	// cache (the tier is the prefix cache's).
	HiCache *HiCacheSettings `json:"hicache"`

	// FaultsOn names the fault switches on now, in the order of GET
	// /debug/v1/faults; empty when none is.
	FaultsOn []string `json:"faults_on"`
}

// PDSettings are a PD server's timeouts and limits. Every PD queue entry
// fails once it has been in its queue longer than its queue's timeout:
// bootstrap and prealloc BootstrapTimeoutMS, transfer TransferTimeoutMS,
// inflight InflightTimeoutMS; an aborting entry's pages are freed after
// AbortAckTimeoutMS.
type PDSettings struct {
	// Host is the address the ranks' ZeroMQ sockets bind and advertise.
	Host                string  `json:"host"`
	BootstrapTimeoutMS  float64 `json:"bootstrap_timeout_ms"`
	TransferTimeoutMS   float64 `json:"transfer_timeout_ms"`
	InflightTimeoutMS   float64 `json:"inflight_timeout_ms"`
	AbortAckTimeoutMS   float64 `json:"abort_ack_timeout_ms"`
	SendTimeoutMS       float64 `json:"send_timeout_ms"`
	HeartbeatIntervalMS float64 `json:"heartbeat_interval_ms"` // a decode rank's probes of its prefill peers
	HeartbeatTimeoutMS  float64 `json:"heartbeat_timeout_ms"`  // unanswered that long, the peer's rooms fail
	// ReservedDecodeTokens is the decode's room for growth: output tokens
	// per request held that new transfers may not take; negative: none.
	ReservedDecodeTokens int `json:"reserved_decode_tokens"`
	// The PD plane's limits (docs/protocol.md, "Limits"): the largest
	// frame a rank's socket accepts as set (0: derived from the model's
	// shapes), the peer sockets a rank keeps open and how long an unused
	// one stays, the reply queue, the rooms one sender may hold in a
	// prefill's mailbox before their requests arrive, how long a
	// connection may take to authenticate, and how many connections a
	// rank's socket holds at once.
	MaxMessageBytes     int64   `json:"max_message_bytes"`
	MaxPeerSockets      int     `json:"max_peer_sockets"`
	PeerSocketIdleMS    float64 `json:"peer_socket_idle_ms"`
	ReplyQueue          int     `json:"reply_queue"`
	EarlyRoomsPerSender int     `json:"early_rooms_per_sender"`
	HandshakeTimeoutMS  float64 `json:"handshake_timeout_ms"`
	MaxConnections      int     `json:"max_connections"`
	// A decode's prefill registries (--prefill-bootstrap, comma-separated),
	// the only bootstrap URLs it takes, and how many lookups of them it
	// keeps.
	PrefillBootstrap   string `json:"prefill_bootstrap"`
	BootstrapCacheSize int    `json:"bootstrap_cache_size"`
	// AdvertiseHost is the host the ranks' endpoints are handed out at;
	// Authenticated says the PD plane runs with a cluster secret (the
	// secret itself is never published).
	AdvertiseHost string `json:"advertise_host"`
	Authenticated bool   `json:"authenticated"`
}

// Duration converts a float milliseconds field to a time.Duration.
func Duration(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

// StateResponse is the body of GET /debug/v1/state: the server's model,
// settings, rank 0's last step and the engine's last published snapshot.
type StateResponse struct {
	Model string `json:"model"`
	// ContextTokens is the model's context length: a request's prompt and
	// its max_tokens together may not exceed it.
	ContextTokens int `json:"context_tokens"`
	// ChatTemplate is the chat template the server renders chat requests
	// with: "jinja" for the model's own (its GGUF's
	// tokenizer.chat_template), else the name of the family it fell back
	// to ("chatml", "llama3", ..., "default").
	ChatTemplate string   `json:"chat_template"`
	Settings     Settings `json:"settings"`
	LastStep     Step     `json:"last_step"`
	// Snapshot is null until the loop has published one.
	Snapshot *EngineSnapshot `json:"snapshot"`
}

// EngineSnapshot is the engine's state as its loop last published it.
type EngineSnapshot struct {
	Taken time.Time `json:"taken"`
	Step  Step      `json:"step"`
	// Counts has every scheduler queue's length; Requests lists them with
	// their ages as of the answer (as GET /debug/v1/requests does).
	Counts       map[string]int `json:"counts"`
	StepInFlight bool           `json:"step_in_flight"`
	HeldPages    int            `json:"held_pages"`
	TotalPages   int            `json:"total_pages"`
	Requests     []RequestInfo  `json:"requests"`
	Totals       Totals         `json:"totals"`
	// Error is the failure that stopped the engine; empty while it runs.
	Error string `json:"error,omitempty"`
}

// Totals count since the engine started.
type Totals struct {
	Steps        uint64 `json:"steps"`          // forward steps run
	Tokens       uint64 `json:"tokens"`         // tokens run through the model
	Sampled      uint64 `json:"sampled"`        // tokens sampled
	Retractions  uint64 `json:"retractions"`    // requests retracted to free KV
	Aborts       uint64 `json:"aborts"`         // requests finished by an abort
	AbortsInStep uint64 `json:"aborts_in_step"` // of those, aborted while in the step in flight
	Finished     uint64 `json:"finished"`       // requests finished, by any reason
	// The prefix cache: prompt tokens of admitted requests, and of those
	// the ones read from cached pages instead of computed.
	PromptTokens    uint64 `json:"prompt_tokens"`
	CachedTokens    uint64 `json:"cached_tokens"`
	PrefixHits      uint64 `json:"prefix_hits"`      // requests that matched a cached page
	PrefixEvictions uint64 `json:"prefix_evictions"` // cached pages evicted (rank 0)
	// Unstalls counts waiting requests that gave up their cached prefix
	// (to compute it instead) because nothing ran and the queue's head did
	// not fit otherwise.
	Unstalls uint64 `json:"unstalls"`
	// IndexKSwitches counts the live index-K precision switches done.
	IndexKSwitches uint64 `json:"index_k_switches"`
}

// ModelFile is a server's model file: the fingerprint of the weights taken
// at load (a hash of the file's head and of blocks sampled over its data)
// and whether the file still is what was loaded (the same file, size and
// modification time, the same sampled hash), as last checked (at most
// every 5 s, when the settings are read).
type ModelFile struct {
	Path        string `json:"path"`
	Fingerprint string `json:"fingerprint"`
	// SHA256 is the whole file's hash, taken at load (files up to 1 GiB)
	// or by the first full rehash (POST /admin/v1/model/verify); empty
	// before either. Servers of one cluster should publish the same one.
	SHA256  string     `json:"sha256,omitempty"`
	Changed bool       `json:"changed"`
	Why     string     `json:"why,omitempty"`
	Checked *time.Time `json:"checked,omitempty"`
	// Verified is the last full rehash's time; absent before the first.
	Verified *time.Time `json:"verified,omitempty"`
}

// ModelVerifyPath is the admin call that rehashes the whole model file.
const ModelVerifyPath = "/admin/v1/model/verify"

// ModelVerifyResponse is the body of POST /admin/v1/model/verify: the
// file's full hash now against the baseline (taken at load, or by the
// first verify, which sets it: First, and then Matches is false, for
// nothing was compared).
type ModelVerifyResponse struct {
	Path     string  `json:"path"`
	SHA256   string  `json:"sha256"`
	Baseline string  `json:"baseline"`
	First    bool    `json:"first,omitempty"`
	Matches  bool    `json:"matches"`
	TookMS   float64 `json:"took_ms"`
}
