package router_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	apiclient "github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// unsignedRefused reads a server's pdkit_pd_refused_reqs_total{reason=
// "unsigned"}.
func unsignedRefused(t *testing.T, client *http.Client, n *clustertest.Node) string {
	t.Helper()
	return metricValue(t, client, n.TS.URL, `pdkit_pd_refused_reqs_total{reason="unsigned"}`)
}

// Servers holding the cluster secret take PD requests only signed with
// it: the router with the secret signs each half and the request is
// served end to end, none refused; a router without it (a stranger's, or
// one deployed without the secret) has its halves refused at once, and
// its client gets an error, not a wait for the transfer timeout.
func TestRedTeamRouterSigns(t *testing.T) {
	secret, _ := clusterauth.Generate()
	cfg := serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: serve.PDConfig{Secret: secret, BootstrapTimeout: 10 * time.Second, TransferTimeout: 10 * time.Second}}
	cc := clustertest.New(t, clustertest.Options{Model: tinyModel(t), Config: cfg,
		Router: router.Options{HealthInterval: 50 * time.Millisecond}})
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	req := body([]int32{5, 6, 7, 8, 9, 10, 11, 12}, 6, false, map[string]any{"ignore_eos": true})

	for _, stream := range []bool{false, true} {
		b := req
		if stream {
			b = body([]int32{5, 6, 7, 8, 9, 10, 11, 12}, 6, true, map[string]any{"ignore_eos": true})
		}
		c, err := complete(context.Background(), client, cc.Router.URL, b)
		if err != nil || c.status != http.StatusOK || c.tokens != 6 {
			t.Fatalf("through the router with the secret (stream %v): %+v %v, want 6 tokens", stream, c, err)
		}
	}
	for _, n := range []*clustertest.Node{cc.Prefill, cc.Decode} {
		if v := unsignedRefused(t, client, n); v != "0" {
			t.Errorf("%s refused %s of the router's requests as unsigned", n.TS.URL, v)
		}
	}

	// A router without the secret in front of the same servers.
	rt, err := router.New(router.Options{Prefill: []string{cc.Prefill.TS.URL}, Decode: []string{cc.Decode.TS.URL},
		HealthInterval: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close() })
	ts := httptest.NewServer(rt)
	t.Cleanup(ts.Close)
	waitfor.For(t, "the unsigned router sees its servers", 20*time.Second, func() bool {
		resp, err := client.Get(ts.URL + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	start := time.Now()
	c, err := complete(context.Background(), client, ts.URL, req)
	took := time.Since(start)
	if err != nil || c.status < 400 || !strings.Contains(c.err, "cluster secret") {
		t.Errorf("through a router without the secret: %+v %v, want an error naming the cluster secret", c, err)
	}
	if took > 5*time.Second {
		t.Errorf("the unsigned request ended after %v: it waited instead of being refused", took)
	}
	// The router sends both halves at once and gives up on the other when
	// one is refused: the other may not have reached its server, and the
	// count of the one that did may trail the client's error.
	waitfor.For(t, "a server counting the unsigned PD request", 10*time.Second, func() bool {
		return unsignedRefused(t, client, cc.Prefill) != "0" || unsignedRefused(t, client, cc.Decode) != "0"
	})
	// The cluster still serves through its own router.
	if c, err := complete(context.Background(), client, cc.Router.URL, req); err != nil || c.status != http.StatusOK {
		t.Errorf("through the router with the secret afterwards: %+v %v", c, err)
	}
}

// recorder is a transport that keeps a copy of every request it sends to
// one host (its body and headers) before sending it.
type recorder struct {
	host string
	mu   sync.Mutex
	reqs []recorded
}

type recorded struct {
	path   string
	header http.Header
	body   []byte
}

func (rc *recorder) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Host == rc.host && r.Method == http.MethodPost && r.Body != nil {
		b, err := io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			return nil, err
		}
		r.Body = io.NopCloser(bytes.NewReader(b))
		rc.mu.Lock()
		rc.reqs = append(rc.reqs, recorded{path: r.URL.Path, header: r.Header.Clone(), body: b})
		rc.mu.Unlock()
	}
	return http.DefaultTransport.RoundTrip(r)
}

// A signed PD request sniffed on its way from the router is good once and
// for its server only: replayed against the same decode it is refused as
// received before, against another server (the prefill) as signed for
// another; both counted as unsigned, and neither reaches an engine.
func TestRedTeamSignedReplay(t *testing.T) {
	secret, _ := clusterauth.Generate()
	cfg := serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: serve.PDConfig{Secret: secret, BootstrapTimeout: 10 * time.Second, TransferTimeout: 10 * time.Second}}
	rec := &recorder{}
	cc := clustertest.New(t, clustertest.Options{Model: tinyModel(t), Config: cfg,
		Router: router.Options{HealthInterval: 50 * time.Millisecond, Client: &http.Client{Transport: rec}}})
	u, _ := url.Parse(cc.Decode.TS.URL)
	rec.mu.Lock()
	rec.host = u.Host
	rec.mu.Unlock()
	client := &http.Client{Timeout: 60 * time.Second}
	if c, err := complete(context.Background(), client, cc.Router.URL, body([]int32{5, 6, 7, 8}, 4, false, map[string]any{"ignore_eos": true})); err != nil || c.status != http.StatusOK {
		t.Fatalf("through the router: %+v %v", c, err)
	}
	rec.mu.Lock()
	if len(rec.reqs) != 1 {
		t.Fatalf("%d requests to the decode recorded, want 1", len(rec.reqs))
	}
	sniffed := rec.reqs[0]
	rec.mu.Unlock()
	replay := func(base string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, base+sniffed.path, bytes.NewReader(sniffed.body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header = sniffed.header.Clone()
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, b := replay(cc.Decode.TS.URL); code != http.StatusUnauthorized || !strings.Contains(b, "received before") {
		t.Errorf("replayed against its decode: %d %s", code, b)
	}
	if code, b := replay(cc.Prefill.TS.URL); code != http.StatusUnauthorized || !strings.Contains(b, "signed for another server") {
		t.Errorf("replayed against the prefill: %d %s", code, b)
	}
	for _, n := range []*clustertest.Node{cc.Prefill, cc.Decode} {
		if v := unsignedRefused(t, client, n); v != "1" {
			t.Errorf("%s counted %s refusals, want 1", n.TS.URL, v)
		}
	}
}

// The router's canaries through a real pair (a TP 1 prefill with HiCache
// on): each is served end to end, signed, cached output equal to the
// computed one, and neither the router's nor the servers' request
// counters see it.
func TestCanariesThroughARealPair(t *testing.T) {
	secret, _ := clusterauth.Generate()
	cfg := serve.Config{PageSize: 4, KVTokens: 1024, MaxRunning: 4,
		PD: serve.PDConfig{Secret: secret, BootstrapTimeout: 10 * time.Second, TransferTimeout: 10 * time.Second}}
	cc := clustertest.New(t, clustertest.Options{Model: tinyModel(t), Config: cfg,
		Router: router.Options{HealthInterval: 50 * time.Millisecond, CanaryInterval: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))}})
	client := &http.Client{Timeout: 30 * time.Second}
	if _, err := apiclient.New(cc.Prefill.TS.URL, secret.AdminToken(), client).SetHiCache(t.Context(), true); err != nil {
		t.Fatal(err)
	}
	var cr debug.ClusterResponse
	waitfor.For(t, "two canaries judged", 30*time.Second, func() bool {
		c, err := apiclient.New(cc.Router.URL, "", client).Cluster(t.Context())
		cr = c
		if err == nil && c.Canaries != nil {
			t.Logf("canaries %+v", c.Canaries.Results)
		}
		return err == nil && c.Canaries != nil && c.Canaries.Results[router.CanaryMatch] >= 2
	})
	t.Logf("canaries %+v", cr.Canaries)
	if n := cr.Canaries.Results[router.CanaryMismatch]; n != 0 {
		t.Fatalf("canaries %+v", cr.Canaries)
	}
	for _, u := range []string{cc.Router.URL, cc.Prefill.TS.URL, cc.Decode.TS.URL} {
		text, err := apiclient.New(u, "", client).Metrics(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(text, "\n") {
			if (strings.HasPrefix(l, "pdkit_router_requests_total{") || strings.HasPrefix(l, "pdkit_requests_total{")) && !strings.HasSuffix(l, " 0") {
				t.Errorf("%s counts a canary: %s", u, l)
			}
		}
	}
}

// A server that restarted faster than the router's health checks can
// see refuses the requests signed for its old id; the router checks it at
// once, finds the new id and routes the request again, before anything
// of it reached the client. Here the prefill's HTTP server is replaced by
// a new one (a new id) over the same engine and address, and the router's
// own checks are an hour apart.
func TestRestartedServerRoutedAgain(t *testing.T) {
	secret, _ := clusterauth.Generate()
	cfg := serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: serve.PDConfig{Secret: secret, BootstrapTimeout: 10 * time.Second, TransferTimeout: 10 * time.Second}}
	m := tinyModel(t)
	var prefillH, decodeH atomic.Pointer[http.Handler]
	swappable := func(cur *atomic.Pointer[http.Handler]) func(http.Handler) http.Handler {
		return func(h http.Handler) http.Handler {
			cur.Store(&h)
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { (*cur.Load()).ServeHTTP(w, r) })
		}
	}
	cc := clustertest.New(t, clustertest.Options{Model: m, Config: cfg, WrapPrefill: swappable(&prefillH), WrapDecode: swappable(&decodeH),
		Router: router.Options{HealthInterval: time.Hour}})
	client := &http.Client{Timeout: 60 * time.Second}
	req := body([]int32{5, 6, 7, 8, 9, 10, 11, 12}, 6, false, map[string]any{"ignore_eos": true})
	if c, err := complete(context.Background(), client, cc.Router.URL, req); err != nil || c.status != http.StatusOK {
		t.Fatalf("before the restart: %+v %v", c, err)
	}
	for i, side := range []struct {
		name string
		node *clustertest.Node
		cur  *atomic.Pointer[http.Handler]
		url  string
	}{{"prefill", cc.Prefill, &prefillH, cc.Registry}, {"decode", cc.Decode, &decodeH, ""}} {
		var restarted http.Handler = server.New(side.node.Eng, m, server.Options{ModelName: "tiny", Loopback: true, ClusterSecret: secret,
			BootstrapURL: side.url, Logger: slog.New(slog.DiscardHandler)})
		side.cur.Store(&restarted)
		c, err := complete(context.Background(), client, cc.Router.URL, req)
		if err != nil || c.status != http.StatusOK || c.tokens != 6 {
			t.Fatalf("after the %s restarted unseen: %+v %v; want 6 tokens, the request routed again", side.name, c, err)
		}
		if got, want := metricValue(t, client, cc.Router.URL, "pdkit_router_retries_total"), fmt.Sprint(i+1); got != want {
			t.Errorf("after the %s restarted: pdkit_router_retries_total %s; want %s", side.name, got, want)
		}
	}
}

// metricValue reads the value of a metric (its name and labels as the
// exposition writes them) from base's /metrics.
func metricValue(t *testing.T, client *http.Client, base, name string) string {
	t.Helper()
	resp, err := client.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			return v
		}
	}
	t.Fatalf("%s: no %s on /metrics", base, name)
	return ""
}
