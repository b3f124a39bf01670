package bootstrap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/pdproto"
)

var t0 = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

func info(rank, tp int, instance string, started time.Time) pdproto.RankInfo {
	return pdproto.RankInfo{
		Rank: rank, TPSize: tp, Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 17000+rank),
		PageSize: 16, KVDType: "bf16", IndexKDType: "fp8", Model: "pdkit-builtin-llama-dsa-tiny-seed1",
		Layers: 4, KVHeads: 2, HeadDim: 64, InstanceID: instance, StartedAt: started,
	}
}

func decodeInfo(tp int) pdproto.DecodeInfo {
	return pdproto.DecodeInfo{TPSize: tp, PageSize: 16, KVDType: "bf16", IndexKDType: "fp8",
		Model: "pdkit-builtin-llama-dsa-tiny-seed1", Layers: 4, KVHeads: 2, HeadDim: 64}
}

// testSecret is the cluster secret of the tests' registries and clients.
var testSecret, _ = clusterauth.New("registry tests' cluster secret")

// newServer starts a registry (with testSecret unless opts has a secret).
func newServer(t *testing.T, opts Options) (*Registry, *httptest.Server) {
	t.Helper()
	if opts.Secret == nil {
		opts.Secret = testSecret
	}
	g := NewRegistry(opts)
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, g)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return g, srv
}

// fastClient retries quickly so that tests do not wait for backoffs.
func fastClient() *Client {
	return &Client{MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond, AttemptTimeout: 5 * time.Second, Secret: testSecret}
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func (a answer) err(t *testing.T) pdproto.BootstrapError {
	t.Helper()
	var b pdproto.BootstrapErrorBody
	if err := json.Unmarshal(a.body, &b); err != nil || b.Error.Code == "" || b.Error.Message == "" {
		t.Fatalf("%d answer is not a JSON error body: %s (%v)", a.status, a.body, err)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	return b.Error
}

// send sends a request, a PUT signed with testSecret.
func send(t *testing.T, method, url string, body []byte) answer {
	t.Helper()
	return sendAs(t, testSecret, method, url, body)
}

// sendAs sends a request, a PUT signed with secret (nil: unsigned).
func sendAs(t *testing.T, secret *clusterauth.Secret, method, url string, body []byte) answer {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if method == http.MethodPut {
		secret.SignRequest(req, body, time.Now(), RegistryTarget)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, data}
}

func put(t *testing.T, srv *httptest.Server, r pdproto.RankInfo) answer {
	t.Helper()
	body, err := json.Marshal(pdproto.RegisterRequest{RankInfo: r})
	if err != nil {
		t.Fatal(err)
	}
	return send(t, http.MethodPut, fmt.Sprintf("%s/bootstrap/v1/ranks/%d", srv.URL, r.Rank), body)
}

func lookup(t *testing.T, srv *httptest.Server) answer {
	t.Helper()
	return send(t, http.MethodGet, srv.URL+pdproto.BootstrapRanksPath, nil)
}

func TestLookupNotReadyUntilComplete(t *testing.T) {
	_, srv := newServer(t, Options{})
	a := lookup(t, srv)
	if a.status != http.StatusServiceUnavailable || a.header.Get("Retry-After") != "1" {
		t.Fatalf("empty registry: %d Retry-After %q", a.status, a.header.Get("Retry-After"))
	}
	if e := a.err(t); e.Code != pdproto.CodeNotReady || e.TPSize != 0 {
		t.Errorf("empty registry: %+v", e)
	}
	for _, r := range []int{2, 0} {
		if a := put(t, srv, info(r, 3, fmt.Sprint("i", r), t0)); a.status != http.StatusOK {
			t.Fatalf("register %d: %d %s", r, a.status, a.body)
		}
	}
	a = lookup(t, srv)
	if a.status != http.StatusServiceUnavailable {
		t.Fatalf("2 of 3: %d %s", a.status, a.body)
	}
	e := a.err(t)
	if e.Registered != 2 || e.TPSize != 3 || fmt.Sprint(e.Missing) != "[1]" || !strings.Contains(e.Message, "2 of 3") {
		t.Errorf("2 of 3: %+v", e)
	}
	var h pdproto.BootstrapHealth
	if a := send(t, http.MethodGet, srv.URL+pdproto.BootstrapHealthPath, nil); a.status != 200 || json.Unmarshal(a.body, &h) != nil || h.Complete || h.Registered != 2 {
		t.Errorf("health while incomplete: %d %s", a.status, a.body)
	}

	a = put(t, srv, info(1, 3, "i1", t0))
	var rr pdproto.RegisterResponse
	if a.status != 200 || json.Unmarshal(a.body, &rr) != nil || !rr.Complete || rr.Registered != 3 || rr.Replaced {
		t.Fatalf("last registration: %d %s", a.status, a.body)
	}
	a = lookup(t, srv)
	var lr pdproto.LookupResponse
	if a.status != http.StatusOK || json.Unmarshal(a.body, &lr) != nil {
		t.Fatalf("complete: %d %s", a.status, a.body)
	}
	if !lr.Complete || lr.TPSize != 3 || len(lr.Ranks) != 3 {
		t.Fatalf("complete: %+v", lr)
	}
	for i, r := range lr.Ranks {
		if !r.Same(info(i, 3, fmt.Sprint("i", i), t0)) {
			t.Errorf("ranks[%d] = %+v", i, r)
		}
	}
}

func TestConfiguredTPSize(t *testing.T) {
	_, srv := newServer(t, Options{TPSize: 2, RetryAfter: 2500 * time.Millisecond})
	a := lookup(t, srv)
	if e := a.err(t); a.status != 503 || e.TPSize != 2 || fmt.Sprint(e.Missing) != "[0 1]" || a.header.Get("Retry-After") != "3" {
		t.Errorf("%d %+v Retry-After %q", a.status, e, a.header.Get("Retry-After"))
	}
	a = put(t, srv, info(0, 4, "i0", t0))
	if e := a.err(t); a.status != http.StatusConflict || e.Field != "tp_size" ||
		!strings.Contains(e.Message, "tp_size 4 but this prefill server runs tp_size 2") {
		t.Errorf("tp_size against the configured one: %d %+v", a.status, e)
	}
}

func TestConcurrentRegistration(t *testing.T) {
	const tp = 4
	g, srv := newServer(t, Options{TPSize: tp})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := fastClient()
	var wg sync.WaitGroup
	errs := make(chan error, 2*tp)
	for r := range tp {
		wg.Go(func() {
			if _, err := c.Register(ctx, srv.URL, info(r, tp, fmt.Sprint("i", r), t0)); err != nil {
				errs <- err
			}
		})
		wg.Go(func() { // lookups race with the registrations
			if _, err := c.Lookup(ctx, srv.URL); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	resp, e := g.Lookup()
	if e != nil || len(resp.Ranks) != tp {
		t.Fatalf("%+v %v", resp, e)
	}
	for i, r := range resp.Ranks {
		if r.Rank != i || r.InstanceID != fmt.Sprint("i", i) {
			t.Errorf("ranks[%d] = %+v", i, r)
		}
	}
}

func TestRestartReplaces(t *testing.T) {
	_, srv := newServer(t, Options{TPSize: 2})
	put(t, srv, info(0, 2, "a0", t0))
	old := info(1, 2, "a1", t0)
	put(t, srv, old)

	// A retry of the same registration changes nothing.
	var rr pdproto.RegisterResponse
	if a := put(t, srv, old); a.status != 200 || json.Unmarshal(a.body, &rr) != nil || rr.Replaced || rr.Registered != 2 {
		t.Fatalf("idempotent retry: %d %s", a.status, a.body)
	}
	// The same instance may not change what it registered.
	changed := old
	changed.Endpoint = "tcp://127.0.0.1:1"
	if a := put(t, srv, changed); a.status != http.StatusConflict || a.err(t).Field != "instance_id" {
		t.Fatalf("same instance, new info: %d %s", a.status, a.body)
	}
	// A restart: new instance id, later start, new endpoint.
	restarted := info(1, 2, "b1", t0.Add(time.Minute))
	restarted.Endpoint = "tcp://127.0.0.1:18001"
	if a := put(t, srv, restarted); a.status != 200 || json.Unmarshal(a.body, &rr) != nil || !rr.Replaced || !rr.Complete {
		t.Fatalf("restart: %d %s", a.status, a.body)
	}
	var lr pdproto.LookupResponse
	if a := lookup(t, srv); a.status != 200 || json.Unmarshal(a.body, &lr) != nil || !lr.Ranks[1].Same(restarted) {
		t.Fatalf("after restart: %d %s", a.status, a.body)
	}
	// The old instance, still alive, cannot take the rank back.
	a := put(t, srv, old)
	if e := a.err(t); a.status != http.StatusConflict || e.Field != "started_at" || !strings.Contains(e.Message, "older instance") {
		t.Fatalf("older instance: %d %+v", a.status, e)
	}
	if a := lookup(t, srv); json.Unmarshal(a.body, &lr) != nil || lr.Ranks[1].InstanceID != "b1" {
		t.Fatalf("older instance changed the entry: %s", a.body)
	}
}

func TestInconsistentRefused(t *testing.T) {
	_, srv := newServer(t, Options{})
	put(t, srv, info(0, 2, "i0", t0))
	for _, tc := range []struct {
		field string
		edit  func(*pdproto.RankInfo)
		want  string
	}{
		{"tp_size", func(r *pdproto.RankInfo) { r.TPSize = 4 }, "rank 1 registers tp_size 4 but rank 0 registered tp_size 2"},
		{"page_size", func(r *pdproto.RankInfo) { r.PageSize = 32 }, "page_size 32"},
		{"kv_dtype", func(r *pdproto.RankInfo) { r.KVDType = "f16" }, `kv_dtype "f16" but rank 0 registered kv_dtype "bf16"`},
		{"index_k_dtype", func(r *pdproto.RankInfo) { r.IndexKDType = "bf16" }, "index_k_dtype"},
		{"model", func(r *pdproto.RankInfo) { r.Model = "other" }, "model"},
		{"layers", func(r *pdproto.RankInfo) { r.Layers = 5 }, "layers"},
		{"kv_heads", func(r *pdproto.RankInfo) { r.KVHeads = 1 }, "kv_heads"},
		{"head_dim", func(r *pdproto.RankInfo) { r.HeadDim = 32 }, "head_dim"},
	} {
		r := info(1, 2, "i1", t0)
		tc.edit(&r)
		a := put(t, srv, r)
		if e := a.err(t); a.status != http.StatusConflict || e.Code != pdproto.CodeConflict || e.Field != tc.field || !strings.Contains(e.Message, tc.want) {
			t.Errorf("%s: %d %+v", tc.field, a.status, e)
		}
	}
	if a := lookup(t, srv); a.status != 503 {
		t.Errorf("refused registrations completed the group: %s", a.body)
	}
	// The only registered rank restarting with a new layout is accepted: it
	// is not compared with its own old entry.
	r := info(0, 2, "j0", t0.Add(time.Second))
	r.PageSize = 64
	if a := put(t, srv, r); a.status != 200 {
		t.Errorf("sole rank restarting with a new layout: %d %s", a.status, a.body)
	}
}

func TestBadInput(t *testing.T) {
	_, srv := newServer(t, Options{})
	good, _ := json.Marshal(info(1, 2, "i1", t0))
	ranks := srv.URL + pdproto.BootstrapRanksPath
	for _, tc := range []struct {
		name, method, url string
		body              string
		status            int
		field             string
	}{
		{"malformed", "PUT", ranks + "/1", `{"rank":1,`, 400, ""},
		{"not an object", "PUT", ranks + "/1", `[1,2]`, 400, ""},
		{"empty", "PUT", ranks + "/1", ``, 400, ""},
		{"trailing", "PUT", ranks + "/1", string(good) + `{}`, 400, ""},
		{"rank type", "PUT", ranks + "/1", strings.Replace(string(good), `"rank":1`, `"rank":"1"`, 1), 400, "rank"},
		{"page size type", "PUT", ranks + "/1", strings.Replace(string(good), `"page_size":16`, `"page_size":16.5`, 1), 400, "page_size"},
		{"started_at type", "PUT", ranks + "/1", strings.Replace(string(good), `"started_at":"`, `"started_at":"x`, 1), 400, ""},
		{"rank out of range", "PUT", ranks + "/2", strings.Replace(string(good), `"rank":1`, `"rank":2`, 1), 400, "rank"},
		{"path rank differs", "PUT", ranks + "/0", string(good), 400, "rank"},
		{"path rank text", "PUT", ranks + "/abc", string(good), 400, "rank"},
		{"path rank negative", "PUT", ranks + "/-1", string(good), 400, "rank"},
		{"path rank padded", "PUT", ranks + "/01", string(good), 400, "rank"},
		{"path rank huge", "PUT", ranks + "/99999999999999999999", string(good), 400, "rank"},
		{"path nested", "PUT", ranks + "/1/x", string(good), 400, "rank"},
		{"missing field", "PUT", ranks + "/1", strings.Replace(string(good), `"model":`, `"x":`, 1), 400, "model"},
		{"too large", "PUT", ranks + "/1", `{"model":"` + strings.Repeat("x", MaxBodyBytes) + `"}`, 413, ""},
		{"unknown route", "GET", srv.URL + "/bootstrap/v1/nope", ``, 404, ""},
		{"lookup by PUT", "PUT", ranks, string(good), 405, ""},
		{"register by GET", "GET", ranks + "/1", ``, 405, ""},
		{"health by POST", "POST", srv.URL + pdproto.BootstrapHealthPath, ``, 405, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := send(t, tc.method, tc.url, []byte(tc.body))
			e := a.err(t)
			if a.status != tc.status || e.Field != tc.field {
				t.Errorf("%d %+v, want %d field %q", a.status, e, tc.status, tc.field)
			}
			if a.status == 405 && a.header.Get("Allow") == "" {
				t.Error("405 without Allow")
			}
		})
	}
	if a := lookup(t, srv); a.status != 503 || a.err(t).Registered != 0 {
		t.Errorf("bad input registered something: %s", a.body)
	}
}

func TestClientLookupWaitsForLastRank(t *testing.T) {
	g, srv := newServer(t, Options{TPSize: 2})
	if _, e := g.Register(info(0, 2, "i0", t0)); e != nil {
		t.Fatal(e)
	}
	notReady := make(chan struct{})
	var once sync.Once
	var retries atomic.Int32
	c := fastClient()
	c.OnRetry = func(_ int, err error) {
		var be *pdproto.BootstrapError
		if errors.As(err, &be) && be.Status == http.StatusServiceUnavailable {
			retries.Add(1)
			once.Do(func() { close(notReady) })
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type result struct {
		ranks []pdproto.RankInfo
		err   error
	}
	done := make(chan result, 1)
	go func() {
		r, err := c.Lookup(ctx, srv.URL+"/")
		done <- result{r, err}
	}()
	select {
	case <-notReady:
	case <-ctx.Done():
		t.Fatal("no 503 observed")
	}
	select {
	case r := <-done:
		t.Fatalf("lookup returned before the last rank registered: %+v", r)
	default:
	}
	if _, e := g.Register(info(1, 2, "i1", t0)); e != nil {
		t.Fatal(e)
	}
	select {
	case r := <-done:
		if r.err != nil || len(r.ranks) != 2 || r.ranks[1].InstanceID != "i1" {
			t.Fatalf("%+v %v", r.ranks, r.err)
		}
	case <-ctx.Done():
		t.Fatal("lookup did not return after the last registration")
	}
	if retries.Load() < 1 {
		t.Error("no retry counted")
	}
}

// handlerTransport serves a client's requests with a handler, in memory:
// a test in a synctest bubble has no sockets, whose waits would keep the
// bubble's clock from moving.
type handlerTransport struct{ h http.Handler }

func (ht handlerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if err := req.Context().Err(); err != nil {
		return nil, err
	}
	rec := httptest.NewRecorder()
	ht.h.ServeHTTP(rec, req)
	resp := rec.Result()
	resp.Request = req
	return resp, nil
}

// refusedTransport fails every request as a dial to nothing listening does.
type refusedTransport struct{}

func (refusedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	return nil, errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
}

// A lookup retries until its context ends, and the error says so and
// carries the last 503. It runs in a synctest bubble against an in-memory
// registry: the 100ms deadline and the backoffs pass on the bubble's
// clock, so a loaded machine cannot let the deadline pass before the
// first answer.
func TestClientLookupGivesUp(t *testing.T) {
	synctest.Test(t, testClientLookupGivesUp)
}

func testClientLookupGivesUp(t *testing.T) {
	const deadline = 100 * time.Millisecond
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, NewRegistry(Options{TPSize: 2, Secret: testSecret}))
	c := fastClient()
	c.HTTP = &http.Client{Transport: handlerTransport{mux}}
	var attempts atomic.Int32
	c.OnRetry = func(int, error) { attempts.Add(1) }
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	_, err := c.Lookup(ctx, "http://registry.test")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want a deadline error, got %v", err)
	}
	var be *pdproto.BootstrapError
	if !errors.As(err, &be) || be.Code != pdproto.CodeNotReady || be.RetryAfter != time.Second {
		t.Errorf("the error should carry the last 503: %v", err)
	}
	// Backoffs of 1ms to 10ms within 100ms: several attempts, and the
	// lookup gave up at its deadline, not later.
	if n := attempts.Load(); n < 5 {
		t.Errorf("%d attempts retried before the deadline, want backoffs of at most 10ms", n)
	}
	if d := time.Since(start); d != deadline {
		t.Errorf("gave up after %v, want the %v deadline", d, deadline)
	}

	// Nothing listening: retried until the deadline too.
	c = fastClient()
	c.HTTP = &http.Client{Transport: refusedTransport{}}
	ctx2, cancel2 := context.WithTimeout(context.Background(), deadline)
	defer cancel2()
	start = time.Now()
	if _, err := c.Lookup(ctx2, "http://registry.test"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("no server: %v", err)
	}
	if d := time.Since(start); d != deadline {
		t.Errorf("no server: gave up after %v, want the %v deadline", d, deadline)
	}
}

func TestClientRegister(t *testing.T) {
	g, srv := newServer(t, Options{TPSize: 2})
	// A 5xx is retried; the first two attempts fail.
	var calls atomic.Int32
	flaky := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 2 {
			http.Error(w, "warming up", http.StatusBadGateway)
			return
		}
		g.ServeHTTP(w, r)
	}))
	defer flaky.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := fastClient()
	resp, err := c.Register(ctx, flaky.URL, info(0, 2, "i0", t0))
	if err != nil || resp.Rank != 0 || resp.Registered != 1 || resp.Complete || calls.Load() != 3 {
		t.Fatalf("%+v %v after %d calls", resp, err, calls.Load())
	}
	// A refusal is final and comes back at once as a *BootstrapError.
	bad := info(1, 2, "i1", t0)
	bad.PageSize = 8
	_, err = c.Register(ctx, srv.URL, bad)
	var be *pdproto.BootstrapError
	if !errors.As(err, &be) || be.Status != http.StatusConflict || be.Field != "page_size" {
		t.Fatalf("want a 409 on page_size, got %v", err)
	}
	bad = info(3, 2, "i3", t0)
	if _, err = c.Register(ctx, srv.URL, bad); !errors.As(err, &be) || be.Status != 400 || be.Field != "rank" {
		t.Fatalf("want a 400 on rank, got %v", err)
	}
}

func TestClientRejectsBadLookupAnswer(t *testing.T) {
	for name, body := range map[string]string{
		"incomplete":   `{"tp_size":2,"complete":false,"ranks":[]}`,
		"missing rank": `{"tp_size":2,"complete":true,"ranks":[{"rank":0,"tp_size":2}]}`,
		"not json":     `hello`,
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, body)
		}))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if _, err := fastClient().Lookup(ctx, srv.URL); err == nil || ctx.Err() != nil {
			t.Errorf("%s: accepted or retried until the deadline: %v", name, err)
		}
		cancel()
		srv.Close()
	}
}

func TestHandshake(t *testing.T) {
	g, srv := newServer(t, Options{TPSize: 2})
	for r := range 2 {
		if _, e := g.Register(info(r, 2, fmt.Sprint("i", r), t0)); e != nil {
			t.Fatal(e)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := fastClient()
	if ranks, err := c.Handshake(ctx, srv.URL, decodeInfo(2)); err != nil || len(ranks) != 2 {
		t.Fatalf("compatible: %v", err)
	}
	for _, tc := range []struct {
		field string
		edit  func(*pdproto.DecodeInfo)
		want  string
	}{
		{"tp_size", func(d *pdproto.DecodeInfo) { d.TPSize = 1 }, "different TP sizes on prefill and decode are not supported yet"},
		{"page_size", func(d *pdproto.DecodeInfo) { d.PageSize = 32 }, "prefill rank 0 has page_size 16, decode has 32"},
		{"kv_dtype", func(d *pdproto.DecodeInfo) { d.KVDType = "f16" }, "kv_dtype"},
		{"index_k_dtype", func(d *pdproto.DecodeInfo) { d.IndexKDType = "bf16" }, "index_k_dtype"},
		{"model", func(d *pdproto.DecodeInfo) { d.Model = "other" }, "model"},
		{"layers", func(d *pdproto.DecodeInfo) { d.Layers = 2 }, "layers"},
		{"kv_heads", func(d *pdproto.DecodeInfo) { d.KVHeads = 4 }, "kv_heads"},
		{"head_dim", func(d *pdproto.DecodeInfo) { d.HeadDim = 128 }, "head_dim"},
	} {
		local := decodeInfo(2)
		tc.edit(&local)
		_, err := c.Handshake(ctx, srv.URL, local)
		var ie *pdproto.IncompatibleError
		if !errors.As(err, &ie) || !errors.Is(err, pdproto.ErrIncompatible) || ie.Field != tc.field ||
			!strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), srv.URL) {
			t.Errorf("%s: %v", tc.field, err)
		}
	}
}

// FuzzRegister feeds arbitrary paths and bodies to the handler: every
// answer is 200 or 4xx with a JSON body, and nothing panics.
func FuzzRegister(f *testing.F) {
	good, _ := json.Marshal(info(1, 2, "i1", t0))
	f.Add("1", string(good))
	f.Add("0", `{"rank":0,"tp_size":1}`)
	f.Add("x", `{`)
	f.Add("1", `{"rank":1,"tp_size":2,"started_at":null,"layers":-1}`)
	g := NewRegistry(Options{})
	f.Fuzz(func(t *testing.T, rank, body string) {
		req := httptest.NewRequest(http.MethodPut, "/bootstrap/v1/ranks/x", strings.NewReader(body))
		req.URL.Path = pdproto.BootstrapRanksPath + "/" + rank
		w := httptest.NewRecorder()
		g.ServeHTTP(w, req)
		if w.Code != 200 && (w.Code < 400 || w.Code >= 500) {
			t.Fatalf("status %d", w.Code)
		}
		if !json.Valid(w.Body.Bytes()) {
			t.Fatalf("%d answer is not JSON: %q", w.Code, w.Body.String())
		}
		// Lookups stay well-formed whatever was registered.
		lw := httptest.NewRecorder()
		g.ServeHTTP(lw, httptest.NewRequest(http.MethodGet, pdproto.BootstrapRanksPath, nil))
		if lw.Code != 200 && lw.Code != 503 {
			t.Fatalf("lookup status %d", lw.Code)
		}
		if lw.Code == 200 {
			var lr pdproto.LookupResponse
			if err := json.Unmarshal(lw.Body.Bytes(), &lr); err != nil || checkLookup(&lr) != nil {
				t.Fatalf("lookup answer %s: %v", lw.Body.String(), checkLookup(&lr))
			}
		}
	})
}

// TestRedTeamRegistryHijack: a stranger who reaches the bootstrap port
// tries to take rank 0 over with a newer started_at and its own endpoint,
// unsigned, signed with another secret, and replaying a real signature
// over another body; each is refused with 401 and counted, and lookups
// still give the real rank.
func TestRedTeamRegistryHijack(t *testing.T) {
	g, srv := newServer(t, Options{TPSize: 1})
	t0 := time.Now().Add(-time.Minute)
	real := info(0, 1, "real", t0)
	if a := put(t, srv, real); a.status != 200 {
		t.Fatalf("real registration: %d %s", a.status, a.body)
	}
	fake := info(0, 1, "impostor", t0.Add(30*time.Second))
	fake.Endpoint = "tcp://203.0.113.9:5555"
	body, _ := json.Marshal(pdproto.RegisterRequest{RankInfo: fake})
	url := srv.URL + "/bootstrap/v1/ranks/0"
	other, _ := clusterauth.New("a secret of another cluster")
	for name, a := range map[string]answer{
		"unsigned":       sendAs(t, nil, http.MethodPut, url, body),
		"another secret": sendAs(t, other, http.MethodPut, url, body),
	} {
		if a.status != http.StatusUnauthorized || a.err(t).Code != pdproto.CodeUnauthorized {
			t.Errorf("%s: %d %s, want 401 unauthorized", name, a.status, a.body)
		}
	}
	// A real signature over the real body, replayed with the fake body.
	req, _ := http.NewRequest(http.MethodPut, url, bytes.NewReader(body))
	realBody, _ := json.Marshal(pdproto.RegisterRequest{RankInfo: real})
	testSecret.SignRequest(req, realBody, time.Now(), RegistryTarget)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("replayed signature: %d, want 401", resp.StatusCode)
	}
	if got := g.Stats().Unauthenticated; got != 3 {
		t.Errorf("counted %d unauthenticated registrations, want 3", got)
	}
	var lr pdproto.LookupResponse
	if a := lookup(t, srv); a.status != 200 || json.Unmarshal(a.body, &lr) != nil || lr.Ranks[0].InstanceID != "real" {
		t.Fatalf("lookup after the hijack attempts: %d %s", a.status, a.body)
	}
}

// TestRedTeamRegistrySquat: a far-future started_at would keep the rank
// from every real restart; it is refused even when signed, the real
// restart is taken, and a registry without a secret takes no HTTP
// registration at all.
func TestRedTeamRegistrySquat(t *testing.T) {
	now := time.Now() // the registry's clock stands still; signing uses the real one
	g, srv := newServer(t, Options{TPSize: 1, Now: func() time.Time { return now }})
	squat := info(0, 1, "squatter", now.Add(24*time.Hour))
	if a := put(t, srv, squat); a.status != http.StatusConflict || a.err(t).Field != "started_at" {
		t.Fatalf("far-future started_at: %d %s, want 409 on started_at", a.status, a.body)
	}
	if g.Stats().FutureStart != 1 {
		t.Errorf("future starts counted %d, want 1", g.Stats().FutureStart)
	}
	// Within the allowed skew, a real restart is taken.
	if _, e := g.Register(info(0, 1, "real", now.Add(clusterauth.MaxSkew/2))); e != nil {
		t.Fatalf("a restart within the clock skew: %v", e)
	}
	noSecret := NewRegistry(Options{TPSize: 1})
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, noSecret)
	plain := httptest.NewServer(mux)
	defer plain.Close()
	if a := put(t, plain, info(0, 1, "x", time.Now())); a.status != http.StatusForbidden || a.err(t).Code != pdproto.CodeForbidden {
		t.Fatalf("HTTP registration without a cluster secret: %d %s, want 403", a.status, a.body)
	}
}
