package router_test

// End-to-end tests, over a real cluster, of what the router does at the
// edge: admission (429 with Retry-After past the bound, never half-way),
// the native /generate in PD mode, and the Prometheus expositions.

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

func edgeConfig() serve.Config {
	return serve.Config{PageSize: 4, KVTokens: 1024, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 16}
}

// scrape returns base's /metrics exposition.
func scrape(t *testing.T, client *http.Client, base string) string {
	t.Helper()
	resp, err := client.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%s/metrics: %d %v", base, resp.StatusCode, err)
	}
	return string(b)
}

// TestClusterAdmissionAtTheEdge: with the router's bound lowered to 4, the
// first 4 streaming sessions are admitted (held at the prefill's door by
// the test); every further request is answered 429 with Retry-After at
// once, without reaching a server; once let through, the admitted sessions
// complete and nothing inside the cluster failed or timed out.
func TestClusterAdmissionAtTheEdge(t *testing.T) {
	m := tinyModel(t)
	gate := make(chan struct{})
	var gated atomic.Int32
	wrap := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && r.URL.Path == "/v1/completions" {
				gated.Add(1)
				select {
				case <-gate:
				case <-r.Context().Done():
				}
			}
			h.ServeHTTP(w, r)
		})
	}
	const bound, excess, maxTok = 4, 6, 8
	cc := clustertest.New(t, clustertest.Options{Model: m, Config: edgeConfig(), WrapPrefill: wrap,
		Router:        router.Options{HealthInterval: 50 * time.Millisecond, PrefillGrace: 5 * time.Second, MaxQueued: bound},
		HealthyWithin: 20 * time.Second})
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 60 * time.Second}

	ps := testmodel.Prompts(29, bound, 4, 20, m.Config.VocabSize)
	results := make([]completion, bound)
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Go(func() {
			r, err := complete(t.Context(), client, cc.Router.URL, body(p, maxTok, true, map[string]any{"ignore_eos": true}))
			if err != nil {
				t.Errorf("admitted session %d: %v", i, err)
			}
			results[i] = r
		})
	}
	waitfor.For(t, "the admitted sessions at the prefill's door", 20*time.Second, func() bool { return gated.Load() == bound })

	for i := range excess {
		start := time.Now()
		hr, _ := http.NewRequestWithContext(t.Context(), "POST", cc.Router.URL+"/v1/completions",
			bytes.NewReader(body(ps[i%bound], maxTok, true, nil)))
		resp, err := client.Do(hr)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var eb openai.ErrorBody
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "1" ||
			json.Unmarshal(b, &eb) != nil || eb.Error.Code == nil || *eb.Error.Code != "overloaded" {
			t.Fatalf("request past the bound: %d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
		}
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("the refusal took %v", el)
		}
	}
	if n := gated.Load(); n != bound {
		t.Errorf("%d requests reached the prefill, want %d: refused ones must not", n, bound)
	}
	close(gate)
	wg.Wait()
	for i, r := range results {
		if r.status != 200 || r.tokens != maxTok || r.finish != "length" || r.err != "" {
			t.Errorf("admitted session %d: %+v", i, r)
		}
	}
	// A client has its [DONE] a moment before the router has its end.
	var rm string
	waitfor.For(t, "the router done with the sessions", 10*time.Second, func() bool {
		rm = scrape(t, client, cc.Router.URL)
		return strings.Contains(rm, `pdkit_router_requests_total{outcome="ok"} 4`)
	})
	for _, want := range []string{`pdkit_router_requests_total{outcome="overloaded"} 6`, `pdkit_router_requests_total{outcome="ok"} 4`,
		`pdkit_router_admission_refusals_total{role="prefill"} 6`, `pdkit_router_server_queued_requests{role="decode"`} {
		if !strings.Contains(rm, want) {
			t.Errorf("router metrics lack %q", want)
		}
	}
	// Nothing failed inside the cluster.
	for _, n := range []*clustertest.Node{cc.Prefill, cc.Decode} {
		for _, line := range strings.Split(scrape(t, client, n.TS.URL), "\n") {
			if strings.HasPrefix(line, "pdkit_pd_failed_reqs_total{") && !strings.HasSuffix(line, " 0") {
				t.Errorf("%s: %s", n.TS.URL, line)
			}
		}
	}
}

// TestGenerateThroughRouter: the native POST /generate works through the
// router in PD mode (the router adds the room and the bootstrap URL as it
// does to OpenAI requests) and answers what a colocated server answers; a
// bad parameter is the client's 400, not an upstream error.
func TestGenerateThroughRouter(t *testing.T) {
	m := tinyModel(t)
	col := clustertest.NewNode(t, m, edgeConfig(), server.Options{}, nil)
	c := newCluster(t, m, edgeConfig())
	gen := func(base, body string) (int, server.GenerateResponse, string, http.Header) {
		resp, err := c.client.Post(base+"/generate", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var g server.GenerateResponse
		if resp.StatusCode == 200 {
			if err := json.Unmarshal(b, &g); err != nil {
				t.Fatalf("%s: %v", b, err)
			}
		}
		return resp.StatusCode, g, string(b), resp.Header
	}
	for _, text := range []string{"Once upon a time", "the quick brown fox"} {
		req := `{"text": "` + text + `", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}`
		code, want, b, _ := gen(col.TS.URL, req)
		if code != 200 {
			t.Fatalf("colocated: %d %s", code, b)
		}
		code, got, b, h := gen(c.router.URL, req)
		if code != 200 || got.Text != want.Text || got.MetaInfo.CompletionTokens != 8 || got.MetaInfo.FinishReason != "length" ||
			got.MetaInfo.ID == "" || h.Get(router.RequestIDHeader) == "" {
			t.Errorf("through the router: %d %s; want the text %q", code, b, want.Text)
		}
	}
	code, _, b, _ := gen(c.router.URL, `{"text": "x", "sampling_params": {"temperature": -1}}`)
	var eb openai.ErrorBody
	if code != 400 || json.Unmarshal([]byte(b), &eb) != nil || eb.Error.Param == nil || *eb.Error.Param != "sampling_params.temperature" {
		t.Errorf("bad parameter: %d %s", code, b)
	}
	waitfor.For(t, "the router done with the bad request", 10*time.Second, func() bool {
		return strings.Contains(scrape(t, c.client, c.router.URL), `pdkit_router_requests_total{outcome="client_error"} 1`)
	})
	if rm := scrape(t, c.client, c.router.URL); strings.Contains(rm, "pdkit_router_upstream_errors_total{") ||
		!strings.Contains(rm, `pdkit_router_requests_total{outcome="ok"} 2`) {
		t.Errorf("router metrics:\n%s", rm)
	}
}

// TestExpositionsLint: every server's and the router's /metrics is what
// promtool check metrics accepts (the same linter), and carries the
// latency histograms under the model's name, the KV page gauges and the
// Go runtime, process and build collectors.
func TestExpositionsLint(t *testing.T) {
	m := tinyModel(t)
	col := clustertest.NewNode(t, m, edgeConfig(), server.Options{}, nil)
	c := newCluster(t, m, edgeConfig())
	p := testmodel.Prompts(3, 1, 8, 8, m.Config.VocabSize)[0]
	for _, base := range []string{c.router.URL, col.TS.URL} {
		for _, stream := range []bool{true, false} {
			r, err := complete(context.Background(), c.client, base, body(p, 6, stream, map[string]any{"ignore_eos": true}))
			if err != nil || r.status != 200 || r.tokens != 6 {
				t.Fatalf("%s stream=%v: %+v %v", base, stream, r, err)
			}
		}
	}
	common := []string{"go_goroutines ", "go_build_info{", "process_resident_memory_bytes "}
	serverWant := append([]string{`pdkit_e2e_request_latency_seconds_count{model="tiny"} 2`, `pdkit_kv_pages_used{rank="0"}`,
		`pdkit_kv_pages_cached{rank="0"}`, `pdkit_kv_pages_capacity{rank="0"}`, "pdkit_time_to_first_token_seconds_count "}, common...)
	for name, tc := range map[string]struct {
		base string
		want []string
	}{
		"router": {c.router.URL, append([]string{`pdkit_router_time_to_first_token_seconds_count{model="tiny"} 1`,
			`pdkit_router_inter_token_latency_seconds_count{model="tiny"} `, `pdkit_router_e2e_request_latency_seconds_count{model="tiny"} 2`}, common...)},
		"prefill":   {c.prefill.TS.URL, serverWant},
		"decode":    {c.decode.TS.URL, serverWant},
		"colocated": {col.TS.URL, serverWant},
	} {
		var x string
		waitfor.For(t, name+" metrics", 10*time.Second, func() bool {
			x = scrape(t, c.client, tc.base)
			for _, w := range tc.want {
				if !strings.Contains(x, w) {
					return false
				}
			}
			return true
		})
		problems, err := promlint.New(strings.NewReader(x)).Lint()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, pr := range problems {
			t.Errorf("%s: promlint: %s: %s", name, pr.Metric, pr.Text)
		}
	}
}
