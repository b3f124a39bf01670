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
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// stub stands in for a prefill or decode server: it answers /health and
// /pd/v1/info, records the generation bodies it gets, and serves them with
// gen (a default answer when nil).
type stub struct {
	role    string
	srv     *httptest.Server
	healthy atomic.Bool
	// infoRole is the role /pd/v1/info reports (default: role).
	infoRole string
	gen      func(w http.ResponseWriter, r *http.Request, body map[string]any)
	cancels  chan string // the path of every generation request whose context ended early
	// healthGate, when set, holds every /health answer until it is closed.
	healthGate chan struct{}
	// healthBody, when set, is the /health answer (200).
	healthBody atomic.Pointer[string]
	// bound is the prompt bound /pd/v1/info reports (none when zero).
	bound openai.PromptBound

	mu     sync.Mutex
	bodies []map[string]any
	n      int
}

func newStub(t *testing.T, role string, setup func(*stub)) *stub {
	t.Helper()
	s := &stub{role: role, cancels: make(chan string, 1024)}
	s.healthy.Store(true)
	if setup != nil {
		setup(s)
	}
	s.srv = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *stub) url() string { return s.srv.URL }

func (s *stub) serve(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		if s.healthGate != nil {
			select {
			case <-s.healthGate:
			case <-r.Context().Done():
				return
			}
		}
		if !s.healthy.Load() {
			http.Error(w, `{"status":"unhealthy","reason":"stub says so"}`, http.StatusServiceUnavailable)
			return
		}
		if b := s.healthBody.Load(); b != nil {
			w.Write([]byte(*b))
			return
		}
		w.Write([]byte(`{"status":"ok"}`))
		return
	case pdproto.InfoPath:
		role := s.infoRole
		if role == "" {
			role = s.role
		}
		info := pdproto.ServerInfo{Role: role, Model: "stub-model", TPSize: 2, ContextTokens: s.bound.ContextTokens, TokenBytes: s.bound.TokenBytes}
		if role == pdproto.RolePrefill {
			info.BootstrapURL = "http://bootstrap.for" + strings.TrimPrefix(s.srv.URL, "http://")
		}
		json.NewEncoder(w).Encode(info)
		return
	case "/v1/models":
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"object":"list","data":[{"id":"stub-model","object":"model","created":1,"owned_by":"pdkit"}]}`))
		return
	}
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	s.bodies = append(s.bodies, body)
	s.n++
	s.mu.Unlock()
	defer func() {
		if r.Context().Err() != nil {
			s.cancels <- r.URL.Path
		}
	}()
	if s.gen != nil {
		s.gen(w, r, body)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if s.role == pdproto.RolePrefill {
		w.Write([]byte(`{"id":"prefill","choices":[]}`))
		return
	}
	if body["stream"] == true {
		w.Header().Set("Content-Type", "text/event-stream")
		openai.WriteEvent(w, map[string]any{"id": "cmpl-1", "choices": []any{map[string]any{"text": "a"}}})
		openai.WriteEvent(w, map[string]any{"id": "cmpl-1", "choices": []any{map[string]any{"text": "b"}}})
		openai.WriteDone(w)
		return
	}
	json.NewEncoder(w).Encode(map[string]any{"id": "cmpl-1", "object": "text_completion", "choices": []any{map[string]any{"text": "ab"}}})
}

func (s *stub) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

func (s *stub) lastBodies() []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]map[string]any(nil), s.bodies...)
}

// waitRequests waits until the stub has received n generation requests.
func (s *stub) waitRequests(t *testing.T, n int) {
	t.Helper()
	waitfor.NoError(t, fmt.Sprintf("the %s stand-in's requests", s.role), 5*time.Second, func() error {
		if got := s.count(); got < n {
			return fmt.Errorf("%d, want %d", got, n)
		}
		return nil
	})
}

// waitCancel waits until the stub has seen a request's context end.
func (s *stub) waitCancel(t *testing.T, what string) {
	t.Helper()
	select {
	case <-s.cancels:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: the %s stand-in never saw its request cancelled", what, s.role)
	}
}

type cluster struct {
	rt  *Router
	srv *httptest.Server
	// client reaches srv (default http.DefaultClient).
	client *http.Client
	// bubble says the cluster runs in a synctest bubble (startMem).
	bubble bool
}

func (c *cluster) httpClient() *http.Client {
	if c.client != nil {
		return c.client
	}
	return http.DefaultClient
}

// start runs a router over the stubs and waits until every stub that
// reports healthy is up; tweaks change the options first.
func start(t *testing.T, prefill, decode []*stub, tweaks ...func(*Options)) *cluster {
	t.Helper()
	var opts Options
	for _, s := range prefill {
		opts.Prefill = append(opts.Prefill, s.url())
	}
	for _, s := range decode {
		opts.Decode = append(opts.Decode, s.url())
	}
	opts.HealthInterval = 10 * time.Millisecond
	opts.CanaryInterval = -1 // the canary tests ask for them
	opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tw := range tweaks {
		tw(&opts)
	}
	rt, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(rt)
	t.Cleanup(func() {
		srv.Close()
		rt.Close()
	})
	c := &cluster{rt: rt, srv: srv}
	c.waitChecked(t)
	return c
}

// waitChecked waits until the router is ready and has checked every
// server once.
func (c *cluster) waitChecked(t *testing.T) {
	t.Helper()
	c.waitFor(t, "every server checked", func(cr debug.ClusterResponse) bool {
		if !cr.Ready {
			return false
		}
		for _, s := range cr.Servers {
			if s.LastCheck == nil {
				return false
			}
		}
		return true
	})
}

func (c *cluster) clusterState(t *testing.T) debug.ClusterResponse {
	t.Helper()
	resp, err := c.httpClient().Get(c.srv.URL + debug.ClusterPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var cr debug.ClusterResponse
	if err := json.NewDecoder(resp.Body).Decode(&cr); err != nil {
		t.Fatal(err)
	}
	return cr
}

// waitFor polls the cluster listing until cond holds, with a deadline.
func (c *cluster) waitFor(t *testing.T, what string, cond func(debug.ClusterResponse) bool) debug.ClusterResponse {
	t.Helper()
	var cr debug.ClusterResponse
	if c.bubble {
		// In a synctest bubble: look once a millisecond of the bubble's
		// clock, where waitfor would first spin with the clock still.
		for start := time.Now(); ; {
			if cr = c.clusterState(t); cond(cr) {
				return cr
			}
			if time.Since(start) > 5*time.Second {
				t.Fatalf("%s: not within 5s: %+v", what, cr)
			}
			// The bubble's clock moves while it sleeps: the next look.
			time.Sleep(time.Millisecond)
		}
	}
	waitfor.NoError(t, what, 5*time.Second, func() error {
		if cr = c.clusterState(t); !cond(cr) {
			return fmt.Errorf("%+v", cr)
		}
		return nil
	})
	return cr
}

// settle waits until the router has want requests in flight over all
// servers, so that the next request's choice depends on nothing left over.
func (c *cluster) settle(t *testing.T, want int64) {
	t.Helper()
	c.waitFor(t, fmt.Sprintf("%d requests in flight", want), func(cr debug.ClusterResponse) bool {
		var n int64
		for _, s := range cr.Servers {
			n += s.InFlight
		}
		return n == want
	})
}

// call sends a non-streamed completion, reads its answer and waits until
// the router is done with it (leaving held requests in flight).
func (c *cluster) call(t *testing.T, body string, held int64) {
	t.Helper()
	resp := c.post(t, context.Background(), "/v1/completions", body)
	if got := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("status %d: %q", resp.StatusCode, got)
	}
	c.settle(t, held)
}

func server(cr debug.ClusterResponse, url string) debug.ClusterServer {
	for _, s := range cr.Servers {
		if s.URL == url {
			return s
		}
	}
	return debug.ClusterServer{}
}

func (c *cluster) post(t *testing.T, ctx context.Context, path, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.httpClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func (c *cluster) get(t *testing.T, path string) *http.Response {
	t.Helper()
	resp, err := c.httpClient().Get(c.srv.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestRoomsAndBodies(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, nil)
	c := start(t, []*stub{p}, []*stub{d})

	const n = 200
	var wg sync.WaitGroup
	errs := make(chan string, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"prompt":"hello %d","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"custom":{"x":[1,2]}}`, i)
			resp := c.post(t, context.Background(), "/v1/completions", body)
			got := readAll(t, resp)
			if resp.StatusCode != 200 || !strings.Contains(got, "data: [DONE]") {
				errs <- fmt.Sprintf("status %d body %q", resp.StatusCode, got)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	// The client may see its answer before the router has heard from the
	// prefill side (which the router then waits for).
	p.waitRequests(t, n)
	pb, db := p.lastBodies(), d.lastBodies()
	if len(pb) != n || len(db) != n {
		t.Fatalf("prefill got %d bodies, decode %d; want %d each", len(pb), len(db), n)
	}
	byPrompt := map[string]float64{}
	rooms := map[float64]bool{}
	for _, b := range pb {
		room, ok := b["bootstrap_room"].(float64)
		if !ok {
			t.Fatalf("prefill body without a bootstrap_room: %v", b)
		}
		if b["stream"] != false {
			t.Errorf("prefill body stream = %v, want false", b["stream"])
		}
		if _, ok := b["stream_options"]; ok {
			t.Errorf("prefill body kept stream_options: %v", b)
		}
		if _, ok := b["bootstrap_url"]; ok {
			t.Errorf("prefill body has a bootstrap_url: %v", b)
		}
		if rooms[room] {
			t.Errorf("room %v given twice", room)
		}
		rooms[room] = true
		byPrompt[b["prompt"].(string)] = room
	}
	wantURL := "http://bootstrap.for" + strings.TrimPrefix(p.url(), "http://")
	for _, b := range db {
		room, ok := b["bootstrap_room"].(float64)
		if !ok || byPrompt[b["prompt"].(string)] != room {
			t.Errorf("decode room %v differs from the prefill's %v", b["bootstrap_room"], byPrompt[b["prompt"].(string)])
		}
		if b["bootstrap_url"] != wantURL {
			t.Errorf("decode bootstrap_url = %v, want %s", b["bootstrap_url"], wantURL)
		}
		if b["stream"] != true || b["stream_options"] == nil || b["custom"] == nil || b["max_tokens"] != 4.0 {
			t.Errorf("decode body lost client fields: %v", b)
		}
	}
	if cr := c.clusterState(t); cr.LiveRooms != 0 {
		t.Errorf("live rooms after the requests = %d", cr.LiveRooms)
	}
}

func TestRoomsUnique(t *testing.T) {
	rs := rooms{live: map[uint64]struct{}{}}
	seen := map[uint64]bool{}
	for range 10000 {
		v := rs.acquire()
		if v == 0 || v >= 1<<53 || seen[v] {
			t.Fatalf("room %d: zero, too large or repeated", v)
		}
		seen[v] = true
	}
	if rs.count() != 10000 {
		t.Fatalf("live rooms %d", rs.count())
	}
}

func TestNonStreamAndChat(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, nil)
	c := start(t, []*stub{p}, []*stub{d})
	for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/generate"} {
		resp := c.post(t, context.Background(), path, `{"messages":[{"role":"user","content":"hi"}],"prompt":"x"}`)
		body := readAll(t, resp)
		if resp.StatusCode != 200 || !strings.Contains(body, `"cmpl-1"`) {
			t.Errorf("%s: status %d body %q", path, resp.StatusCode, body)
		}
		if resp.Header.Get(RequestIDHeader) == "" {
			t.Errorf("%s: no %s header", path, RequestIDHeader)
		}
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s: content type %q", path, ct)
		}
	}
	resp := c.post(t, context.Background(), "/v1/completions", `{"prompt": `)
	if body := readAll(t, resp); resp.StatusCode != 400 || !strings.Contains(body, "invalid_request_error") {
		t.Errorf("malformed body: status %d %q", resp.StatusCode, body)
	}
	resp = c.post(t, context.Background(), "/v1/completions", `[1,2]`)
	if readAll(t, resp); resp.StatusCode != 400 {
		t.Errorf("array body: status %d", resp.StatusCode)
	}
	p.waitRequests(t, 3)
	if p.count() != 3 || d.count() != 3 {
		t.Errorf("stubs got %d and %d requests, want 3 each (malformed ones stay at the router)", p.count(), d.count())
	}
	mresp, err := http.Get(c.srv.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, mresp); mresp.StatusCode != 200 || !strings.Contains(body, "stub-model") {
		t.Errorf("models: %d %q", mresp.StatusCode, body)
	}
	mresp, err = http.Get(c.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, mresp)
	for _, want := range []string{`pdkit_router_requests_total{outcome="ok"} 3`, `pdkit_router_requests_total{outcome="invalid"} 2`,
		"pdkit_router_live_rooms 0", "pdkit_router_in_flight_requests{", "pdkit_router_server_healthy{"} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// TestStreamChunkByChunk checks that the client sees the decode side's
// first event before the decode side sends its second.
func TestStreamChunkByChunk(t *testing.T) {
	gate := make(chan struct{})
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("X-Upstream", "decode")
			openai.WriteEvent(w, map[string]any{"id": "cmpl-42", "n": 1})
			select {
			case <-gate:
			case <-r.Context().Done():
				return
			}
			openai.WriteEvent(w, map[string]any{"id": "cmpl-42", "n": 2})
			openai.WriteDone(w)
		}
	})
	c := start(t, []*stub{p}, []*stub{d})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp := c.post(t, ctx, "/v1/completions", `{"prompt":"x","stream":true}`)
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || resp.Header.Get("X-Upstream") != "decode" {
		t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("first event: %v (the router held the stream back)", err)
	}
	if !strings.Contains(line, `"n":1`) {
		t.Fatalf("first line %q", line)
	}
	close(gate)
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rest), `"n":2`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("rest %q", rest)
	}
}

// blocking makes a stub answer a generation with one event (decode) or
// nothing (prefill), then wait for its client to go away.
func blocking(s *stub) {
	s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		if s.role == pdproto.RoleDecode {
			w.Header().Set("Content-Type", "text/event-stream")
			openai.WriteEvent(w, map[string]any{"id": "cmpl-77", "n": 1})
		}
		<-r.Context().Done()
	}
}

func TestClientDisconnectCancelsBoth(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, blocking)
	d := newStub(t, pdproto.RoleDecode, blocking)
	// No health check after the first: the cancelled calls must not
	// count as the servers' failures.
	c := start(t, []*stub{p}, []*stub{d}, func(o *Options) { o.HealthInterval = time.Hour })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp := c.post(t, ctx, "/v1/completions", `{"prompt":"x","stream":true}`)
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	p.waitRequests(t, 1)
	cancel()
	resp.Body.Close()
	p.waitCancel(t, "client disconnect")
	d.waitCancel(t, "client disconnect")
	cr := c.waitFor(t, "no request in flight", func(cr debug.ClusterResponse) bool {
		return cr.LiveRooms == 0 && cr.Servers[0].InFlight == 0 && cr.Servers[1].InFlight == 0
	})
	for _, s := range cr.Servers {
		if !s.Healthy || s.ConsecutiveFailures != 0 {
			t.Errorf("after a client disconnect: %+v", s)
		}
	}
}

func TestAbortRequest(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, blocking)
	d := newStub(t, pdproto.RoleDecode, blocking)
	c := start(t, []*stub{p}, []*stub{d})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp := c.post(t, ctx, "/v1/completions", `{"prompt":"x","stream":true}`)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	p.waitRequests(t, 1)
	rid := resp.Header.Get(RequestIDHeader)
	aresp := c.post(t, context.Background(), "/abort_request", fmt.Sprintf(`{"rid":%q}`, rid))
	if body := readAll(t, aresp); aresp.StatusCode != 200 {
		t.Fatalf("abort %s: %d %q", rid, aresp.StatusCode, body)
	}
	p.waitCancel(t, "abort")
	d.waitCancel(t, "abort")
	if _, err := io.ReadAll(br); err != nil && ctx.Err() != nil {
		t.Fatalf("the client's stream did not end after the abort: %v", err)
	}
	c.waitFor(t, "no room live", func(cr debug.ClusterResponse) bool { return cr.LiveRooms == 0 })
	aresp = c.post(t, context.Background(), "/abort_request", fmt.Sprintf(`{"rid":%q}`, rid))
	if body := readAll(t, aresp); aresp.StatusCode != 404 || !strings.Contains(body, `"error"`) {
		t.Fatalf("abort of a finished request: %d %q", aresp.StatusCode, body)
	}
}

func TestPrefillErrorBeforeDecodeOutput(t *testing.T) {
	for _, headers := range []bool{false, true} {
		t.Run(fmt.Sprintf("decode_headers=%v", headers), func(t *testing.T) { testPrefillError(t, headers) })
	}
}

func testPrefillError(t *testing.T, headers bool) {
	arrived := make(chan struct{}) // the decode side has the request (and sent its headers)
	p := newStub(t, pdproto.RolePrefill, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			select {
			case <-arrived:
			case <-r.Context().Done():
				return
			}
			(&openai.Error{Status: 500, Type: openai.TypeServer, Message: "prefill exploded"}).WriteJSON(w)
		}
	})
	d := newStub(t, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			if headers {
				// Headers go out at once, as a streaming server's do;
				// no output comes until the KV would have arrived.
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(200)
				w.(http.Flusher).Flush()
			}
			close(arrived)
			<-r.Context().Done()
		}
	})
	c := start(t, []*stub{p}, []*stub{d})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp := c.post(t, ctx, "/v1/completions", `{"prompt":"x","stream":true}`)
	body := readAll(t, resp)
	if resp.StatusCode != 500 || !strings.Contains(body, "prefill exploded") || !strings.Contains(body, openai.TypeServer) {
		t.Fatalf("status %d body %q", resp.StatusCode, body)
	}
	d.waitCancel(t, "prefill failure")
	mresp, err := http.Get(c.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if m := readAll(t, mresp); !strings.Contains(m, `pdkit_router_upstream_errors_total{role="prefill",server="`+p.url()+`"} 1`) ||
		!strings.Contains(m, `pdkit_router_requests_total{outcome="upstream_error"} 1`) {
		t.Errorf("metrics do not count the prefill failure:\n%s", m)
	}
}

func TestLeastLoadedAndRoundRobin(t *testing.T) {
	release := make(chan struct{})
	var held atomic.Int32
	hold := func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			if body["hold"] == true {
				held.Add(1)
				select {
				case <-release:
				case <-r.Context().Done():
				}
			}
			json.NewEncoder(w).Encode(map[string]any{"id": "x"})
		}
	}
	p := newStub(t, pdproto.RolePrefill, nil)
	d1 := newStub(t, pdproto.RoleDecode, hold)
	d2 := newStub(t, pdproto.RoleDecode, hold)
	c := start(t, []*stub{p}, []*stub{d1, d2})
	t.Cleanup(func() { close(release) }) // runs before the stubs close: they wait for it

	// Equal loads alternate.
	for range 4 {
		c.call(t, `{"prompt":"x"}`, 0)
	}
	if d1.count() != 2 || d2.count() != 2 {
		t.Fatalf("round robin: %d and %d", d1.count(), d2.count())
	}
	// One held request loads one decode server; the next ones go to the other.
	done := make(chan struct{})
	go func() {
		defer close(done)
		readAll(t, c.post(t, context.Background(), "/v1/completions", `{"prompt":"x","hold":true}`))
	}()
	c.waitFor(t, "the held request in flight", func(cr debug.ClusterResponse) bool {
		return held.Load() == 1
	})
	busy, idle := d1, d2
	if d2.count() == 3 {
		busy, idle = d2, d1
	}
	c.settle(t, 1)
	for range 3 {
		c.call(t, `{"prompt":"x"}`, 1)
	}
	if busy.count() != 3 || idle.count() != 5 {
		t.Fatalf("least loaded: busy got %d (want 3), idle %d (want 5)", busy.count(), idle.count())
	}
	cr := c.clusterState(t)
	if s := server(cr, busy.url()); s.InFlight != 1 || s.RequestsServed != 3 {
		t.Errorf("busy server listed as %+v", s)
	}
	release <- struct{}{}
	<-done
}

// TestHealthDownAndBack: a server that fails FailThreshold health checks
// in a row leaves the rotation and comes back once it passes one. It runs
// in a synctest bubble over an in-memory network: the checks come every
// HealthInterval of the bubble's clock, so the server is down within
// FailThreshold intervals of failing, however loaded the machine is.
func TestHealthDownAndBack(t *testing.T) {
	synctest.Test(t, testHealthDownAndBack)
}

func testHealthDownAndBack(t *testing.T) {
	m := newMemNet()
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d1 := newMemStub(t, m, pdproto.RoleDecode, nil)
	d2 := newMemStub(t, m, pdproto.RoleDecode, nil)
	c := startMem(t, m, []*stub{p}, []*stub{d1, d2})
	c.waitFor(t, "both decode servers up", func(cr debug.ClusterResponse) bool { return cr.HealthyDecode == 2 })

	d2.healthy.Store(false)
	failed := time.Now()
	cr := c.waitFor(t, "d2 down", func(cr debug.ClusterResponse) bool { return !server(cr, d2.url()).Healthy })
	if s := server(cr, d2.url()); !strings.Contains(s.Reason, "503") || s.ConsecutiveFailures < 2 {
		t.Errorf("down server listed as %+v", s)
	}
	// Two checks (the default FailThreshold) 10ms apart, seen by a look
	// every millisecond.
	if took := time.Since(failed); took < c.rt.opts.HealthInterval || took > 2*c.rt.opts.HealthInterval+time.Millisecond {
		t.Errorf("d2 down %v after it began failing, want within %d checks %v apart", took, c.rt.opts.FailThreshold, c.rt.opts.HealthInterval)
	}
	for range 4 {
		c.call(t, `{"prompt":"x"}`, 0)
	}
	if d2.count() != 0 || d1.count() != 4 {
		t.Fatalf("with d2 down: d1 %d, d2 %d", d1.count(), d2.count())
	}
	d2.healthy.Store(true)
	c.waitFor(t, "d2 back", func(cr debug.ClusterResponse) bool { return server(cr, d2.url()).Healthy })
	for range 4 {
		c.call(t, `{"prompt":"x"}`, 0)
	}
	if d2.count() == 0 {
		t.Fatal("d2 got no request after it came back")
	}
}

func TestRoleMismatchAndCluster(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	wrong := newStub(t, pdproto.RoleDecode, nil) // given as a prefill server
	d := newStub(t, pdproto.RoleDecode, nil)
	c := start(t, []*stub{p, wrong}, []*stub{d})
	cr := c.waitFor(t, "all checked", func(cr debug.ClusterResponse) bool { return cr.HealthyPrefill == 1 && cr.HealthyDecode == 1 })
	if len(cr.Servers) != 3 {
		t.Fatalf("servers %+v", cr.Servers)
	}
	w := server(cr, wrong.url())
	if w.Healthy || w.Role != pdproto.RolePrefill || !strings.Contains(w.Reason, "role mismatch") {
		t.Errorf("mismatched server listed as %+v", w)
	}
	ps := server(cr, p.url())
	if !ps.Healthy || ps.Role != pdproto.RolePrefill || ps.TPSize != 2 || ps.Model != "stub-model" ||
		ps.BootstrapURL == "" || ps.LastCheck == nil || ps.Reason != "" {
		t.Errorf("prefill listed as %+v", ps)
	}
	ds := server(cr, d.url())
	if !ds.Healthy || ds.Role != pdproto.RoleDecode || ds.BootstrapURL != "" {
		t.Errorf("decode listed as %+v", ds)
	}
	for range 3 {
		c.call(t, `{"prompt":"x"}`, 0)
	}
	p.waitRequests(t, 3)
	if wrong.count() != 0 || p.count() != 3 {
		t.Errorf("mismatched server got %d requests, prefill %d", wrong.count(), p.count())
	}
	c.waitFor(t, "prefill done", func(cr debug.ClusterResponse) bool {
		s := server(cr, p.url())
		return s.RequestsServed == 3 && s.InFlight == 0
	})
}

func TestNoHealthyDecode(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, func(s *stub) { s.healthy.Store(false) })
	c := start(t, []*stub{p}, []*stub{d})
	resp, err := http.Get(c.srv.URL + "/health")
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 503 || !strings.Contains(body, "no healthy decode server") {
		t.Errorf("health: %d %q", resp.StatusCode, body)
	}
	resp = c.post(t, context.Background(), "/v1/chat/completions", `{"messages":[]}`)
	body := readAll(t, resp)
	var eb openai.ErrorBody
	if err := json.Unmarshal([]byte(body), &eb); err != nil || resp.StatusCode != 503 || eb.Error.Message != "no healthy decode server" {
		t.Errorf("request: %d %q", resp.StatusCode, body)
	}
	if p.count() != 0 {
		t.Errorf("prefill got %d requests", p.count())
	}
	d.healthy.Store(true)
	c.waitFor(t, "decode up", func(cr debug.ClusterResponse) bool { return cr.HealthyDecode == 1 })
	resp, err = http.Get(c.srv.URL + "/health")
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 200 {
		t.Errorf("health with both up: %d %q", resp.StatusCode, body)
	}
}

func TestRoutesAndPanics(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, nil)
	c := start(t, []*stub{p}, []*stub{d})
	resp, err := http.Get(c.srv.URL + "/v1/completions")
	if err != nil {
		t.Fatal(err)
	}
	if readAll(t, resp); resp.StatusCode != 405 || resp.Header.Get("Allow") != "POST" {
		t.Errorf("GET completions: %d", resp.StatusCode)
	}
	resp, err = http.Get(c.srv.URL + pdproto.InfoPath)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); !strings.Contains(body, `"role":"router"`) {
		t.Errorf("info %q", body)
	}
	// A panicking handler answers 500, not a dropped connection.
	c.rt.mux.Handle("GET", "/boom", func(http.ResponseWriter, *http.Request) { panic("boom") })
	resp, err = http.Get(c.srv.URL + "/boom")
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 500 || !strings.Contains(body, "internal error") {
		t.Errorf("panic: %d %q", resp.StatusCode, body)
	}
}

func TestNewRefusesBadServers(t *testing.T) {
	for _, o := range []Options{
		{Prefill: []string{"http://a:1"}},
		{Decode: []string{"http://a:1"}},
		{Prefill: []string{"a:1"}, Decode: []string{"http://b:1"}},
		{Prefill: []string{"http://a:1"}, Decode: []string{"http://a:1/"}},
	} {
		if rt, err := New(o); err == nil {
			rt.Close()
			t.Errorf("New(%+v) accepted", o)
		}
	}
}

// TestTransportErrorsMarkDown: a prefill server that dies between two
// health checks leaves the rotation after FailThreshold requests fail to
// connect to it (the checks, an hour apart here, play no part); each of
// those is routed again to the live prefill, so every client is served.
func TestTransportErrorsMarkDown(t *testing.T) {
	// The decode stub answers a room only once the live prefill has had
	// it, as a real decode waits for the KV: a room sent to the dead
	// prefill is never answered before the refusal is seen.
	var mu sync.Mutex
	had := map[any]chan struct{}{}
	room := func(body map[string]any) chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		ch := had[body["bootstrap_room"]]
		if ch == nil {
			ch = make(chan struct{})
			had[body["bootstrap_room"]] = ch
		}
		return ch
	}
	live := newStub(t, pdproto.RolePrefill, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			close(room(body))
			w.Write([]byte(`{"id":"prefill","choices":[]}`))
		}
	})
	dead := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			select {
			case <-room(body):
				json.NewEncoder(w).Encode(map[string]any{"id": "cmpl-1", "object": "text_completion", "choices": []any{map[string]any{"text": "ab"}}})
			case <-r.Context().Done():
			}
		}
	})
	c := start(t, []*stub{live, dead}, []*stub{d}, func(o *Options) { o.HealthInterval = time.Hour })
	c.waitFor(t, "both prefill servers up", func(cr debug.ClusterResponse) bool { return cr.HealthyPrefill == 2 })
	dead.srv.Close()

	for range 10 {
		c.call(t, `{"prompt":"x"}`, 0)
	}
	s := server(c.clusterState(t), dead.url())
	if s.RequestsServed != 2 || s.Healthy || !strings.HasPrefix(s.Reason, "request failed: ") || s.ConsecutiveFailures != 2 {
		t.Fatalf("the dead server is listed as %+v", s)
	}
	if live.count() != 10 {
		t.Errorf("the live prefill served %d of 10", live.count())
	}
	if m := readAll(t, c.get(t, "/metrics")); !strings.Contains(m, "pdkit_router_retries_total 2") {
		t.Errorf("metrics:\n%s", m)
	}
}

// TestRefusedWithoutAnother: with no other healthy prefill server, a
// refused connection is the client's 502 (nothing to route again to).
func TestRefusedWithoutAnother(t *testing.T) {
	dead := newStub(t, pdproto.RolePrefill, nil)
	// The decode waits for KV that will never come, as a real one does,
	// until the router cancels it.
	d := newStub(t, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) { <-r.Context().Done() }
	})
	c := start(t, []*stub{dead}, []*stub{d}, func(o *Options) { o.HealthInterval = time.Hour })
	c.waitFor(t, "the prefill up", func(cr debug.ClusterResponse) bool { return cr.HealthyPrefill == 1 })
	dead.srv.Close()
	resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x"}`)
	if body := readAll(t, resp); resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, dead.url()) {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	// The refusal may come before the decode side's request is written;
	// if the decode stand-in got it, it was cancelled.
	c.settle(t, 0)
	if d.count() > 0 {
		d.waitCancel(t, "the prefill's refusal")
	}
	if m := readAll(t, c.get(t, "/metrics")); !strings.Contains(m, "pdkit_router_retries_total 0") {
		t.Errorf("a retry with no other prefill:\n%s", m)
	}
}
