package main

// The commands' tests run against a live cluster on real sockets, built
// by internal/clustertest: a prefill and a decode server (real engines on
// the tiny built-in model, their ranks on real ZeroMQ sockets), the
// prefill's bootstrap registry and the router in front, each on its own
// httptest server. Only these test files import the engine: the lint's
// import walk leaves _test.go files out, so the pdctl binary still reaches
// nothing but api/.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// TestMain keeps what pdctl writes to the user's cache folder (the
// discoveries diagnose falls back on) in a folder of the run's own.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pdctl-test-cache")
	if err != nil {
		panic(err)
	}
	os.Setenv("XDG_CACHE_HOME", dir)
	code := m.Run()
	testmodel.Cleanup()
	os.RemoveAll(dir)
	os.Exit(code)
}

// node is one engine served over HTTP.
type node struct {
	eng *serve.Engine
	ts  *httptest.Server
}

func newNode(t *testing.T, m *model.Model, cfg serve.Config, opts server.Options) *node {
	t.Helper()
	return nodeOf(clustertest.NewNode(t, m, cfg, opts, nil))
}

func nodeOf(n *clustertest.Node) *node { return &node{eng: n.Eng, ts: n.TS} }

// cluster is a prefill, a decode, the prefill's registry and a router.
type cluster struct {
	routerServer    *httptest.Server // the router's listener, for a test that stops it
	m               *model.Model
	prefill, decode *node
	registry        string
	bootstrap       *bootstrap.Registry
	secret          *clusterauth.Secret // the servers' (nil without one)
	router          string
	endpoints       []string // the prefill ranks' endpoints and their names
}

// testConfig: TP 2, 32 KV pages per rank, PD timeouts long enough that
// the one-sided requests of the queue tests stay put while they run.
var testConfig = serve.Config{TP: 2, PageSize: 4, KVTokens: 128, MaxRunning: 4,
	PD: serve.PDConfig{BootstrapTimeout: time.Minute, TransferTimeout: time.Minute, AbortAckTimeout: 200 * time.Millisecond}}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	return newClusterWith(t, m, clustertest.Options{})
}

// newClusterWith is newCluster over model m with o's changes to its
// options: a decode that disagrees, a router's own bound.
func newClusterWith(t *testing.T, m *model.Model, o clustertest.Options) *cluster {
	t.Helper()
	o.Model, o.Config, o.HealthyWithin = m, testConfig, 10*time.Second
	if o.Router.HealthInterval == 0 {
		o.Router.HealthInterval = 20 * time.Millisecond
	}
	cc := clustertest.New(t, o)
	return &cluster{m: m, prefill: nodeOf(cc.Prefill), decode: nodeOf(cc.Decode), registry: cc.Registry, bootstrap: cc.Bootstrap, router: cc.Router.URL,
		secret: testConfig.PD.Secret, routerServer: cc.Router}
}

// pdctl runs pdctl against c with args; tty says whether stdout is a
// terminal. Volatile cells are masked and the servers' URLs replaced by
// PREFILL, DECODE and ROUTER.
func (c *cluster) pdctl(t *testing.T, tty bool, args ...string) (exitCode, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	f := &factory{In: strings.NewReader(""), Out: &out, ErrOut: &errOut, Build: testBuild,
		OutTTY: tty, maskVolatile: true,
		Getenv: func(k string) string {
			if k == "PDCTL_ROUTER" {
				return c.router
			}
			return ""
		}}
	code := run(t.Context(), f, args)
	return code, c.names(out.String()), c.names(errOut.String())
}

func (c *cluster) names(s string) string {
	pairs := []string{c.prefill.ts.URL, "PREFILL", c.decode.ts.URL, "DECODE", c.router, "ROUTER"}
	if c.endpoints == nil {
		r, err := client.New(c.prefill.ts.URL, "", nil).PD(context.Background(), "")
		if err == nil {
			for _, rk := range r.Ranks {
				c.endpoints = append(c.endpoints, rk.Socket.Endpoint, fmt.Sprintf("PREFILL-RANK%d", rk.Rank))
			}
		}
	}
	return strings.NewReplacer(append(pairs, c.endpoints...)...).Replace(s)
}

// maskJSON replaces the values of the named JSON fields with 0.
func maskJSON(s string, fields ...string) string {
	for _, f := range fields {
		s = regexp.MustCompile(`("`+f+`": )("[^"]*"|[0-9.e+-]+)`).ReplaceAllString(s, `${1}0`)
	}
	return s
}

// send posts a completion body to base in the background; cancel ends it.
func send(t *testing.T, base string, body map[string]any) (cancel func()) {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	cancel = func() { stop(); <-done }
	t.Cleanup(cancel)
	return cancel
}

// pdCounts sums a queue's length over the ranks of n.
func pdCounts(t *testing.T, n *node, queue string) int {
	r, err := client.New(n.ts.URL, "", nil).PD(t.Context(), "")
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, rk := range r.Ranks {
		total += rk.Counts[queue]
	}
	return total
}
