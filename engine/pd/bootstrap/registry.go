// Package bootstrap is the PD bootstrap registry: the HTTP service on the
// prefill server where each prefill rank registers its ZMQ control endpoint
// and KV layout, and where decode servers look the prefill group up before
// their first transfer. The wire types and the compatibility check are in
// api/pdproto; this package holds the server side (Registry) and the client
// both sides use (Client).
//
// Registry rules, in the order they are checked on PUT
// /bootstrap/v1/ranks/{rank}:
//
//   - Only a member of the cluster may register over HTTP: the request must
//     be signed with the cluster secret (clusterauth.Secret.SignRequest),
//     else 401 (counted: Stats); a registry without a secret refuses every
//     registration over HTTP with 403. (The prefill server registers its
//     own ranks in process, through Register.)
//   - The body must be one JSON object with fields of the right types, the
//     rank in the body must equal the rank in the path, and the fields must
//     pass pdproto.RankInfo.Validate (rank < tp_size and so on): else 400.
//   - tp_size must equal the registry's configured TP size when it has one,
//     and tp_size, page_size, kv_dtype, index_k_dtype, model, layers,
//     kv_heads and head_dim must equal those of every other registered rank:
//     else 409 naming the field. The rank being replaced is not compared
//     with, so a group whose every rank restarted with a new layout is
//     accepted rank by rank.
//   - Same rank, same instance_id: identical information is an idempotent
//     retry (200, nothing changes); different information is refused with
//     409 (an instance cannot change what it registered; restart it).
//   - started_at more than clusterauth.MaxSkew ahead of the registry's
//     clock: 409. A far-future start would otherwise keep the rank from
//     its real restarts for good (they are "older").
//   - Same rank, different instance_id: a restart. The registration replaces
//     the entry unless its started_at is earlier than the registered
//     instance's, which is refused with 409: an older process still alive
//     (or a delayed retry of its registration) never takes a rank back from
//     the newer one. Two live processes claiming the same rank therefore
//     settle on the later one.
//
// A lookup (GET /bootstrap/v1/ranks) answers 503 with a Retry-After header
// and a not_ready error listing the missing ranks until tp_size ranks are
// registered, then 200 with all of them ordered by rank. There is no
// deregistration: a rank that dies stays listed until its restart replaces
// it, and decode notices the death through its heartbeats.
package bootstrap

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/pdproto"
)

// MaxBodyBytes bounds a registration body.
const MaxBodyBytes = 64 << 10

// DefaultRetryAfter is the Retry-After of a 503 lookup when Options leave it
// unset.
const DefaultRetryAfter = time.Second

// Options configure a Registry.
type Options struct {
	// TPSize is the prefill server's TP size. When positive, registrations
	// with another tp_size are refused and lookups know how many ranks to
	// wait for before the first registration; when 0, the first registered
	// rank's tp_size is used.
	TPSize int
	// RetryAfter is sent in the Retry-After header of a 503 lookup, rounded
	// up to whole seconds (at least 1). Zero means DefaultRetryAfter.
	RetryAfter time.Duration
	// Secret verifies registrations over HTTP; nil refuses them all.
	Secret *clusterauth.Secret
	// Now is the registry's clock; nil means time.Now.
	Now func() time.Time
}

// Stats count what the registry refused.
type Stats struct {
	Unauthenticated uint64 // registrations over HTTP without a valid signature, or with no secret to check one
	FutureStart     uint64 // registrations whose started_at is ahead of the registry's clock
}

// Registry is the bootstrap registry, an http.Handler for the routes under
// pdproto.BootstrapPrefix. It is safe for concurrent use and starts no
// goroutines.
type Registry struct {
	opts Options

	mu    sync.Mutex
	ranks map[int]pdproto.RankInfo

	unauthenticated, futureStart atomic.Uint64
	verifier                     *clusterauth.Verifier // registrations over HTTP
}

// RegistryTarget is the target a registration over HTTP is signed for
// (clusterauth.SignRequest): a registry, which a rank finds by the URL it
// was given rather than by a server id.
const RegistryTarget = "bootstrap registry"

// NewRegistry returns an empty registry.
func NewRegistry(opts Options) *Registry {
	if opts.RetryAfter <= 0 {
		opts.RetryAfter = DefaultRetryAfter
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Registry{opts: opts, ranks: map[int]pdproto.RankInfo{},
		verifier: &clusterauth.Verifier{Secret: opts.Secret, Self: RegistryTarget}}
}

// Stats returns the registry's refusal counts.
func (g *Registry) Stats() Stats {
	return Stats{Unauthenticated: g.unauthenticated.Load(), FutureStart: g.futureStart.Load()}
}

// ServeHTTP serves PUT /bootstrap/v1/ranks/{rank}, GET /bootstrap/v1/ranks
// and GET /bootstrap/v1/health; anything else is answered with a JSON 404
// or 405.
func (g *Registry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := strings.TrimSuffix(r.URL.Path, "/")
	switch {
	case p == pdproto.BootstrapRanksPath:
		if !allow(w, r, http.MethodGet) {
			return
		}
		g.serveLookup(w)
	case p == pdproto.BootstrapHealthPath:
		if !allow(w, r, http.MethodGet) {
			return
		}
		writeJSON(w, http.StatusOK, g.Health())
	case strings.HasPrefix(p, pdproto.BootstrapRanksPath+"/"):
		if !allow(w, r, http.MethodPut) {
			return
		}
		g.serveRegister(w, r, strings.TrimPrefix(p, pdproto.BootstrapRanksPath+"/"))
	default:
		writeError(w, &pdproto.BootstrapError{Status: http.StatusNotFound, Code: pdproto.CodeNotFound,
			Message: fmt.Sprintf("no route %s", r.URL.Path)})
	}
}

// allow answers 405 unless r uses method (GET also admits HEAD).
func allow(w http.ResponseWriter, r *http.Request, method string) bool {
	if r.Method == method || (method == http.MethodGet && r.Method == http.MethodHead) {
		return true
	}
	if method == http.MethodGet {
		w.Header().Set("Allow", "GET, HEAD")
	} else {
		w.Header().Set("Allow", method)
	}
	writeError(w, &pdproto.BootstrapError{Status: http.StatusMethodNotAllowed, Code: pdproto.CodeMethodNotAllowed,
		Message: fmt.Sprintf("%s %s: use %s", r.Method, r.URL.Path, method)})
	return false
}

func (g *Registry) serveRegister(w http.ResponseWriter, r *http.Request, rankText string) {
	bad := func(field, format string, args ...any) {
		writeError(w, &pdproto.BootstrapError{Status: http.StatusBadRequest, Code: pdproto.CodeInvalidRequest,
			Field: field, Message: fmt.Sprintf(format, args...)})
	}
	rank, err := strconv.Atoi(rankText)
	if err != nil || rank < 0 || rank >= pdproto.MaxTPSize || strconv.Itoa(rank) != rankText {
		bad("rank", "rank %q in the path is not a rank (0..%d)", rankText, pdproto.MaxTPSize-1)
		return
	}
	data, e := readBody(w, r)
	if e != nil {
		writeError(w, e)
		return
	}
	if e := g.authenticate(r, data); e != nil {
		g.unauthenticated.Add(1)
		writeError(w, e)
		return
	}
	// A RegisterRequest is a RankInfo's fields; decoding into the RankInfo
	// itself makes type errors name the JSON field alone.
	var req pdproto.RegisterRequest
	if e := decodeJSON(data, &req.RankInfo); e != nil {
		writeError(w, e)
		return
	}
	if req.Rank != rank {
		bad("rank", "rank %d in the body differs from rank %d in the path", req.Rank, rank)
		return
	}
	resp, e := g.Register(req.RankInfo)
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

// authenticate checks that a registration over HTTP comes from a member of
// the cluster.
func (g *Registry) authenticate(r *http.Request, body []byte) *pdproto.BootstrapError {
	if !g.opts.Secret.Set() {
		return &pdproto.BootstrapError{Status: http.StatusForbidden, Code: pdproto.CodeForbidden,
			Message: "this prefill server has no cluster secret, so it takes no registration over HTTP"}
	}
	if err := g.verifier.Verify(r, body, g.opts.Now()); err != nil {
		return &pdproto.BootstrapError{Status: http.StatusUnauthorized, Code: pdproto.CodeUnauthorized,
			Message: "registration refused: " + err.Error()}
	}
	return nil
}

// readBody reads a body of at most MaxBodyBytes.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, *pdproto.BootstrapError) {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return nil, &pdproto.BootstrapError{Status: http.StatusRequestEntityTooLarge, Code: pdproto.CodeTooLarge,
			Message: fmt.Sprintf("body larger than %d bytes", MaxBodyBytes)}
	case err != nil:
		return nil, &pdproto.BootstrapError{Status: http.StatusBadRequest, Code: pdproto.CodeInvalidRequest,
			Message: "reading the body: " + err.Error()}
	}
	return data, nil
}

// decodeJSON decodes exactly one JSON object from data into v. Unknown
// fields are ignored (a newer rank may send more); a wrong type is a 400
// naming the field.
func decodeJSON(data []byte, v any) *pdproto.BootstrapError {
	bad := func(field, msg string) *pdproto.BootstrapError {
		return &pdproto.BootstrapError{Status: http.StatusBadRequest, Code: pdproto.CodeInvalidRequest, Field: field, Message: msg}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	err := dec.Decode(v)
	if err == nil {
		if _, err2 := dec.Token(); err2 != io.EOF {
			return bad("", "the body must hold exactly one JSON object")
		}
		return nil
	}
	var (
		typ *json.UnmarshalTypeError
		syn *json.SyntaxError
	)
	switch {
	case errors.As(err, &typ):
		return bad(typ.Field, fmt.Sprintf("field %s: JSON %s where %s was expected", typ.Field, typ.Value, typ.Type))
	case errors.As(err, &syn), errors.Is(err, io.ErrUnexpectedEOF):
		return bad("", "malformed JSON: "+err.Error())
	case errors.Is(err, io.EOF):
		return bad("", "empty body: a JSON object is required")
	}
	// Other decode errors: a time that does not parse, a body that is not an object...
	return bad("", "bad JSON: "+err.Error())
}

// Register applies one registration under the rules of the package
// comment, as a PUT does. Errors are *pdproto.BootstrapError with status
// 400 or 409.
func (g *Registry) Register(info pdproto.RankInfo) (*pdproto.RegisterResponse, *pdproto.BootstrapError) {
	if err := info.Validate(); err != nil {
		var be *pdproto.BootstrapError
		if errors.As(err, &be) {
			return nil, be
		}
		return nil, &pdproto.BootstrapError{Status: http.StatusBadRequest, Code: pdproto.CodeInvalidRequest, Message: err.Error()}
	}
	conflict := func(field, format string, args ...any) *pdproto.BootstrapError {
		return &pdproto.BootstrapError{Status: http.StatusConflict, Code: pdproto.CodeConflict, Field: field,
			Message: fmt.Sprintf(format, args...)}
	}
	if ahead := info.StartedAt.Sub(g.opts.Now()); ahead > clusterauth.MaxSkew {
		g.futureStart.Add(1)
		return nil, conflict("started_at", "rank %d registers started_at %s, %v ahead of this server's clock: "+
			"a start in the future would keep the rank from its real restarts", info.Rank,
			info.StartedAt.Format(time.RFC3339Nano), ahead.Round(time.Second))
	}
	if g.opts.TPSize > 0 && info.TPSize != g.opts.TPSize {
		return nil, conflict("tp_size", "rank %d registers tp_size %d but this prefill server runs tp_size %d",
			info.Rank, info.TPSize, g.opts.TPSize)
	}

	g.mu.Lock()
	defer g.mu.Unlock()
	replaced := false
	if old, ok := g.ranks[info.Rank]; ok {
		switch {
		case old.InstanceID == info.InstanceID && old.Same(info):
			return g.responseLocked(info.Rank, false), nil
		case old.InstanceID == info.InstanceID:
			return nil, conflict("instance_id", "rank %d is registered by instance %q with different information; "+
				"an instance cannot change its registration, a restart needs a new instance_id", info.Rank, info.InstanceID)
		case info.StartedAt.Before(old.StartedAt):
			return nil, conflict("started_at", "rank %d is registered by instance %q started at %s, later than "+
				"instance %q (started %s): an older instance cannot replace a newer one",
				info.Rank, old.InstanceID, old.StartedAt.Format(time.RFC3339Nano), info.InstanceID, info.StartedAt.Format(time.RFC3339Nano))
		}
		replaced = true
	}
	for _, other := range g.sortedLocked() {
		if other.Rank == info.Rank {
			continue
		}
		if field, m, t := pdproto.FirstDifference(info, other); field != "" {
			mine, theirs := fmt.Sprintf("%#v", m), fmt.Sprintf("%#v", t)
			return nil, conflict(field, "rank %d registers %s %s but rank %d registered %s %s; all ranks must agree",
				info.Rank, field, mine, other.Rank, field, theirs)
		}
	}
	g.ranks[info.Rank] = info
	return g.responseLocked(info.Rank, replaced), nil
}

// tpSizeLocked is the number of ranks to wait for: the configured size, or
// the registered ranks' (they agree), or 0 when unknown.
func (g *Registry) tpSizeLocked() int {
	if g.opts.TPSize > 0 {
		return g.opts.TPSize
	}
	for _, r := range g.ranks {
		return r.TPSize
	}
	return 0
}

func (g *Registry) completeLocked() bool {
	n := g.tpSizeLocked()
	return n > 0 && len(g.ranks) == n
}

func (g *Registry) sortedLocked() []pdproto.RankInfo {
	out := make([]pdproto.RankInfo, 0, len(g.ranks))
	for _, r := range g.ranks {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b pdproto.RankInfo) int { return a.Rank - b.Rank })
	return out
}

func (g *Registry) responseLocked(rank int, replaced bool) *pdproto.RegisterResponse {
	return &pdproto.RegisterResponse{Rank: rank, Replaced: replaced, Registered: len(g.ranks),
		TPSize: g.tpSizeLocked(), Complete: g.completeLocked()}
}

// Lookup returns what GET /bootstrap/v1/ranks answers: every rank when the
// group is complete, else a 503 not_ready error saying which ranks are
// missing.
func (g *Registry) Lookup() (*pdproto.LookupResponse, *pdproto.BootstrapError) {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := g.tpSizeLocked()
	if !g.completeLocked() {
		e := &pdproto.BootstrapError{Status: http.StatusServiceUnavailable, Code: pdproto.CodeNotReady,
			Registered: len(g.ranks), TPSize: n}
		if n == 0 {
			e.Message = "no prefill rank has registered yet"
		} else {
			for r := range n {
				if _, ok := g.ranks[r]; !ok {
					e.Missing = append(e.Missing, r)
				}
			}
			e.Message = fmt.Sprintf("%d of %d prefill ranks registered; waiting for ranks %v", len(g.ranks), n, e.Missing)
		}
		return nil, e
	}
	return &pdproto.LookupResponse{TPSize: n, Complete: true, Ranks: g.sortedLocked()}, nil
}

// Health returns what GET /bootstrap/v1/health answers.
func (g *Registry) Health() pdproto.BootstrapHealth {
	g.mu.Lock()
	defer g.mu.Unlock()
	return pdproto.BootstrapHealth{Status: "ok", Registered: len(g.ranks), TPSize: g.tpSizeLocked(), Complete: g.completeLocked()}
}

func (g *Registry) serveLookup(w http.ResponseWriter) {
	resp, e := g.Lookup()
	if e != nil {
		secs := int((g.opts.RetryAfter + time.Second - 1) / time.Second)
		w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil { // cannot happen: the wire types marshal
		status = http.StatusInternalServerError
		body = []byte(`{"error":{"code":"internal","message":"cannot encode the answer"}}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	w.Write(append(body, '\n'))
}

func writeError(w http.ResponseWriter, e *pdproto.BootstrapError) {
	writeJSON(w, e.Status, pdproto.BootstrapErrorBody{Error: *e})
}

// Replace swaps every rank's registration for infos at once: the prefill
// server that owns the registry calls it after a live change of what its
// ranks say (an index-K precision switch), which Register refuses rank by
// rank (an instance cannot change its registration, and ranks must agree
// at every moment). It is a local call, never reachable over HTTP. infos
// must be complete (one per rank of TPSize), valid and agree with each
// other; on error nothing changes.
func (g *Registry) Replace(infos []pdproto.RankInfo) error {
	seen := map[int]bool{}
	for _, info := range infos {
		if err := info.Validate(); err != nil {
			return fmt.Errorf("bootstrap: replace: %w", err)
		}
		if g.opts.TPSize > 0 && info.TPSize != g.opts.TPSize {
			return fmt.Errorf("bootstrap: replace: rank %d says tp_size %d, the server runs %d", info.Rank, info.TPSize, g.opts.TPSize)
		}
		if seen[info.Rank] {
			return fmt.Errorf("bootstrap: replace: rank %d listed twice", info.Rank)
		}
		seen[info.Rank] = true
		if field, m, t := pdproto.FirstDifference(info, infos[0]); field != "" {
			return fmt.Errorf("bootstrap: replace: rank %d says %s %#v, rank %d %#v; all ranks must agree", info.Rank, field, m, infos[0].Rank, t)
		}
	}
	if len(infos) == 0 || (g.opts.TPSize > 0 && len(infos) != g.opts.TPSize) {
		return fmt.Errorf("bootstrap: replace: %d ranks, the server runs %d", len(infos), g.opts.TPSize)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	clear(g.ranks)
	for _, info := range infos {
		g.ranks[info.Rank] = info
	}
	return nil
}
