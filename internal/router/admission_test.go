package router

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/syncbuf"
)

func (c *cluster) metricsText(t *testing.T) string {
	t.Helper()
	return readAll(t, c.get(t, "/metrics"))
}

// errorBody reads an OpenAI error body.
func errorBody(t *testing.T, body string) openai.ErrorDetail {
	t.Helper()
	var eb openai.ErrorBody
	if err := json.Unmarshal([]byte(body), &eb); err != nil || eb.Error.Message == "" {
		t.Fatalf("not an OpenAI error body: %q (%v)", body, err)
	}
	return eb.Error
}

func TestQueueDepth(t *testing.T) {
	for _, tc := range []struct {
		queued, running, atCheck, inFlight, want int64
	}{
		{0, 0, 0, 0, 0},
		{5, 2, 0, 0, 5},    // others' requests, as the server reported them
		{0, 0, 0, 7, 7},    // a burst since the check: the router's own count
		{3, 1, 4, 10, 9},   // reported, plus the 6 sent since
		{3, 1, 10, 4, 3},   // finished since: no credit below what was reported
		{0, 2, 0, 0, 0},    // running is not queued
		{0, 2, 8, 8, 6},    // sent before the check, not there yet: in flight less running
		{10, 0, 8, 12, 14}, // both: reported 10 (others' too) and 4 more sent
	} {
		u := &upstream{queued: tc.queued, running: tc.running, inFlightAtCheck: tc.atCheck}
		u.inFlight.Store(tc.inFlight)
		if got := u.queueDepth(); got != tc.want {
			t.Errorf("%+v: depth %d", tc, got)
		}
	}
	for d, want := range map[time.Duration]string{0: "1", 10 * time.Millisecond: "1", time.Second: "1", 1500 * time.Millisecond: "2", time.Hour: "30"} {
		if got := retryAfterSeconds(d); got != want {
			t.Errorf("Retry-After for %v: %s, want %s", d, got, want)
		}
	}
}

// TestStartingAnswers503: until its first round of health checks has ended
// the router answers 503 with Retry-After, saying it is starting, not that
// no server is healthy.
func TestStartingAnswers503(t *testing.T) {
	gate := make(chan struct{})
	p := newStub(t, pdproto.RolePrefill, func(s *stub) { s.healthGate = gate })
	d := newStub(t, pdproto.RoleDecode, nil)
	rt, err := New(Options{Prefill: []string{p.url()}, Decode: []string{d.url()}, HealthInterval: 10 * time.Millisecond,
		HealthTimeout: time.Minute, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(rt)
	t.Cleanup(func() {
		srv.Close()
		rt.Close()
	})
	c := &cluster{rt: rt, srv: srv}
	resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x"}`)
	body := readAll(t, resp)
	if e := errorBody(t, body); resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(e.Message, "starting") {
		t.Errorf("before the first round: %d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	resp = c.get(t, "/health")
	if body := readAll(t, resp); resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || !strings.Contains(body, `"status":"starting"`) {
		t.Errorf("health before the first round: %d %s", resp.StatusCode, body)
	}
	if cr := c.clusterState(t); cr.Ready {
		t.Error("cluster listing says ready before the first round")
	}
	if p.count()+d.count() != 0 {
		t.Errorf("servers got requests before the first round")
	}
	close(gate)
	c.waitFor(t, "ready", func(cr debug.ClusterResponse) bool {
		return cr.Ready && cr.HealthyPrefill == 1 && cr.HealthyDecode == 1
	})
	c.call(t, `{"prompt":"x"}`, 0)
	if m := c.metricsText(t); !strings.Contains(m, `pdkit_router_requests_total{outcome="starting"} 1`) {
		t.Errorf("metrics:\n%s", m)
	}
}

// holding makes a decode stub answer a stream with one event, then hold it
// until release is closed, then finish it.
func holding(release chan struct{}) func(*stub) {
	return func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			openai.WriteEvent(w, map[string]any{"id": "cmpl-9", "choices": []any{map[string]any{"text": "a"}}})
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
			openai.WriteEvent(w, map[string]any{"id": "cmpl-9", "choices": []any{map[string]any{"text": "b"}}})
			openai.WriteDone(w)
		}
	}
}

// TestAdmissionRefusesAtTheEdge: with no health check between them, a
// burst is admitted up to the bound by the router's own count and the rest
// is answered 429 with Retry-After at once, sending nothing to any server;
// the admitted requests complete.
func TestAdmissionRefusesAtTheEdge(t *testing.T) {
	release := make(chan struct{})
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, holding(release))
	c := start(t, []*stub{p}, []*stub{d}, func(o *Options) {
		o.HealthInterval = time.Hour
		o.MaxQueued = 3
	})
	type result struct {
		status int
		body   string
	}
	admitted := make(chan result, 3)
	for range 3 {
		resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x","stream":true}`)
		br := bufio.NewReader(resp.Body)
		if _, err := br.ReadString('\n'); err != nil || resp.StatusCode != 200 {
			t.Fatalf("admitted request: %d %v", resp.StatusCode, err)
		}
		go func() {
			defer resp.Body.Close()
			b, _ := io.ReadAll(br)
			admitted <- result{resp.StatusCode, string(b)}
		}()
	}
	if n := d.count(); n != 3 {
		t.Fatalf("decode got %d requests, want 3", n)
	}
	// The prefill side has answered: only the decode server is full.
	c.waitFor(t, "the prefill side answered", func(cr debug.ClusterResponse) bool { return server(cr, p.url()).InFlight == 0 })
	for range 5 {
		start := time.Now()
		resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x","stream":true}`)
		body := readAll(t, resp)
		e := errorBody(t, body)
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "30" || e.Code == nil || *e.Code != "overloaded" ||
			!strings.Contains(e.Message, "decode") || !strings.Contains(e.Message, "3 requests") {
			t.Fatalf("past the bound: %d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("the refusal took %v", el)
		}
	}
	// Nothing of the refused requests reached a server.
	p.waitRequests(t, 3)
	if p.count() != 3 || d.count() != 3 {
		t.Errorf("servers got %d and %d requests, want 3 each", p.count(), d.count())
	}
	cr := c.clusterState(t)
	if s := server(cr, d.url()); s.Queued != 3 || cr.MaxQueued != 3 {
		t.Errorf("decode listed as %+v (max queued %d)", s, cr.MaxQueued)
	}
	m := c.metricsText(t)
	for _, want := range []string{`pdkit_router_requests_total{outcome="overloaded"} 5`, `pdkit_router_admission_refusals_total{role="decode"} 5`,
		`pdkit_router_server_queued_requests{role="decode",server="` + d.url() + `"} 3`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	close(release)
	for range 3 {
		if r := <-admitted; r.status != 200 || !strings.HasSuffix(r.body, "data: [DONE]\n\n") {
			t.Errorf("admitted request ended %d %q", r.status, r.body)
		}
	}
	c.settle(t, 0)
	c.call(t, `{"prompt":"x"}`, 0) // room again
}

// TestBusyServerGetsNothingNew: a server that says it is busy (a request
// waited past its --max-queue-age) stays healthy but admits nothing until
// it says otherwise; another decode server takes the work, and with none
// left the request is answered 429.
func TestBusyServerGetsNothingNew(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	d1 := newStub(t, pdproto.RoleDecode, nil)
	d2 := newStub(t, pdproto.RoleDecode, nil)
	c := start(t, []*stub{p}, []*stub{d1, d2}, func(o *Options) { o.HealthInterval = time.Hour })
	busy := `{"status":"busy","reason":"a request has waited 12s for admission (limit 10s)","queued":1,"running":8}`
	d1.healthBody.Store(&busy)
	c.rt.CheckNow(t.Context())
	cr := c.clusterState(t)
	if s := server(cr, d1.url()); !s.Healthy || !s.Busy || s.Running != 8 || s.Queued != 1 {
		t.Fatalf("busy server listed as %+v", s)
	}
	for range 4 {
		c.call(t, `{"prompt":"x"}`, 0)
	}
	if d1.count() != 0 || d2.count() != 4 {
		t.Fatalf("busy d1 got %d, d2 %d", d1.count(), d2.count())
	}
	d2.healthBody.Store(&busy)
	c.rt.CheckNow(t.Context())
	resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x"}`)
	body := readAll(t, resp)
	if e := errorBody(t, body); resp.StatusCode != 429 || !strings.Contains(e.Message, "busy: a request has waited 12s") {
		t.Errorf("both busy: %d %s", resp.StatusCode, body)
	}
	if m := c.metricsText(t); !strings.Contains(m, `pdkit_router_server_busy{role="decode",server="`+d1.url()+`"} 1`) {
		t.Errorf("metrics:\n%s", m)
	}
	ok := `{"status":"ok","queued":0,"running":0}`
	d1.healthBody.Store(&ok)
	c.rt.CheckNow(t.Context())
	c.call(t, `{"prompt":"x"}`, 0)
	if d1.count() != 1 {
		t.Errorf("d1 got %d after it was no longer busy", d1.count())
	}
}

// TestClientErrorsAreNotUpstreamErrors: a server's 4xx is the client's
// error, passed through, counted as client_error and not logged at WARN;
// a 5xx is an upstream error, counted per server and logged at WARN.
func TestClientErrorsAreNotUpstreamErrors(t *testing.T) {
	var mu sync.Mutex
	decodeStatus := 200
	p := newStub(t, pdproto.RolePrefill, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			if body["bad"] == true {
				openai.InvalidRequest("temperature", "temperature must be at most 2").WriteJSON(w)
				return
			}
			w.Write([]byte(`{"id":"prefill","choices":[]}`))
		}
	})
	d := newStub(t, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			mu.Lock()
			status := decodeStatus
			mu.Unlock()
			switch {
			case body["bad"] == true:
				<-r.Context().Done() // waits for KV that will not come
			case status == 200:
				json.NewEncoder(w).Encode(map[string]any{"id": "cmpl-1", "choices": []any{}})
			default:
				(&openai.Error{Status: status, Type: openai.TypeServer, Message: fmt.Sprintf("status %d", status)}).WriteJSON(w)
			}
		}
	})
	logs := &syncbuf.Buffer{}
	c := start(t, []*stub{p}, []*stub{d}, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x","bad":true}`)
	body := readAll(t, resp)
	if e := errorBody(t, body); resp.StatusCode != 400 || e.Param == nil || *e.Param != "temperature" {
		t.Fatalf("prefill's 400: %d %s", resp.StatusCode, body)
	}
	for _, status := range []int{404, 500} {
		mu.Lock()
		decodeStatus = status
		mu.Unlock()
		resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x"}`)
		if body := readAll(t, resp); resp.StatusCode != status {
			t.Fatalf("decode's %d: %d %s", status, resp.StatusCode, body)
		}
	}
	c.settle(t, 0)
	m := c.metricsText(t)
	for _, want := range []string{`pdkit_router_requests_total{outcome="client_error"} 2`, `pdkit_router_requests_total{outcome="upstream_error"} 1`,
		`pdkit_router_upstream_errors_total{role="decode",server="` + d.url() + `"} 1`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if strings.Contains(m, `pdkit_router_upstream_errors_total{role="prefill"`) {
		t.Errorf("the prefill's 400 counted as its error:\n%s", m)
	}
	l := logs.String()
	if n := strings.Count(l, "level=WARN"); n != 1 || !strings.Contains(l, "status=500") {
		t.Errorf("want one WARN, for the 500:\n%s", l)
	}
}

// readCut reads a stream to its end and returns the message of its error
// event ("" without one). The stream must end cleanly: no read error.
func readCut(t *testing.T, resp *http.Response) (msg string, done bool) {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("the stream did not end cleanly: %v (read %q)", err, b)
	}
	for _, ev := range strings.Split(string(b), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		var eb openai.ErrorBody
		if strings.HasPrefix(data, `{"error":`) {
			if err := json.Unmarshal([]byte(data), &eb); err != nil || eb.Error.Type != openai.TypeServer {
				t.Fatalf("error event %q: %v", data, err)
			}
			if msg != "" {
				t.Fatalf("two error events: %q", b)
			}
			msg = eb.Error.Message
		}
	}
	return msg, done
}

// TestCutStreamsEndWithAnErrorEvent: a stream cut before its end (a decode
// server that dies or ends it early, the router's shutdown) ends with one
// SSE error event and a clean end of the response, so that the client
// knows it was cut; a server's own error event passes through. An abort is
// no failure: it ends with finish_reason "abort" and [DONE], counted as
// aborted, whether the router's own or the server's.
func TestCutStreamsEndWithAnErrorEvent(t *testing.T) {
	for _, tc := range []struct {
		name    string
		decode  func(w http.ResponseWriter, r *http.Request)
		act     func(t *testing.T, c *cluster, resp *http.Response)
		want    string
		outcome string
	}{
		{name: "decode dies", decode: func(w http.ResponseWriter, r *http.Request) {
			openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "a"}}})
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close() // mid-chunk: as a process that died
			}
		}, want: "failed mid-stream", outcome: outcomeUpstreamError},
		{name: "decode ends early", decode: func(w http.ResponseWriter, r *http.Request) {
			openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "a"}}})
		}, want: "ended the stream before its end", outcome: outcomeUpstreamError},
		{name: "server error event", decode: func(w http.ResponseWriter, r *http.Request) {
			openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "a"}}})
			openai.WriteEvent(w, openai.ServerError("the request was aborted in the server").Body())
			openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "", "finish_reason": "abort"}}})
			openai.WriteDone(w)
		}, want: "aborted in the server", outcome: outcomeUpstreamError},
		{name: "abort", act: func(t *testing.T, c *cluster, resp *http.Response) {
			aresp := c.post(t, context.Background(), "/abort_request", fmt.Sprintf(`{"rid":%q}`, resp.Header.Get(RequestIDHeader)))
			if b := readAll(t, aresp); aresp.StatusCode != 200 {
				t.Fatalf("abort: %d %s", aresp.StatusCode, b)
			}
		}, want: "", outcome: outcomeAborted},
		{name: "server abort", decode: func(w http.ResponseWriter, r *http.Request) {
			openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "a"}}})
			openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "", "finish_reason": "abort"}}})
			openai.WriteDone(w)
		}, want: "", outcome: outcomeAborted},
		{name: "shutdown", act: func(t *testing.T, c *cluster, resp *http.Response) {
			if n := c.rt.Cut(); n != 1 {
				t.Errorf("Cut ended %d requests, want 1", n)
			}
		}, want: "the router shut down", outcome: outcomeShutdown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newStub(t, pdproto.RolePrefill, blocking)
			d := newStub(t, pdproto.RoleDecode, func(s *stub) {
				s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
					w.Header().Set("Content-Type", "text/event-stream")
					if tc.decode != nil {
						tc.decode(w, r)
						return
					}
					openai.WriteEvent(w, map[string]any{"id": "cmpl-5", "choices": []any{map[string]any{"text": "a"}}})
					<-r.Context().Done()
				}
			})
			c := start(t, []*stub{p}, []*stub{d}, func(o *Options) { o.HealthInterval = time.Hour })
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp := c.post(t, ctx, "/v1/completions", `{"prompt":"x","stream":true}`)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			if tc.act != nil {
				d.waitRequests(t, 1)
				tc.act(t, c, resp)
			}
			msg, done := readCut(t, resp)
			aborted := tc.outcome == outcomeAborted
			switch {
			case aborted && (msg != "" || !done):
				t.Errorf("an aborted stream: error event %q, [DONE] %v; want no error event and [DONE]", msg, done)
			case !aborted && !strings.Contains(msg, tc.want):
				t.Errorf("error event %q, want %q", msg, tc.want)
			case !aborted && tc.name != "server error event" && done:
				t.Error("a cut stream ended with [DONE]")
			}
			c.settle(t, 0)
			if m := c.metricsText(t); !strings.Contains(m, `pdkit_router_requests_total{outcome="`+tc.outcome+`"} 1`) {
				t.Errorf("outcome %s not counted:\n%s", tc.outcome, m)
			}
		})
	}
}

func TestStreamMeter(t *testing.T) {
	m := streamMeter{sse: true}
	stream := `data: {"choices":[{"delta":{"role":"assistant","content":""}}]}` + "\n\n" +
		`data: {"choices":[{"delta":{"content":"He"}}]}` + "\n\n" +
		`data: {"choices":[{"text":"llo"}]}` + "\n\n" +
		`data: {"choices":[{"text":"","finish_reason":"length"}]}` + "\n\n" +
		`data: {"choices":[],"usage":{"completion_tokens":2}}` + "\n\n" +
		"data: [DONE]\n\n"
	tokens := 0
	for i := 0; i < len(stream); i += 7 { // split anywhere
		tokens += m.add([]byte(stream[i:min(i+7, len(stream))]))
	}
	if tokens != 2 || !m.done || m.errored {
		t.Errorf("tokens %d done %v errored %v", tokens, m.done, m.errored)
	}
	m = streamMeter{sse: true}
	m.add([]byte("data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\"}}\r\n\r\n"))
	m.add([]byte("data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\"}}\n\n"))
	if !m.errored || m.errMsg != "boom" || m.done {
		t.Errorf("%+v", m)
	}
	if n := (&streamMeter{}).add([]byte(`{"choices":[{"text":"x"}]}` + "\n\n")); n != 0 {
		t.Errorf("a JSON answer metered as %d tokens", n)
	}
}
