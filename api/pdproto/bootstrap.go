package pdproto

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// The bootstrap registry is an HTTP API on the prefill server's HTTP port,
// mounted under BootstrapPrefix:
//
//	PUT /bootstrap/v1/ranks/{rank}  body RegisterRequest, answer RegisterResponse
//	GET /bootstrap/v1/ranks         answer LookupResponse (200), or 503 until complete
//	GET /bootstrap/v1/health        answer BootstrapHealth
//
// Every failure is answered with a BootstrapErrorBody. docs/protocol.md
// describes the rules field by field.
const (
	BootstrapPrefix     = "/bootstrap/v1/"
	BootstrapRanksPath  = "/bootstrap/v1/ranks"
	BootstrapHealthPath = "/bootstrap/v1/health"
)

// Limits on what a registration may carry.
const (
	MaxTPSize         = 1024 // largest tp_size a registry accepts
	MaxRankInfoString = 256  // longest string field (endpoint, model, dtypes, instance_id)
)

// Error codes carried in BootstrapError.Code.
const (
	CodeInvalidRequest   = "invalid_request"    // 400: malformed JSON, wrong type, bad value
	CodeUnauthorized     = "unauthorized"       // 401: a registration not signed with the cluster secret
	CodeForbidden        = "forbidden"          // 403: registration over HTTP on a server with no cluster secret
	CodeNotFound         = "not_found"          // 404: no such route
	CodeMethodNotAllowed = "method_not_allowed" // 405
	CodeTooLarge         = "request_too_large"  // 413
	CodeConflict         = "conflict"           // 409: disagrees with registered ranks
	CodeNotReady         = "not_ready"          // 503: not every rank has registered
	CodeIncompatible     = "incompatible"       // decode side: CheckCompatible refused
)

// RankInfo is what one prefill rank registers and what a lookup returns for
// it. Rank, TPSize and the shape and dtype fields describe the rank's KV
// shard; Endpoint is its ZMQ control endpoint; InstanceID and StartedAt
// identify the process, so that a restarted rank is recognisable.
type RankInfo struct {
	Rank   int `json:"rank"`    // TP rank, 0 <= rank < tp_size
	TPSize int `json:"tp_size"` // ranks in the prefill TP group
	// Endpoint is the rank's ZMQ control endpoint, "tcp://host:port" (any
	// "scheme://address" ZMQ accepts).
	Endpoint string `json:"endpoint"`
	PageSize int    `json:"page_size"` // tokens per KV page
	KVDType  string `json:"kv_dtype"`  // "bf16", "f16", "f32", ...
	// IndexKDType is the sparse indexer's key dtype ("fp8" or "bf16"); empty
	// when the model has no indexer.
	IndexKDType string `json:"index_k_dtype"`
	// Model identifies the weights: a name, optionally with a fingerprint
	// ("name@sha256:..."). Compared byte for byte.
	Model   string `json:"model"`
	Layers  int    `json:"layers"`
	KVHeads int    `json:"kv_heads"` // KV heads of this rank (its shard)
	HeadDim int    `json:"head_dim"`
	// InstanceID is unique per process start (a random id); a registration
	// with a new id for a registered rank is a restart of that rank.
	InstanceID string    `json:"instance_id"`
	StartedAt  time.Time `json:"started_at"` // when the process started
}

// RegisterRequest is the body of PUT /bootstrap/v1/ranks/{rank}. Its rank
// must equal the rank in the path.
type RegisterRequest struct {
	RankInfo
}

// RegisterResponse answers a successful registration.
type RegisterResponse struct {
	Rank int `json:"rank"`
	// Replaced: the rank was registered by another (older) instance, whose
	// entry this registration replaced.
	Replaced bool `json:"replaced"`
	// Registered counts the ranks registered now, out of TPSize.
	Registered int  `json:"registered"`
	TPSize     int  `json:"tp_size"`
	Complete   bool `json:"complete"`
}

// LookupResponse is the body of a 200 answer to GET /bootstrap/v1/ranks:
// every rank, ordered by rank, Complete true.
type LookupResponse struct {
	TPSize   int        `json:"tp_size"`
	Complete bool       `json:"complete"`
	Ranks    []RankInfo `json:"ranks"`
}

// BootstrapHealth is the body of GET /bootstrap/v1/health. It is answered
// with 200 whenever the registry serves, complete or not.
type BootstrapHealth struct {
	Status     string `json:"status"` // "ok"
	Registered int    `json:"registered"`
	TPSize     int    `json:"tp_size"` // 0 while unknown
	Complete   bool   `json:"complete"`
}

// BootstrapErrorBody is the JSON body of every error answer:
// {"error":{"code":...,"message":...}}.
type BootstrapErrorBody struct {
	Error BootstrapError `json:"error"`
}

// BootstrapError is a registry failure. Status is the HTTP status (not in
// the JSON); Field names the request field at fault when there is one. A 503
// not_ready error also says how far registration has got.
type BootstrapError struct {
	Status int `json:"-"`
	// RetryAfter is the answer's Retry-After header, as a client read it
	// (not in the JSON); zero when absent.
	RetryAfter time.Duration `json:"-"`
	Code       string        `json:"code"`
	Message    string        `json:"message"`
	Field      string        `json:"field,omitempty"`
	// Not ready only: ranks registered, the expected tp_size (0 when not yet
	// known) and the ranks still missing.
	Registered int   `json:"registered,omitempty"`
	TPSize     int   `json:"tp_size,omitempty"`
	Missing    []int `json:"missing,omitempty"`
}

func (e *BootstrapError) Error() string {
	s := fmt.Sprintf("bootstrap: %d %s: %s", e.Status, e.Code, e.Message)
	if e.Field != "" {
		s += " (field " + e.Field + ")"
	}
	return s
}

// Validate checks one registration on its own: every required field is set
// and in range (rank < tp_size, positive sizes, an endpoint of the form
// scheme://address, bounded strings, a start time). It returns a
// *BootstrapError with status 400 naming the first bad field.
func (r RankInfo) Validate() error {
	bad := func(field, format string, args ...any) error {
		return &BootstrapError{Status: 400, Code: CodeInvalidRequest, Field: field, Message: fmt.Sprintf(format, args...)}
	}
	switch {
	case r.TPSize < 1 || r.TPSize > MaxTPSize:
		return bad("tp_size", "tp_size must be in 1..%d, got %d", MaxTPSize, r.TPSize)
	case r.Rank < 0 || r.Rank >= r.TPSize:
		return bad("rank", "rank %d out of range for tp_size %d", r.Rank, r.TPSize)
	case r.PageSize < 1:
		return bad("page_size", "page_size must be positive, got %d", r.PageSize)
	case r.Layers < 1:
		return bad("layers", "layers must be positive, got %d", r.Layers)
	case r.KVHeads < 1:
		return bad("kv_heads", "kv_heads must be positive, got %d", r.KVHeads)
	case r.HeadDim < 1:
		return bad("head_dim", "head_dim must be positive, got %d", r.HeadDim)
	case r.StartedAt.IsZero():
		return bad("started_at", "started_at is required")
	}
	for _, f := range []struct {
		name, v  string
		optional bool
	}{
		{"endpoint", r.Endpoint, false},
		{"kv_dtype", r.KVDType, false},
		{"index_k_dtype", r.IndexKDType, true},
		{"model", r.Model, false},
		{"instance_id", r.InstanceID, false},
	} {
		if f.v == "" && !f.optional {
			return bad(f.name, "%s is required", f.name)
		}
		if len(f.v) > MaxRankInfoString {
			return bad(f.name, "%s is longer than %d bytes", f.name, MaxRankInfoString)
		}
	}
	if scheme, addr, ok := strings.Cut(r.Endpoint, "://"); !ok || scheme == "" || addr == "" {
		return bad("endpoint", "endpoint %q is not a ZMQ endpoint (scheme://address)", r.Endpoint)
	}
	return nil
}

// Same reports whether r and o carry the same information (StartedAt
// compared as instants).
func (r RankInfo) Same(o RankInfo) bool {
	if !r.StartedAt.Equal(o.StartedAt) {
		return false
	}
	r.StartedAt, o.StartedAt = time.Time{}, time.Time{}
	return r == o
}

// DecodeInfo is what a decode server checks a prefill group against: its
// own TP size and the layout of its KV pool (per rank). Servers publish
// theirs (debug.Settings.Handshake), so that a tool can compare a pair
// before any request fails on it.
type DecodeInfo struct {
	TPSize      int    `json:"tp_size"`
	PageSize    int    `json:"page_size"`
	KVDType     string `json:"kv_dtype"`
	IndexKDType string `json:"index_k_dtype,omitempty"` // empty when the model has no indexer
	Model       string `json:"model"`
	Layers      int    `json:"layers"`
	KVHeads     int    `json:"kv_heads"` // KV heads of one decode rank
	HeadDim     int    `json:"head_dim"`
}

// RankInfo is d as a rank of a prefill group with d's layout, for
// FirstDifference and Differences.
func (d DecodeInfo) RankInfo() RankInfo {
	return RankInfo{TPSize: d.TPSize, PageSize: d.PageSize, KVDType: d.KVDType, IndexKDType: d.IndexKDType,
		Model: d.Model, Layers: d.Layers, KVHeads: d.KVHeads, HeadDim: d.HeadDim}
}

// ErrIncompatible is matched (errors.Is) by every *IncompatibleError.
var ErrIncompatible = errors.New("prefill and decode are incompatible")

// IncompatibleError says why a decode server refuses a prefill group:
// Field is the first field that does not match ("tp_size", "page_size",
// "kv_dtype", "index_k_dtype", "model", "layers", "kv_heads", "head_dim"),
// or "ranks" when the group itself is malformed. Rank is the prefill rank
// at fault, -1 when it concerns the group.
type IncompatibleError struct {
	Rank    int
	Field   string
	Prefill string // the prefill's value
	Decode  string // the decode's value
	Reason  string // why this is refused
}

func (e *IncompatibleError) Error() string {
	who := "prefill"
	if e.Rank >= 0 {
		who = fmt.Sprintf("prefill rank %d", e.Rank)
	}
	if e.Field == "ranks" {
		return fmt.Sprintf("pd handshake refused: bad prefill ranks: %s", e.Reason)
	}
	return fmt.Sprintf("pd handshake refused: %s has %s %s, decode has %s: %s",
		who, e.Field, e.Prefill, e.Decode, e.Reason)
}

func (e *IncompatibleError) Is(target error) bool { return target == ErrIncompatible }

// CheckCompatible decides whether a decode server with the local layout can
// take KV from the prefill group remote (a lookup's ranks). It returns nil,
// or an *IncompatibleError naming the first mismatch, checked in this
// order: the group itself (ranks 0..tp_size-1, each once), tp_size, then
// per rank page_size, kv_dtype, index_k_dtype, model, layers, kv_heads and
// head_dim.
//
// Different TP sizes on the two sides are refused: each rank sends its own
// shard to the decode rank of the same number, so pdkit does not support
// them yet.
func CheckCompatible(local DecodeInfo, remote []RankInfo) error {
	group := func(format string, args ...any) error {
		return &IncompatibleError{Rank: -1, Field: "ranks", Reason: fmt.Sprintf(format, args...)}
	}
	if len(remote) == 0 {
		return group("no prefill ranks")
	}
	n := remote[0].TPSize
	if n != len(remote) {
		return group("tp_size is %d but %d ranks were listed", n, len(remote))
	}
	seen := make([]bool, n)
	for _, r := range remote {
		if r.TPSize != n {
			return group("ranks disagree on tp_size (%d and %d)", n, r.TPSize)
		}
		if r.Rank < 0 || r.Rank >= n || seen[r.Rank] {
			return group("rank %d is out of range or listed twice", r.Rank)
		}
		seen[r.Rank] = true
	}
	if n != local.TPSize {
		return &IncompatibleError{Rank: -1, Field: "tp_size",
			Prefill: fmt.Sprint(n), Decode: fmt.Sprint(local.TPSize),
			Reason: "different TP sizes on prefill and decode are not supported yet"}
	}
	mine := local.RankInfo()
	for _, r := range remote {
		if field, pv, dv := FirstDifference(r, mine); field != "" {
			return &IncompatibleError{Rank: r.Rank, Field: field,
				Prefill: compatValue(pv), Decode: compatValue(dv),
				Reason: field + " must match"}
		}
	}
	return nil
}

// FirstDifference names the first setting that every rank of a PD pair
// must share (tp_size, page_size, kv_dtype, index_k_dtype, model, layers,
// kv_heads, head_dim) in which a and b differ, with both values; "" when
// they agree. The registry checks a prefill group with it, the handshake a
// decode server against that group.
func FirstDifference(a, b RankInfo) (field string, av, bv any) {
	if d := Differences(a, b); len(d) > 0 {
		return d[0].Field, d[0].A, d[0].B
	}
	return "", nil, nil
}

// Difference is one setting a PD pair must share in which two ranks
// differ.
type Difference struct {
	Field string
	A, B  any
}

// Differences lists every setting a PD pair must share in which a and b
// differ, in FirstDifference's order: what a handshake between them would
// refuse, so that a tool comparing two servers checks exactly what the
// handshake does.
func Differences(a, b RankInfo) []Difference {
	var out []Difference
	for _, c := range []Difference{
		{"tp_size", a.TPSize, b.TPSize},
		{"page_size", a.PageSize, b.PageSize},
		{"kv_dtype", a.KVDType, b.KVDType},
		{"index_k_dtype", a.IndexKDType, b.IndexKDType},
		{"model", a.Model, b.Model},
		{"layers", a.Layers, b.Layers},
		{"kv_heads", a.KVHeads, b.KVHeads},
		{"head_dim", a.HeadDim, b.HeadDim},
	} {
		if c.A != c.B {
			out = append(out, c)
		}
	}
	return out
}

// compatValue formats a compared value; strings are quoted so that an empty one
// is visible.
func compatValue(v any) string {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprint(v)
}
