package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// route runs one attempt of proxy. Unless avoid is set already (a second
// attempt), a prefill server that refuses the connection while another is
// healthy ends the attempt without answering the client: route returns
// that server for the next attempt to avoid.
//
// The phases run in order, and each one's undoing is deferred here, so
// that they unwind in reverse on every path out.
func (rt *Router) route(w http.ResponseWriter, r *http.Request, fields map[string]json.RawMessage, clientID string, again *reroute, arrived time.Time) *reroute {
	a := &attempt{rt: rt, w: w, r: r, fields: fields, clientID: clientID, arrived: arrived, second: again != nil}
	if again != nil {
		a.avoid = again.avoid
	}
	if !a.admit() {
		return nil
	}
	defer a.releaseServers()
	a.holdRoom()
	defer a.releaseRoom()
	pbody, dbody := a.bodies()
	a.track()
	defer a.untrack()
	a.send(pbody, dbody)
	defer a.finishPrefill()
	resp, retry := a.awaitDecode()
	if resp == nil {
		return retry
	}
	defer resp.Body.Close()
	a.stream(resp)
	return nil
}

// attempt is one try at serving a generation request through a prefill
// and a decode server: what route has chosen, holds and has seen so far.
// Only route's goroutine touches it after send, except for the fields the
// two senders read, which are set before they start and never change.
type attempt struct {
	rt     *Router
	w      http.ResponseWriter
	r      *http.Request
	fields map[string]json.RawMessage
	// clientID is the client's X-Request-Id ("" without one): echoed,
	// passed to both servers and named in every log line.
	clientID string
	avoid    *upstream // a prefill server the first attempt found refusing
	second   bool      // the request's second attempt: it is not routed again
	arrived  time.Time

	// Admission: both servers, counted on until released. Each release
	// runs once, as soon as that server's answer has ended, or at the end.
	p, d                          *upstream
	releasePrefill, releaseDecode func()
	bootstrapURL                  string // the prefill server's, for the decode side
	pid, did                      string // the servers' ids, which their requests are signed for
	model                         string // the decode server's, for the latency metrics

	room uint64

	// The attempt's context: the client's, with an abort, the router's
	// shutdown and the attempt's own end as further causes of its
	// cancellation. Both upstream requests carry it.
	ctx    context.Context
	cancel context.CancelCauseFunc
	t      *tracked
	log    *slog.Logger

	prefillCh <-chan upResult // the prefill sender's result; nil once received
	decodeCh  <-chan upResult // the decode sender's headers; nil once received

	// The decode answer as it is streamed to the client.
	resp      *http.Response
	sniff     sniffer
	meter     streamMeter
	flusher   http.Flusher // nil when w cannot flush
	wrote     bool         // the client has the headers
	lastToken time.Time
	eof       bool // the decode body was read to its end
	graceful  bool // the decode side answered 2xx to its end
}

// admit picks both servers, each with room for the request, before
// anything is sent, so that a refusal is never half-way. Without one of
// them it answers the client (429 or 503), releases what it had picked and
// returns false.
func (a *attempt) admit() bool {
	p := a.pickOne(pdproto.RolePrefill, a.avoid)
	if p == nil {
		return false
	}
	a.p, a.releasePrefill = p, sync.OnceFunc(func() { a.rt.release(p) })
	d := a.pickOne(pdproto.RoleDecode, nil)
	if d == nil {
		a.releasePrefill()
		return false
	}
	a.d, a.releaseDecode = d, sync.OnceFunc(func() { a.rt.release(d) })
	_, pinfo := p.state()
	_, dinfo := d.state()
	a.bootstrapURL = pinfo.BootstrapURL
	a.pid, a.did = pinfo.ID, dinfo.ID
	a.model = dinfo.Model
	if a.model == "" {
		a.model = "unknown"
	}
	return true
}

// pickOne picks a server of role that admits the request or, when none
// does, answers the client why and returns nil.
func (a *attempt) pickOne(role string, avoid *upstream) *upstream {
	u, full := a.rt.pick(role, avoid, true)
	switch {
	case u != nil:
	case full != nil:
		a.rt.refuse(a.w, full)
	default:
		a.rt.unavailable(a.w, outcomeNoServer, noServer(role))
	}
	return u
}

// releaseServers releases both servers, the decode first, where their
// answers have not done so already.
func (a *attempt) releaseServers() {
	a.releaseDecode()
	a.releasePrefill()
}

// holdRoom takes a bootstrap room for the attempt; releaseRoom gives it
// back.
func (a *attempt) holdRoom() {
	a.room = a.rt.rooms.acquire()
	a.rt.metrics.liveRooms.Inc()
}

func (a *attempt) releaseRoom() {
	a.rt.rooms.release(a.room)
	a.rt.metrics.liveRooms.Dec()
}

// bodies returns the request as each side gets it: the prefill's without
// streaming, the decode's told where the prefill server bootstraps.
func (a *attempt) bodies() (pbody, dbody []byte) {
	// "probe" marks the router's own canaries (canary.go), which servers
	// leave out of their metrics: never a client's request.
	pbody, err := encode(a.fields, map[string]any{"bootstrap_room": a.room, "stream": false, "stream_options": nil, "probe": nil})
	if err != nil {
		panic(err) // cannot happen: the values are plain
	}
	dbody, err = encode(a.fields, map[string]any{"bootstrap_room": a.room, "bootstrap_url": a.bootstrapURL, "probe": nil})
	if err != nil {
		panic(err)
	}
	return pbody, dbody
}

// track gives the attempt its context and its router id, by which POST
// /abort_request and the router's Cut find it. This context is the abort's
// fan-out: the client going away, an abort or a shutdown cancels it, and
// with it both upstream requests at once. untrack ends both.
func (a *attempt) track() {
	a.ctx, a.cancel = context.WithCancelCause(a.r.Context())
	a.t = &tracked{id: newRequestID(), cancel: a.cancel}
	a.rt.reqs.add(a.t)
	a.setIDs(a.w.Header())
	a.log = a.rt.log.With("request_id", a.t.id, "path", a.r.URL.Path, "room", a.room, "prefill", a.p.url, "decode", a.d.url)
	if a.clientID != "" {
		a.log = a.log.With("client_request_id", a.clientID)
	}
	a.log.Debug("routing")
}

// setIDs names the request in the response headers h: AbortIDHeader, the
// router's id; RequestIDHeader, the client's own when it gave one, else
// the router's.
func (a *attempt) setIDs(h http.Header) {
	h.Set(AbortIDHeader, a.t.id)
	h.Set(RequestIDHeader, a.id())
}

// id is the id the servers and the logs know the request by: the client's
// own, else the router's.
func (a *attempt) id() string {
	if a.clientID != "" {
		return a.clientID
	}
	return a.t.id
}

func (a *attempt) untrack() {
	a.rt.reqs.remove(a.t)
	a.cancel(nil)
}

// send starts both sides at once, each on a goroutine of its own that
// sends one result on a buffered channel and exits. route owns them and
// receives both results on every path out, after cancelling the context
// where it must not wait for an answer: the decode's in awaitDecode or
// stopDecode, the prefill's in awaitDecode, stream or finishPrefill.
func (a *attempt) send(pbody, dbody []byte) {
	pch := make(chan upResult, 1)
	go a.sendPrefill(pch, pbody)
	a.prefillCh = pch
	dch := make(chan upResult, 1)
	go a.sendDecode(dch, dbody)
	a.decodeCh = dch
}

// sendPrefill posts the prefill side's request and reads its answer
// whole, releasing the server as soon as it has ended.
func (a *attempt) sendPrefill(ch chan<- upResult, body []byte) {
	resp, err := a.rt.post(a.ctx, a.p.url+a.r.URL.Path, body, a.r, a.id(), a.pid)
	if err != nil {
		a.rt.transportFailed(a.ctx, a.p, err)
		a.releasePrefill()
		ch <- upResult{err: err}
		return
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	a.rt.transportFailed(a.ctx, a.p, err)
	a.releasePrefill()
	ch <- upResult{status: resp.StatusCode, body: b, err: err}
}

// sendDecode posts the decode side's request and passes on its answer
// with the body unread.
func (a *attempt) sendDecode(ch chan<- upResult, body []byte) {
	resp, err := a.rt.post(a.ctx, a.d.url+a.r.URL.Path, body, a.r, a.id(), a.did)
	a.rt.transportFailed(a.ctx, a.d, err)
	ch <- upResult{resp: resp, err: err}
}

// awaitDecode waits for the decode side's headers, or a prefill failure.
// It returns the decode's response to stream; or nil, with the prefill
// server to avoid when the attempt is to be retried (retryable), and nil
// when the client has been answered.
func (a *attempt) awaitDecode() (resp *http.Response, retry *reroute) {
	for {
		select {
		case res := <-a.prefillCh:
			a.prefillCh = nil
			if !res.failed() || a.ctx.Err() != nil {
				continue
			}
			if a.retryable(res) {
				a.stopDecode(errPrefill)
				return nil, &reroute{avoid: a.p, why: "prefill refused the connection"}
			}
			if res.status == http.StatusUnauthorized && a.restarted(a.p, a.pid) {
				a.stopDecode(errPrefill)
				return nil, &reroute{why: "prefill restarted: the request was signed for its old id"}
			}
			a.failPrefill(res)
			return nil, nil
		case res := <-a.decodeCh:
			a.decodeCh = nil
			if res.err != nil {
				a.rt.endEarly(a.ctx, a.w, a.r, a.log, a.d, res.err)
				return nil, nil
			}
			if res.resp.StatusCode == http.StatusUnauthorized && a.restarted(a.d, a.did) {
				res.resp.Body.Close()
				a.cancel(errDecodeRestarted)
				return nil, &reroute{why: "decode restarted: the request was signed for its old id"}
			}
			return res.resp, nil
		}
	}
}

// reroute is an attempt that ended without answering the client, to be
// made again: avoiding a prefill server that refused the connection, or
// through a server that restarted under the first attempt.
type reroute struct {
	avoid *upstream
	why   string
}

// errDecodeRestarted cancels an attempt whose decode server refused it as
// signed for another server: it restarted since its last health check.
var errDecodeRestarted = errors.New("router: the decode server restarted; routing again")

// restarted says, on a first attempt that u refused as unsigned (401),
// whether u restarted since the router last checked it: a check now finds
// another id than signedFor, the one the request was signed for. A server
// that restarts faster than the health checks can see would otherwise
// refuse every request until the next check; a server that refuses for
// another reason (a router without the cluster's secret) keeps its id, and
// the refusal goes to the client as before.
func (a *attempt) restarted(u *upstream, signedFor string) bool {
	if a.second || signedFor == "" {
		return false
	}
	if healthy, info := u.state(); healthy && info.ID != "" && info.ID != signedFor {
		return true // another request's check, or the health loop's, saw it already
	}
	a.rt.check(a.ctx, u)
	healthy, info := u.state()
	return healthy && info.ID != "" && info.ID != signedFor
}

// retryable reports whether a failed prefill answer ends the attempt
// without answering the client: on a first attempt, a prefill server that
// refused the connection has received nothing of the request, and another
// one is healthy to take it.
func (a *attempt) retryable(res upResult) bool {
	return !a.second && refused(res.err) && a.rt.otherHealthy(a.p)
}

// stopDecode cancels the attempt with cause and, while the decode side's
// headers have not come, waits for its sender (closing the body of an
// answer that came all the same).
func (a *attempt) stopDecode(cause error) {
	a.cancel(cause)
	if a.decodeCh == nil {
		return
	}
	if res := <-a.decodeCh; res.resp != nil {
		res.resp.Body.Close()
	}
	a.decodeCh = nil
}

// failPrefill answers the client with the prefill side's error after
// stopping the decode side.
func (a *attempt) failPrefill(res upResult) {
	a.stopDecode(errPrefill)
	e := a.rt.prefillError(a.p, res)
	if e.Status >= 400 && e.Status < 500 {
		// The request's fault (a bad parameter): the client learns
		// why; nothing failed in the cluster.
		a.log.Debug("prefill refused the request", "status", e.Status, "err", e.Message)
		a.rt.count(outcomeClientError)
	} else {
		a.log.Warn("prefill failed before decode output", "status", e.Status, "err", e.Message)
		a.rt.count(outcomeUpstreamError)
	}
	e.WriteJSON(a.w)
}

// finishPrefill waits for the prefill side's result where it has not come
// yet. After a graceful decode answer the prefill side may answer for
// PrefillGrace (it normally has already); otherwise, or past that, it is
// cancelled first.
func (a *attempt) finishPrefill() {
	if a.prefillCh == nil {
		return
	}
	if !a.graceful {
		a.cancel(errDecodeDone)
		<-a.prefillCh
		return
	}
	timer := time.NewTimer(a.rt.opts.PrefillGrace)
	defer timer.Stop()
	select {
	case res := <-a.prefillCh:
		a.rt.prefillResult(a.ctx, a.log, a.p, res)
		return
	case <-timer.C:
	case <-a.ctx.Done():
	}
	a.cancel(errDecodeDone)
	<-a.prefillCh
}

// stream passes the decode side's answer to the client as it arrives,
// watching the prefill side's result meanwhile: a reader goroutine turns
// the body into chunks, so that a prefill failure is seen while the
// decode side is silent.
func (a *attempt) stream(resp *http.Response) {
	a.resp = resp
	body := readChunks(resp.Body)
	defer a.stopReading(body)
	sse := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	a.sniff = sniffer{sse: sse}
	a.meter = streamMeter{sse: sse}
	a.flusher, _ = a.w.(http.Flusher)
	for {
		select {
		case res := <-a.prefillCh:
			a.prefillCh = nil
			if a.prefillFailedMidway(res) {
				return
			}
		case c := <-body.chunks:
			if !a.relay(c) {
				return
			}
		}
	}
}

// stopReading stops body's reader and waits for its goroutine. Unless the
// body was read to its end, the attempt is cancelled first: that unblocks
// a Read in flight.
func (a *attempt) stopReading(body *chunkReader) {
	close(body.stop)
	if !a.eof {
		a.cancel(errDecodeDone)
	}
	for range body.chunks {
	}
}

// prefillFailedMidway takes the prefill side's result while the decode's
// answer streams, and reports whether it ended the response: a failure
// before any of it reached the client is answered instead.
func (a *attempt) prefillFailedMidway(res upResult) bool {
	if !res.failed() || a.ctx.Err() != nil {
		return false
	}
	if !a.wrote {
		a.failPrefill(res)
		return true
	}
	// The decode side has begun: it learns of the failure from the
	// prefill server and ends its answer.
	a.rt.prefillResult(a.ctx, a.log, a.p, res)
	return false
}

// relay passes one chunk of the decode's body to the client, and reports
// whether the stream goes on.
func (a *attempt) relay(c chunk) bool {
	if c.err != nil {
		a.bodyEnded(c.err)
		return false
	}
	if !a.wrote {
		a.writeHeader()
	}
	if id := a.sniff.add(c.b); id != "" {
		a.log = a.log.With("rid", id)
	}
	if _, err := a.w.Write(c.b); err != nil {
		a.rt.cutShort(a.ctx, a.w, a.r, a.log, a.d, err, &a.meter)
		return false
	}
	if a.flusher != nil {
		a.flusher.Flush()
	}
	a.observeTokens(a.meter.add(c.b))
	return true
}

// bodyEnded ends the response on the error that ended the decode's body.
func (a *attempt) bodyEnded(err error) {
	if err == io.EOF {
		a.eof = true
		a.finish()
		return
	}
	a.rt.transportFailed(a.ctx, a.d, err) // reading the decode's body failed
	switch {
	case a.meter.done:
		// The client has had the whole stream, [DONE] included, and
		// may have gone already: a cut after that changes nothing.
		a.finish()
	case a.wrote:
		a.rt.cutShort(a.ctx, a.w, a.r, a.log, a.d, err, &a.meter)
	default:
		a.rt.endEarly(a.ctx, a.w, a.r, a.log, a.d, err)
	}
}

// finish ends a decode answer that has come whole: the server is released
// and the outcome recorded. (After [DONE] the headers are written
// already.)
func (a *attempt) finish() {
	a.releaseDecode()
	if !a.wrote {
		a.writeHeader()
	}
	a.graceful = a.rt.ended(a.w, a.log, a.d, a.resp.StatusCode, &a.meter)
	if a.graceful {
		a.rt.metrics.e2e.WithLabelValues(a.model).Observe(time.Since(a.arrived).Seconds())
	}
}

// writeHeader passes the decode's status and headers to the client, less
// the hop-by-hop ones, with the router's request id.
func (a *attempt) writeHeader() {
	a.wrote = true
	h := a.w.Header()
	for k, vs := range a.resp.Header {
		if hopByHop[http.CanonicalHeaderKey(k)] {
			continue
		}
		h[k] = vs
	}
	a.setIDs(h)
	a.w.WriteHeader(a.resp.StatusCode)
}

// observeTokens records the latencies of the token events that one chunk
// ended: the first token's since arrival, then the gap to the previous.
func (a *attempt) observeTokens(tokens int) {
	if tokens <= 0 {
		return
	}
	now := time.Now()
	if a.lastToken.IsZero() {
		a.rt.metrics.ttft.WithLabelValues(a.model).Observe(now.Sub(a.arrived).Seconds())
	} else {
		a.rt.metrics.itl.WithLabelValues(a.model).Observe(now.Sub(a.lastToken).Seconds())
	}
	// Token events that came in one read reach the client together: no
	// time passed between them.
	for range tokens - 1 {
		a.rt.metrics.itl.WithLabelValues(a.model).Observe(0)
	}
	a.lastToken = now
}

// chunk is one read of the decode's body: bytes, or the error that ended
// it (io.EOF at its end).
type chunk struct {
	b   []byte
	err error
}

// chunkReader reads a body on a goroutine of its own. The goroutine exits
// after sending the error that ends the body, or when stop is closed;
// chunks is closed as it exits. Its owner closes stop and drains chunks
// (attempt.stopReading) to wait for it.
type chunkReader struct {
	chunks chan chunk
	stop   chan struct{}
}

func readChunks(body io.Reader) *chunkReader {
	cr := &chunkReader{chunks: make(chan chunk), stop: make(chan struct{})}
	go cr.run(body)
	return cr
}

func (cr *chunkReader) run(body io.Reader) {
	defer close(cr.chunks)
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			select {
			case cr.chunks <- chunk{b: bytes.Clone(buf[:n])}:
			case <-cr.stop:
				return
			}
		}
		if err != nil {
			select {
			case cr.chunks <- chunk{err: err}:
			case <-cr.stop:
			}
			return
		}
	}
}
