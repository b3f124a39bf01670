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
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
)

// RequestIDHeader carries the router's id of a request in its response; POST
// /abort_request accepts it as the rid.
const RequestIDHeader = "X-Request-Id"

var (
	errAborted    = errors.New("request aborted")
	errPrefill    = errors.New("prefill side failed")
	errDecodeDone = errors.New("decode side finished")
)

// rooms is the set of live bootstrap rooms.
type rooms struct {
	mu   sync.Mutex
	live map[uint64]struct{}
}

// acquire returns a random room (63 bits, never 0) that no live request
// holds, and holds it.
func (rs *rooms) acquire() uint64 {
	for {
		var b [8]byte
		rand.Read(b[:])
		v := binary.LittleEndian.Uint64(b[:]) & (1<<63 - 1)
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
	id     string // the router's id
	cancel context.CancelCauseFunc
	mu     sync.Mutex
	rid    string // the decode side's response id, once seen
}

// requests indexes the requests in flight by the router's id and by the
// decode side's response id.
type requests struct {
	mu   sync.Mutex
	byID map[string]*tracked
}

func (q *requests) add(t *tracked) {
	q.mu.Lock()
	q.byID[t.id] = t
	q.mu.Unlock()
}

// alias makes rid, the decode side's id, find t too.
func (q *requests) alias(t *tracked, rid string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, taken := q.byID[rid]; taken {
		return
	}
	t.mu.Lock()
	t.rid = rid
	t.mu.Unlock()
	q.byID[rid] = t
}

func (q *requests) remove(t *tracked) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.byID, t.id)
	t.mu.Lock()
	rid := t.rid
	t.mu.Unlock()
	if rid != "" && q.byID[rid] == t {
		delete(q.byID, rid)
	}
}

func (q *requests) find(id string) *tracked {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.byID[id]
}

// AbortRequest is the body of POST /abort_request.
type AbortRequest struct {
	RID string `json:"rid"`
}

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

// post sends body to url with ctx.
func (rt *Router) post(ctx context.Context, url string, body []byte, src *http.Request) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if a := src.Header.Get("Accept"); a != "" {
		req.Header.Set("Accept", a)
	}
	return rt.client.Do(req)
}

// proxy serves a generation request through a prefill and a decode server.
// A prefill server that cannot be connected to is left for another healthy
// one, once, with a new room: nothing of the request reached it, and the
// client has seen nothing yet.
func (rt *Router) proxy(w http.ResponseWriter, r *http.Request) {
	fields, oerr := readObject(w, r, rt.opts.MaxBodyBytes)
	if oerr != nil {
		rt.metrics.requests.WithLabelValues(outcomeInvalid).Inc()
		oerr.WriteJSON(w)
		return
	}
	if dead := rt.route(w, r, fields, nil); dead != nil {
		rt.log.Info("prefill refused the connection; routing again", "prefill", dead.url, "path", r.URL.Path)
		rt.metrics.retries.Inc()
		rt.route(w, r, fields, dead)
	}
}

// route runs one attempt of proxy. Unless avoid is set already (a second
// attempt), a prefill server that refuses the connection while another is
// healthy ends the attempt without answering the client: route returns
// that server for the next attempt to avoid.
func (rt *Router) route(w http.ResponseWriter, r *http.Request, fields map[string]json.RawMessage, avoid *upstream) (retry *upstream) {
	p := rt.pick(pdproto.RolePrefill, avoid)
	if p == nil {
		rt.metrics.requests.WithLabelValues(outcomeNoServer).Inc()
		noServer(pdproto.RolePrefill).WriteJSON(w)
		return
	}
	// Each server is released as soon as its answer has ended.
	releasePrefill := sync.OnceFunc(func() { rt.release(p) })
	defer releasePrefill()
	d := rt.pick(pdproto.RoleDecode, nil)
	if d == nil {
		rt.metrics.requests.WithLabelValues(outcomeNoServer).Inc()
		noServer(pdproto.RoleDecode).WriteJSON(w)
		return
	}
	releaseDecode := sync.OnceFunc(func() { rt.release(d) })
	defer releaseDecode()
	_, pinfo := p.state()

	room := rt.rooms.acquire()
	rt.metrics.liveRooms.Inc()
	defer func() {
		rt.rooms.release(room)
		rt.metrics.liveRooms.Dec()
	}()
	pbody, err := encode(fields, map[string]any{"bootstrap_room": room, "stream": false, "stream_options": nil})
	if err != nil {
		panic(err) // cannot happen: the values are plain
	}
	dbody, err := encode(fields, map[string]any{"bootstrap_room": room, "bootstrap_url": pinfo.BootstrapURL})
	if err != nil {
		panic(err)
	}

	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	t := &tracked{id: "router-" + strconv.FormatUint(rt.seq.Add(1), 10), cancel: cancel}
	rt.reqs.add(t)
	defer rt.reqs.remove(t)
	w.Header().Set(RequestIDHeader, t.id)
	log := rt.log.With("request_id", t.id, "path", r.URL.Path, "room", room, "prefill", p.url, "decode", d.url)
	log.Debug("routing")

	// Both sides start at once. The goroutines are owned here: each sends
	// one result on a buffered channel, and every path out of this
	// function receives it (after cancelling ctx where it must not wait).
	pch := make(chan upResult, 1)
	go func() {
		resp, err := rt.post(ctx, p.url+r.URL.Path, pbody, r)
		if err != nil {
			rt.transportFailed(ctx, p, err)
			releasePrefill()
			pch <- upResult{err: err}
			return
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		rt.transportFailed(ctx, p, err)
		releasePrefill()
		pch <- upResult{status: resp.StatusCode, body: body, err: err}
	}()
	dch := make(chan upResult, 1)
	go func() {
		resp, err := rt.post(ctx, d.url+r.URL.Path, dbody, r)
		rt.transportFailed(ctx, d, err)
		dch <- upResult{resp: resp, err: err}
	}()

	prefillCh := pch  // nil once its result is in
	graceful := false // the decode side answered 2xx to its end
	defer func() {
		if prefillCh == nil {
			return
		}
		if !graceful {
			cancel(errDecodeDone)
			<-prefillCh
			return
		}
		// The decode side is done; let the prefill side answer for a
		// moment (it normally has), then cancel it.
		timer := time.NewTimer(rt.opts.PrefillGrace)
		defer timer.Stop()
		select {
		case res := <-prefillCh:
			rt.prefillResult(ctx, log, p, res)
			return
		case <-timer.C:
		case <-ctx.Done():
		}
		cancel(errDecodeDone)
		<-prefillCh
	}()

	// failPrefill answers the client with the prefill side's error after
	// stopping the decode side (and, before its headers came, waiting for
	// its goroutine).
	failPrefill := func(res upResult, headers bool) {
		cancel(errPrefill)
		if !headers {
			if dres := <-dch; dres.resp != nil {
				dres.resp.Body.Close()
			}
		}
		e := rt.prefillError(p, res)
		log.Warn("prefill failed before decode output", "status", e.Status, "err", e.Message)
		rt.metrics.requests.WithLabelValues(outcomeUpstreamError).Inc()
		e.WriteJSON(w)
	}

	// Wait for the decode side's headers, or a prefill failure.
	var dres upResult
	for got := false; !got; {
		select {
		case res := <-prefillCh:
			prefillCh = nil
			if res.failed() && ctx.Err() == nil {
				if avoid == nil && refused(res.err) && rt.otherHealthy(p) {
					cancel(errPrefill)
					if dres := <-dch; dres.resp != nil {
						dres.resp.Body.Close()
					}
					return p
				}
				failPrefill(res, false)
				return nil
			}
		case dres = <-dch:
			got = true
		}
	}
	if dres.err != nil {
		rt.endEarly(ctx, w, r, log, d, dres.err)
		return
	}
	resp := dres.resp
	defer resp.Body.Close()

	// Stream the decode side's body as it arrives; a reader goroutine
	// turns it into chunks so that a prefill failure can be seen while
	// the decode side is silent.
	type chunk struct {
		b   []byte
		err error
	}
	chunks := make(chan chunk)
	stop := make(chan struct{})
	go func() {
		defer close(chunks)
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				select {
				case chunks <- chunk{b: bytes.Clone(buf[:n])}:
				case <-stop:
					return
				}
			}
			if err != nil {
				select {
				case chunks <- chunk{err: err}:
				case <-stop:
				}
				return
			}
		}
	}()
	eof := false
	defer func() {
		close(stop)
		if !eof {
			cancel(errDecodeDone) // unblocks a Read in flight
		}
		for range chunks {
		}
	}()

	sniff := sniffer{sse: strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")}
	wrote := false
	writeHeader := func() {
		wrote = true
		h := w.Header()
		for k, vs := range resp.Header {
			if hopByHop[http.CanonicalHeaderKey(k)] {
				continue
			}
			h[k] = vs
		}
		h.Set(RequestIDHeader, t.id)
		w.WriteHeader(resp.StatusCode)
	}
	flusher, _ := w.(http.Flusher)
	for {
		select {
		case res := <-prefillCh:
			prefillCh = nil
			if !res.failed() || ctx.Err() != nil {
				continue
			}
			if !wrote {
				failPrefill(res, true)
				return
			}
			// The decode side has begun: it learns of the failure from
			// the prefill server and ends its answer.
			rt.prefillResult(ctx, log, p, res)
		case c := <-chunks:
			if c.err != nil {
				if c.err == io.EOF {
					eof = true
					releaseDecode()
					if !wrote {
						writeHeader()
					}
					outcome := outcomeOK
					if resp.StatusCode < 200 || resp.StatusCode > 299 {
						outcome = outcomeUpstreamReply
						if resp.StatusCode >= 500 {
							rt.metrics.upstreamErrors.WithLabelValues(d.role, d.url).Inc()
						}
					} else {
						graceful = true
					}
					rt.metrics.requests.WithLabelValues(outcome).Inc()
					return
				}
				rt.transportFailed(ctx, d, c.err) // reading the decode's body failed
				if wrote {
					rt.cutShort(ctx, r, log, d, c.err)
					return
				}
				rt.endEarly(ctx, w, r, log, d, c.err)
				return
			}
			if !wrote {
				writeHeader()
			}
			if id := sniff.add(c.b); id != "" {
				rt.reqs.alias(t, id)
				log = log.With("rid", id)
			}
			if _, err := w.Write(c.b); err != nil {
				rt.cutShort(ctx, r, log, d, err)
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
	}
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
		rt.metrics.requests.WithLabelValues(outcomeClientGone).Inc()
		log.Info("client went away")
	case context.Cause(ctx) == errAborted:
		rt.metrics.requests.WithLabelValues(outcomeAborted).Inc()
		log.Info("aborted")
		(&openai.Error{Status: 499, Type: openai.TypeInvalidRequest, Message: "the request was aborted"}).WriteJSON(w)
	default:
		rt.metrics.requests.WithLabelValues(outcomeUpstreamError).Inc()
		rt.metrics.upstreamErrors.WithLabelValues(d.role, d.url).Inc()
		log.Warn("decode failed", "err", err)
		(&openai.Error{Status: http.StatusBadGateway, Type: openai.TypeServer,
			Message: fmt.Sprintf("decode server %s: %v", d.url, err)}).WriteJSON(w)
	}
}

// cutShort records a response that ended before the decode side's end.
func (rt *Router) cutShort(ctx context.Context, r *http.Request, log *slog.Logger, d *upstream, err error) {
	switch {
	case r.Context().Err() != nil:
		rt.metrics.requests.WithLabelValues(outcomeClientGone).Inc()
		log.Info("client went away")
	case context.Cause(ctx) == errAborted:
		rt.metrics.requests.WithLabelValues(outcomeAborted).Inc()
		log.Info("aborted")
	default:
		rt.metrics.requests.WithLabelValues(outcomeUpstreamError).Inc()
		rt.metrics.upstreamErrors.WithLabelValues(d.role, d.url).Inc()
		log.Warn("decode stream cut", "err", err)
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
