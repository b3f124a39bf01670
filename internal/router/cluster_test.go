package router_test

// End-to-end tests of a whole PD cluster over real HTTP: a prefill and a
// decode server (real engines on the tiny built-in model, their ranks on
// real ZeroMQ sockets), the prefill's bootstrap registry, and the real
// router in front, each on its own httptest server (internal/clustertest
// builds them). The 500-session variant of the mass-abort drill is in
// cluster_stress_test.go.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

func tinyModel(t *testing.T) *model.Model {
	return testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
}

// pdCluster is a prefill, a decode and a router in front of them, with a
// client for the tests.
type pdCluster struct {
	m               *model.Model
	prefill, decode *clustertest.Node
	router          *httptest.Server
	client          *http.Client
}

func newCluster(t *testing.T, m *model.Model, cfg serve.Config) *pdCluster {
	t.Helper()
	return newClusterWrapped(t, m, cfg, nil)
}

// newClusterWrapped is newCluster with wrap in front of the prefill server.
func newClusterWrapped(t *testing.T, m *model.Model, cfg serve.Config, wrap func(http.Handler) http.Handler) *pdCluster {
	t.Helper()
	cc := clustertest.New(t, clustertest.Options{Model: m, Config: cfg, WrapPrefill: wrap,
		Router:        router.Options{HealthInterval: 50 * time.Millisecond, PrefillGrace: 5 * time.Second},
		HealthyWithin: 20 * time.Second})
	tr := &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024}
	t.Cleanup(tr.CloseIdleConnections)
	return &pdCluster{m: m, prefill: cc.Prefill, decode: cc.Decode, router: cc.Router,
		client: &http.Client{Transport: tr, Timeout: 60 * time.Second}}
}

// completion is a completion's outcome as a client sees it.
type completion struct {
	status int
	text   string
	finish string
	tokens int    // usage.completion_tokens
	err    string // an error body or a stream's error event
	chunks int
}

func body(prompt []int32, maxTokens int, stream bool, extra map[string]any) []byte {
	b := map[string]any{"prompt": prompt, "max_tokens": maxTokens, "temperature": 0, "stream": stream}
	if stream {
		b["stream_options"] = map[string]any{"include_usage": true}
	}
	for k, v := range extra {
		b[k] = v
	}
	out, err := json.Marshal(b)
	if err != nil {
		panic(err)
	}
	return out
}

// complete sends a completion to base and reads its answer whole.
func complete(ctx context.Context, client *http.Client, base string, req []byte) (completion, error) {
	hr, err := http.NewRequestWithContext(ctx, "POST", base+"/v1/completions", bytes.NewReader(req))
	if err != nil {
		return completion{}, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(hr)
	if err != nil {
		return completion{}, err
	}
	defer resp.Body.Close()
	c := completion{status: resp.StatusCode}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		c.err = string(b)
		return c, nil
	}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return c, readSSE(resp.Body, &c, -1)
	}
	var r openai.CompletionResponse
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return c, err
	}
	if len(r.Choices) != 1 {
		return c, fmt.Errorf("%d choices", len(r.Choices))
	}
	c.text, c.finish, c.tokens = r.Choices[0].Text, r.Choices[0].FinishReason, r.Usage.CompletionTokens
	return c, nil
}

// readSSE reads a completion stream's events into c until [DONE], or
// until it has read stopAfter data events (stopAfter ≥ 0).
func readSSE(r io.Reader, c *completion, stopAfter int) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if stopAfter >= 0 && c.chunks >= stopAfter {
			return nil
		}
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			return nil
		}
		c.chunks++
		var ev struct {
			openai.CompletionChunk
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return fmt.Errorf("event %q: %v", data, err)
		}
		if ev.Error != nil {
			c.err = ev.Error.Message
			continue
		}
		for _, ch := range ev.Choices {
			c.text += ch.Text
			if ch.FinishReason != nil {
				c.finish = *ch.FinishReason
			}
		}
		if ev.Usage != nil {
			c.tokens = ev.Usage.CompletionTokens
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if stopAfter >= 0 {
		return nil
	}
	return io.ErrUnexpectedEOF
}

// pdState reads GET /debug/v1/pd of n.
func pdState(t *testing.T, client *http.Client, n *clustertest.Node) debug.PDResponse {
	t.Helper()
	resp, err := client.Get(n.TS.URL + debug.PDPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r debug.PDResponse
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%s: %d %v", debug.PDPath, resp.StatusCode, err)
	}
	return r
}

// quietState says what still holds a PD queue entry or a KV page on n, or
// "" when nothing does.
func quietState(t *testing.T, client *http.Client, n *clustertest.Node) string {
	var held []string
	for _, rk := range pdState(t, client, n).Ranks {
		for q, v := range rk.Counts {
			if v != 0 {
				held = append(held, fmt.Sprintf("rank %d queue %s: %d", rk.Rank, q, v))
			}
		}
		if len(rk.Entries) != 0 {
			held = append(held, fmt.Sprintf("rank %d: %d entries", rk.Rank, len(rk.Entries)))
		}
	}
	for r := range n.Eng.View().Ranks() {
		if used, cached, _ := n.Eng.View().KVPages(r); used-cached != 0 {
			held = append(held, fmt.Sprintf("rank %d: %d pages used, %d cached", r, used, cached))
		}
	}
	return strings.Join(held, "; ")
}

// drained waits until neither server holds a PD queue entry or a KV page.
func (c *pdCluster) drained(t *testing.T, within time.Duration) {
	t.Helper()
	waitfor.NoError(t, "the cluster drained", within, func() error {
		p, d := quietState(t, c.client, c.prefill), quietState(t, c.client, c.decode)
		if p == "" && d == "" {
			return nil
		}
		return fmt.Errorf("prefill [%s], decode [%s]", p, d)
	})
}

// PD greedy output through the router equals a colocated server's for 50
// prompts, half of them streamed, at TP 1 and 2.
func TestClusterMatchesColocated(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(71, 50, 3, 40, m.Config.VocabSize)
	const maxTok = 6
	for _, tp := range []int{1, 2} {
		t.Run(fmt.Sprintf("tp%d", tp), func(t *testing.T) {
			cfg := serve.Config{TP: tp, PageSize: 4, KVTokens: 512, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 16}
			col := clustertest.NewNode(t, m, cfg, server.Options{}, nil)
			c := newCluster(t, m, cfg)
			got, want := make([]completion, len(ps)), make([]completion, len(ps))
			var wg sync.WaitGroup
			for i, p := range ps {
				wg.Go(func() {
					req := body(p, maxTok, i%2 == 1, nil)
					var err error
					if want[i], err = complete(t.Context(), c.client, col.TS.URL, req); err != nil {
						t.Errorf("prompt %d, colocated: %v", i, err)
					}
					if got[i], err = complete(t.Context(), c.client, c.router.URL, req); err != nil {
						t.Errorf("prompt %d, through the router: %v", i, err)
					}
				})
			}
			wg.Wait()
			for i := range ps {
				g, w := got[i], want[i]
				g.chunks, w.chunks = 0, 0
				if g != w || w.status != 200 || w.tokens == 0 {
					t.Errorf("prompt %d (stream %v): PD %+v, colocated %+v", i, i%2 == 1, g, w)
				}
			}
			c.drained(t, 5*time.Second)
		})
	}
}

// Phases at which a drill client goes away.
const (
	beforeAnyByte = iota // cancels while the request is in flight, reading nothing
	afterFirst           // after the first event
	afterK               // after k events
	phases
)

// drill opens n concurrent streaming sessions through the router, each
// dropped by its client at a seeded random phase, and waits for all of them
// to end. It returns how many sessions the servers answered with at least
// one event. Unless wedging, a session the servers fail is an error.
func (c *pdCluster) drill(t *testing.T, seed uint64, n, minLen, maxLen, maxTokens int, wedging bool) int {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed))
	ps := testmodel.Prompts(seed, n, minLen, maxLen, c.m.Config.VocabSize)
	type plan struct{ phase, k, delayMS int }
	plans := make([]plan, n)
	for i := range plans {
		plans[i] = plan{phase: rng.IntN(phases), k: 2 + rng.IntN(maxTokens/2), delayMS: rng.IntN(30)}
	}
	var mu sync.Mutex
	answered := 0
	var wg sync.WaitGroup
	for i, p := range ps {
		pl := plans[i]
		wg.Go(func() {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			hr, _ := http.NewRequestWithContext(ctx, "POST", c.router.URL+"/v1/completions",
				bytes.NewReader(body(p, maxTokens, true, map[string]any{"ignore_eos": true})))
			hr.Header.Set("Content-Type", "application/json")
			if pl.phase == beforeAnyByte {
				// The response's headers come with the first event, so
				// cancelling before Do returns reads nothing.
				timer := time.AfterFunc(time.Duration(pl.delayMS)*time.Millisecond, cancel)
				defer timer.Stop()
			}
			resp, err := c.client.Do(hr)
			if err != nil {
				if ctx.Err() == nil {
					t.Errorf("session %d: %v", i, err)
				}
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				if b, _ := io.ReadAll(resp.Body); !wedging {
					t.Errorf("session %d: status %d: %s", i, resp.StatusCode, b)
				}
				return
			}
			if pl.phase == beforeAnyByte {
				cancel()
				return
			}
			k := 1
			if pl.phase == afterK {
				k = pl.k
			}
			var got completion
			if err := readSSE(resp.Body, &got, k); err != nil && !wedging {
				t.Errorf("session %d: %v", i, err)
			}
			if got.err != "" && !wedging {
				t.Errorf("session %d: error event %q", i, got.err)
			}
			if got.chunks > 0 {
				mu.Lock()
				answered++
				mu.Unlock()
			}
			cancel() // the client goes
		})
	}
	wg.Wait()
	return answered
}

// after checks that the cluster serves n fresh requests completely.
func (c *pdCluster) serves(t *testing.T, seed uint64, n int) {
	t.Helper()
	const maxTok = 5
	var wg sync.WaitGroup
	for i, p := range testmodel.Prompts(seed, n, 4, 30, c.m.Config.VocabSize) {
		wg.Go(func() {
			r, err := complete(t.Context(), c.client, c.router.URL, body(p, maxTok, i%2 == 0, map[string]any{"ignore_eos": true}))
			if err != nil || r.status != 200 || r.tokens != maxTok || r.finish != "length" || r.err != "" {
				t.Errorf("request %d after the drill: %+v %v", i, r, err)
			}
		})
	}
	wg.Wait()
}

func drillConfig(tp int) serve.Config {
	return serve.Config{TP: tp, PageSize: 4, KVTokens: 2048, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 8,
		PD: serve.PDConfig{AbortAckTimeout: time.Second}}
}

// massAbortDrill runs the drill with n sessions on a cluster of
// configuration cfg and checks that it drains within 2s and serves again.
func massAbortDrill(t *testing.T, cfg serve.Config, seed uint64, n int) {
	m := tinyModel(t)
	c := newCluster(t, m, cfg)
	start := time.Now()
	answered := c.drill(t, seed, n, 8, 60, 24, false)
	t.Logf("%d sessions dropped in %v, %d after some output", n, time.Since(start).Round(time.Millisecond), answered)
	for _, nd := range []*clustertest.Node{c.prefill, c.decode} {
		if err := nd.Eng.View().Snapshot().Err; err != "" {
			t.Fatalf("%s engine failed: %s", nd.Eng.Config().Role, err)
		}
	}
	drainStart := time.Now()
	c.drained(t, 2*time.Second)
	t.Logf("drained %v after the last client went", time.Since(drainStart).Round(time.Millisecond))
	for _, nd := range []*clustertest.Node{c.prefill, c.decode} {
		for _, rk := range pdState(t, c.client, nd).Ranks {
			if !rk.Socket.Alive {
				t.Errorf("%s rank %d socket dead: %s", nd.Eng.Config().Role, rk.Rank, rk.Socket.ExitReason)
			}
		}
	}
	c.serves(t, seed+1, 20)
	c.drained(t, 5*time.Second)
}

// The mass-abort drill through the router: 60 streaming sessions, each
// dropped by its client before any byte, after the first event or after k
// events; within 2s both servers' PD queues are empty and their KV pools
// free, and 20 new requests complete.
func TestClusterMassAbortDrill(t *testing.T) {
	massAbortDrill(t, drillConfig(2), 83, 60)
}

// heldMarker marks a request the prefill server never gets: its half waits
// at the door until the router cancels it.
const heldMarker = `"max_tokens":77`

// holdMarked keeps the requests that carry heldMarker from h.
func holdMarked(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == "POST" && r.URL.Path == "/v1/completions" {
			b, err := io.ReadAll(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			if bytes.Contains(b, []byte(heldMarker)) {
				<-r.Context().Done()
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(b))
		}
		h.ServeHTTP(w, r)
	})
}

// With bootstrap-abort-crash on at the prefill, the drill wedges the
// cluster: the prefill's control loop dies on the first ABORT, as the debug
// API shows, and a new request fails by its PD timeouts instead of
// completing. (With the switch off the same drill does not wedge:
// TestClusterMassAbortDrill.)
func TestClusterBootstrapAbortCrashWedges(t *testing.T) {
	m := tinyModel(t)
	// The heartbeat timeout is long: once the prefill's control loop is
	// dead its heartbeats go unanswered, and a decode that declared the
	// peer lost would refuse the held session below before its transfer,
	// however slowly the drill ran on a loaded machine.
	cfg := serve.Config{PageSize: 4, KVTokens: 4096, MaxRunning: 4, MaxBatchTokens: 64, PrefillChunk: 16,
		PD: serve.PDConfig{BootstrapTimeout: 2 * time.Second, TransferTimeout: 2 * time.Second, InflightTimeout: 2 * time.Second,
			AbortAckTimeout: time.Second, HeartbeatTimeout: time.Minute}}
	c := newClusterWrapped(t, m, cfg, holdMarked)
	resp, err := c.client.Post(c.prefill.TS.URL+"/admin/v1/faults/"+serve.FaultBootstrapAbortCrash+"/on", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("fault on: %d %s", resp.StatusCode, b)
	}
	// Long prompts keep sessions waiting for their KV when they go, so
	// that the decode sends ABORT to the prefill.
	c.drill(t, 97, 20, 100, 200, 8, true)

	// Whether or not a drill session went while waiting for its KV, one
	// more surely does: its prefill half never reaches the prefill
	// server, so the decode waits in its transfer queue until the client
	// goes, and then sends ABORT.
	ctx, cancel := context.WithCancel(t.Context())
	held := make(chan struct{})
	go func() {
		defer close(held)
		p := testmodel.Prompts(99, 1, 10, 20, m.Config.VocabSize)[0]
		complete(ctx, c.client, c.router.URL, body(p, 77, true, nil))
	}()
	// The held session, not a drill session still there (theirs have 100
	// tokens or more): cancelled before its decode sent TRANSFER_INFO, it
	// would send no ABORT.
	waitfor.For(t, "the held session in the decode's transfer queue", 10*time.Second, func() bool {
		for _, rk := range pdState(t, c.client, c.decode).Ranks {
			for _, e := range rk.Entries {
				if e.Queue == debug.PDQueueTransfer && e.Tokens < 100 {
					return true
				}
			}
		}
		return false
	})
	cancel()
	<-held

	var dead debug.PDSocket
	waitfor.For(t, "the prefill's control loop dead", 10*time.Second, func() bool {
		for _, rk := range pdState(t, c.client, c.prefill).Ranks {
			if !rk.Socket.Alive {
				dead = rk.Socket
				return true
			}
		}
		return false
	})
	if !strings.Contains(dead.ExitReason, "ABORT") {
		t.Errorf("exit reason %q does not name ABORT", dead.ExitReason)
	}

	// A new request does not complete: it fails by the PD timeouts.
	p := testmodel.Prompts(101, 1, 10, 20, m.Config.VocabSize)[0]
	ctx, cancel = context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	start := time.Now()
	r, err := complete(ctx, c.client, c.router.URL, body(p, 4, false, map[string]any{"ignore_eos": true}))
	if err != nil {
		t.Fatalf("the request after the wedge: %v (after %v)", err, time.Since(start))
	}
	if r.status == http.StatusOK && r.err == "" && r.finish == "length" {
		t.Fatalf("the wedged cluster served: %+v", r)
	}
	t.Logf("failed after %v: status %d, finish %q, error %q", time.Since(start).Round(time.Millisecond), r.status, r.finish, r.err)
}
