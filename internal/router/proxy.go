package router

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/internal/httpx"
)

// Two headers name a request in the router's response. AbortIDHeader
// carries the router's id, which POST /abort_request accepts, and only it,
// as the rid. RequestIDHeader carries the client's own X-Request-Id when it
// sent one (validated, passed to both servers and named in every log line
// and debug entry of the request), else the router's id too.
const (
	AbortIDHeader   = "X-Pdkit-Abort-Id"
	RequestIDHeader = httpx.RequestIDHeader
)

// newRequestID returns a request id no one can guess: "router-" and 130
// random bits (rand.Text's 26 base32 characters). Holding it is what lets a client abort the request,
// so it must never be sequential or derived from anything a client sees.
func newRequestID() string {
	return "router-" + rand.Text()
}

var (
	errAborted    = errors.New("request aborted")
	errShutdown   = errors.New("router shutting down")
	errPrefill    = errors.New("prefill side failed")
	errDecodeDone = errors.New("decode side finished")
)

// rooms is the set of live bootstrap rooms.
type rooms struct {
	mu   sync.Mutex
	live map[uint64]struct{}
}

// acquire returns a random room (53 bits, never 0) that no live request
// holds, and holds it.
func (rs *rooms) acquire() uint64 {
	for {
		var b [8]byte
		rand.Read(b[:])
		// Below 2^53: any JSON reader (JavaScript, jq) keeps the room
		// exact; 53 random bits are still unguessable enough for a key
		// that lives as long as one request.
		v := binary.LittleEndian.Uint64(b[:]) & (1<<53 - 1)
		if v == 0 {
			continue
		}
		rs.mu.Lock()
		if _, taken := rs.live[v]; !taken {
			rs.live[v] = struct{}{}
			rs.mu.Unlock()
			return v
		}
		rs.mu.Unlock()
	}
}

func (rs *rooms) release(v uint64) {
	rs.mu.Lock()
	delete(rs.live, v)
	rs.mu.Unlock()
}

func (rs *rooms) count() int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return len(rs.live)
}

// tracked is a request in flight, as /abort_request finds it.
type tracked struct {
	id     string // the router's id (newRequestID)
	cancel context.CancelCauseFunc
}

// requests indexes the requests in flight by the router's id. The decode
// side's response id is not an index: servers number their requests in
// sequence, so anyone could guess another client's.
type requests struct {
	mu   sync.Mutex
	byID map[string]*tracked
}

func (q *requests) add(t *tracked) {
	q.mu.Lock()
	q.byID[t.id] = t
	q.mu.Unlock()
}

func (q *requests) remove(t *tracked) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.byID, t.id)
}

func (q *requests) find(id string) *tracked {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.byID[id]
}

// cancelAll cancels every request in flight with cause and returns how
// many there were.
func (q *requests) cancelAll(cause error) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, t := range q.byID {
		t.cancel(cause)
	}
	return len(q.byID)
}

// AbortRequest is the body of POST /abort_request.
type AbortRequest struct {
	RID string `json:"rid"`
}

// abort serves POST /abort_request. The rid must be a router id the
// client was given (X-Request-Id): possession of that unguessable id is
// the authorization. Any other rid, a server's response id included, is
// answered 404 like a finished request, so that the answer tells a guesser
// nothing.
func (rt *Router) abort(w http.ResponseWriter, r *http.Request) {
	var req AbortRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16))
	if err := dec.Decode(&req); err != nil {
		openai.InvalidRequest("", "malformed JSON body: "+err.Error()).WriteJSON(w)
		return
	}
	if req.RID == "" {
		openai.InvalidRequest("rid", "rid is required").WriteJSON(w)
		return
	}
	t := rt.reqs.find(req.RID)
	if t == nil {
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Param: "rid",
			Message: fmt.Sprintf("no request %q in flight", req.RID)}).WriteJSON(w)
		return
	}
	rt.log.Info("abort", "rid", req.RID, "request_id", t.id)
	t.cancel(errAborted)
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "rid": req.RID})
}

// count records a routed request's outcome: its counter and, for the
// outcomes that say whether the cluster served it (ok, upstream_error),
// the readiness window.
func (rt *Router) count(outcome string) {
	rt.metrics.requests.WithLabelValues(outcome).Inc()
	switch outcome {
	case outcomeOK:
		rt.recent.Record(false)
	case outcomeUpstreamError:
		rt.recent.Record(true)
	}
}

// readObject reads a JSON object body into its fields, bounded in size.
func readObject(w http.ResponseWriter, r *http.Request, max int64) (map[string]json.RawMessage, *openai.Error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, max))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &openai.Error{Status: http.StatusRequestEntityTooLarge, Type: openai.TypeInvalidRequest,
				Code: openai.CodeRequestTooLarge, Message: fmt.Sprintf("the body exceeds %d bytes", max)}
		}
		return nil, openai.InvalidRequest("", "reading the body: "+err.Error())
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		return nil, openai.InvalidRequest("", "malformed JSON body: "+err.Error())
	}
	if fields == nil {
		return nil, openai.InvalidRequest("", "malformed JSON body: want an object")
	}
	return fields, nil
}

// encode writes fields with set added (a nil value deletes the field).
func encode(fields map[string]json.RawMessage, set map[string]any) ([]byte, error) {
	out := make(map[string]json.RawMessage, len(fields)+len(set))
	for k, v := range fields {
		out[k] = v
	}
	for k, v := range set {
		if v == nil {
			delete(out, k)
			continue
		}
		b, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		out[k] = b
	}
	return json.Marshal(out)
}

// upResult is an upstream answer: the prefill side's, read whole, or the
// decode side's, its body to stream.
type upResult struct {
	resp   *http.Response
	status int
	body   []byte
	err    error
}

func (res upResult) failed() bool { return res.err != nil || res.status < 200 || res.status > 299 }

// post sends body to url with ctx and the request id id, signed with the
// cluster secret (when the router has one) for the server whose id is
// target.
func (rt *Router) post(ctx context.Context, url string, body []byte, src *http.Request, id, target string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if a := src.Header.Get("Accept"); a != "" {
		req.Header.Set("Accept", a)
	}
	req.Header.Set(RequestIDHeader, id)
	rt.opts.ClusterSecret.SignRequest(req, body, time.Now(), target)
	return rt.client.Do(req)
}

// proxy serves a generation request through a prefill and a decode server.
// A prefill server that cannot be connected to is left for another healthy
// one, once, with a new room: nothing of the request reached it, and the
// client has seen nothing yet.
func (rt *Router) proxy(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	bound := rt.promptBound()
	clientID, oerr := httpx.ClientRequestID(r)
	var fields map[string]json.RawMessage
	if oerr == nil {
		fields, oerr = readObject(w, r, bound.BodyBytes(rt.opts.MaxBodyBytes))
	}
	if oerr == nil {
		oerr = checkPrompt(bound, fields)
	}
	if oerr != nil {
		rt.count(outcomeInvalid)
		oerr.WriteJSON(w)
		return
	}
	if !rt.ready.Load() {
		rt.unavailable(w, outcomeStarting, errStarting)
		return
	}
	// While an operator has paused admission the request waits here,
	// before anything of it is sent (pause.go).
	if waited, err := rt.gate.enter(r.Context()); err != nil {
		rt.count(outcomeClientGone)
		return // the client went while it waited
	} else if waited {
		rt.metrics.pauseWaits.Inc()
	}
	defer rt.gate.leave()
	if again := rt.route(w, r, fields, clientID, nil, arrived); again != nil {
		rt.log.Info("routing again", "why", again.why, "path", r.URL.Path)
		rt.metrics.retries.Inc()
		rt.route(w, r, fields, clientID, again, arrived)
	}
}

// ended records a decode answer read to its end and returns whether it
// was a success: 2xx and, for a stream, ended by [DONE] without an error
// event. A 4xx is the client's error, passed through; a 5xx, a stream that
// carried an error event and one that ended without [DONE] are the
// server's (the last gets an error event of the router's, so that the
// client knows it was cut).
func (rt *Router) ended(w http.ResponseWriter, log *slog.Logger, d *upstream, status int, meter *streamMeter) bool {
	fail := func(msg string, args ...any) {
		rt.count(outcomeUpstreamError)
		rt.metrics.upstreamErrors.WithLabelValues(d.role, d.url).Inc()
		log.Warn(msg, args...)
	}
	switch {
	case status >= 500:
		fail("decode failed", "status", status)
	case status < 200 || status > 299:
		rt.count(outcomeClientError)
		log.Debug("decode refused the request", "status", status)
	case meter.errored:
		fail("decode stream ended with an error event", "err", meter.errMsg)
	case meter.sse && !meter.done:
		writeCut(w, fmt.Sprintf("decode server %s ended the stream before its end", d.url))
		fail("decode stream ended without [DONE]")
	case meter.abortedAnswer():
		// Someone asked for the end (the client, an operator, a drain):
		// an abort, which is no server's failure.
		rt.count(outcomeAborted)
		return true
	default:
		rt.count(outcomeOK)
		return true
	}
	return false
}

// writeAborted ends a stream the client has begun to receive and an abort
// cut (POST /abort_request) as an aborted request ends: a last chunk whose
// choice has finish_reason "abort", then [DONE]. It is no error.
func writeAborted(w http.ResponseWriter) {
	openai.WriteEvent(w, map[string]any{"choices": []any{map[string]any{"index": 0, "text": "", "delta": map[string]any{}, "finish_reason": openai.FinishAbort}}})
	openai.WriteDone(w)
}

// writeCut ends a stream the client has begun to receive with an SSE error
// event (an OpenAI error object) saying why it was cut; the handler then
// returns, which ends the response cleanly.
func writeCut(w http.ResponseWriter, msg string) {
	openai.WriteEvent(w, openai.ServerError(msg).Body())
}

// hopByHop lists the headers that a proxy does not pass on.
var hopByHop = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
}

// prefillResult logs and counts a prefill answer that comes too late to be
// returned to the client.
func (rt *Router) prefillResult(ctx context.Context, log *slog.Logger, p *upstream, res upResult) {
	if !res.failed() || ctx.Err() != nil {
		return
	}
	e := rt.prefillError(p, res)
	if e.Status >= 400 && e.Status < 500 {
		log.Debug("prefill refused the request after decode output began", "status", e.Status, "err", e.Message)
		return
	}
	log.Warn("prefill failed after decode output began", "status", e.Status, "err", e.Message)
}

// prefillError turns a failed prefill answer into the error for the client,
// and counts it.
func (rt *Router) prefillError(p *upstream, res upResult) *openai.Error {
	if res.err != nil || res.status >= 500 {
		rt.metrics.upstreamErrors.WithLabelValues(p.role, p.url).Inc()
	}
	if res.err != nil {
		return &openai.Error{Status: http.StatusBadGateway, Type: openai.TypeServer,
			Message: fmt.Sprintf("prefill server %s: %v", p.url, res.err)}
	}
	return openai.ParseError(res.status, res.body)
}

// endEarly answers a request whose decode side failed before any of its
// body reached the client.
func (rt *Router) endEarly(ctx context.Context, w http.ResponseWriter, r *http.Request, log *slog.Logger, d *upstream, err error) {
	switch {
	case r.Context().Err() != nil:
		rt.count(outcomeClientGone)
		log.Info("client went away")
	case context.Cause(ctx) == errAborted:
		rt.count(outcomeAborted)
		log.Info("aborted")
		(&openai.Error{Status: 499, Type: openai.TypeInvalidRequest, Message: "the request was aborted"}).WriteJSON(w)
	case context.Cause(ctx) == errShutdown:
		rt.count(outcomeShutdown)
		log.Info("cut by the shutdown")
		w.Header().Set("Retry-After", retryAfterSeconds(rt.opts.HealthInterval))
		(&openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer,
			Message: "the router shut down before the request was answered"}).WriteJSON(w)
	default:
		rt.count(outcomeUpstreamError)
		rt.metrics.upstreamErrors.WithLabelValues(d.role, d.url).Inc()
		log.Warn("decode failed", "err", err)
		(&openai.Error{Status: http.StatusBadGateway, Type: openai.TypeServer,
			Message: fmt.Sprintf("decode server %s: %v", d.url, err)}).WriteJSON(w)
	}
}

// cutShort records a response that ended before the decode side's end
// and, when it is a stream whose client is still there and which has not
// ended already, ends it with an SSE error event saying why.
func (rt *Router) cutShort(ctx context.Context, w http.ResponseWriter, r *http.Request, log *slog.Logger, d *upstream, err error, meter *streamMeter) {
	var msg string
	switch {
	case r.Context().Err() != nil:
		rt.count(outcomeClientGone)
		log.Info("client went away")
		return
	case context.Cause(ctx) == errAborted:
		rt.count(outcomeAborted)
		log.Info("aborted")
		if meter.sse && !meter.done {
			writeAborted(w)
		}
		return
	case context.Cause(ctx) == errShutdown:
		rt.count(outcomeShutdown)
		log.Info("cut by the shutdown")
		msg = "the router shut down before the response ended"
	default:
		rt.count(outcomeUpstreamError)
		rt.metrics.upstreamErrors.WithLabelValues(d.role, d.url).Inc()
		log.Warn("decode stream cut", "err", err)
		msg = fmt.Sprintf("decode server %s failed mid-stream: %v", d.url, err)
	}
	if meter.sse && !meter.done {
		writeCut(w, msg)
	}
}

// sniffer finds the response id in the first JSON object or SSE event of
// a decode response.
type sniffer struct {
	sse  bool
	buf  []byte
	done bool
}

const sniffMax = 64 << 10

// add takes the next chunk and returns the id once it is found.
func (s *sniffer) add(b []byte) string {
	if s.done {
		return ""
	}
	s.buf = append(s.buf, b...)
	if len(s.buf) > sniffMax {
		s.done = true
	}
	var obj []byte
	if s.sse {
		for rest := s.buf; ; {
			line, after, ok := bytes.Cut(rest, []byte("\n"))
			if !ok {
				return ""
			}
			rest = after
			if data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:")); ok {
				obj = bytes.TrimSpace(data)
				break
			}
		}
	} else {
		obj = s.buf
		if !json.Valid(obj) {
			return ""
		}
	}
	s.done = true
	var v struct {
		ID       string `json:"id"`
		MetaInfo struct {
			ID string `json:"id"`
		} `json:"meta_info"`
	}
	if json.Unmarshal(obj, &v) != nil {
		return ""
	}
	if v.ID != "" {
		return v.ID
	}
	return v.MetaInfo.ID
}

// streamMeter follows an SSE stream as it passes to the client, event by
// event: the token events (a choice with text or delta content), whether
// an error event or [DONE] came.
type streamMeter struct {
	sse     bool
	partial []byte // an event not yet ended by its blank line
	done    bool   // data: [DONE] came
	errored bool   // an error event came
	errMsg  string
	aborted bool // a choice ended with finish_reason "abort": someone asked for it
}

// maxEvent bounds an event the meter buffers; a longer one is skipped.
const maxEvent = 1 << 20

// add takes the next chunk of the stream and returns how many token
// events it ended.
func (m *streamMeter) add(b []byte) int {
	if !m.sse {
		// A whole answer: kept (up to maxEvent) for its finish reasons.
		if len(m.partial)+len(b) <= maxEvent {
			m.partial = append(m.partial, b...)
		}
		return 0
	}
	// Lines may end in CRLF (the SSE format allows it): read them as LF.
	m.partial = append(m.partial, bytes.ReplaceAll(b, []byte("\r"), nil)...)
	tokens := 0
	for {
		i := bytes.Index(m.partial, []byte("\n\n"))
		if i < 0 {
			break
		}
		if m.event(m.partial[:i]) {
			tokens++
		}
		m.partial = m.partial[i+2:]
	}
	if len(m.partial) > maxEvent {
		m.partial = m.partial[:0]
	}
	m.partial = bytes.Clone(m.partial) // let the chunks go
	return tokens
}

// event reads one event's lines and reports whether it carried a token.
func (m *streamMeter) event(ev []byte) bool {
	var data []byte
	for line := range bytes.SplitSeq(ev, []byte("\n")) {
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimSpace(d)...)
		}
	}
	if len(data) == 0 {
		return false
	}
	if string(data) == "[DONE]" {
		m.done = true
		return false
	}
	var v struct {
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
		Choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &v) != nil {
		return false
	}
	if v.Error != nil {
		m.errored, m.errMsg = true, v.Error.Message
		return false
	}
	tok := false
	for _, c := range v.Choices {
		if c.FinishReason != nil && *c.FinishReason == openai.FinishAbort {
			m.aborted = true
		}
		if c.Text != "" || c.Delta.Content != "" {
			tok = true
		}
	}
	return tok
}

// abortedAnswer reports whether a whole (not streamed) answer's choices
// ended with finish_reason "abort".
func (m *streamMeter) abortedAnswer() bool {
	if m.sse {
		return m.aborted
	}
	var v struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if json.Unmarshal(m.partial, &v) != nil {
		return false
	}
	for _, c := range v.Choices {
		if c.FinishReason == openai.FinishAbort {
			return true
		}
	}
	return false
}
