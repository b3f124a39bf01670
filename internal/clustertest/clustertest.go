// Package clustertest builds a live PD cluster inside a test process, on
// real sockets: a prefill and a decode server (real engines, their ranks
// on real ZeroMQ sockets), the prefill's bootstrap registry and the router
// in front, each on its own httptest server. It exists because tests of
// several packages (the router's, pdctl's) need such a cluster and would
// otherwise each build their own.
//
// It imports internal/server, so the tests of internal/server itself
// cannot use it.
package clustertest

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/httpx"
	"github.com/pdkit/pdkit/internal/metrics"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/waitfor"
)

var quiet = slog.New(slog.DiscardHandler)

// Node is one engine served over HTTP.
type Node struct {
	Eng *serve.Engine
	TS  *httptest.Server
}

// NewNode serves m with an engine of configuration cfg under the model
// name "tiny". opts.Loopback is set so that the admin API answers the
// tests, and opts.Logger discards unless set. A wrap, when given, stands
// in front of the server. The test's cleanup closes it all.
func NewNode(t testing.TB, m *model.Model, cfg serve.Config, opts server.Options, wrap func(http.Handler) http.Handler) *Node {
	t.Helper()
	if cfg.Backend == nil {
		cfg.Backend = func(int) kernels.Backend { return cpu.New(1) }
	}
	// As pdserve does: one registry per server, fed by the engine as it
	// runs (tokens, latencies, KV transfers) and read at scrape time.
	if opts.Metrics == nil {
		opts.Metrics = metrics.New(nil)
	}
	if cfg.Observer == nil {
		cfg.Observer = opts.Metrics
	}
	eng, err := serve.New(m, cfg)
	if err != nil {
		t.Fatal(err)
	}
	opts.ModelName, opts.Loopback = "tiny", true
	if opts.ClusterSecret == nil {
		opts.ClusterSecret = cfg.PD.Secret // as pdserve gives a PD server's
	}
	if opts.Logger == nil {
		opts.Logger = quiet
	}
	var h http.Handler = server.New(eng, m, opts)
	if wrap != nil {
		h = wrap(h)
	}
	ts := httptest.NewServer(h)
	t.Cleanup(func() {
		// The engine first: it ends the streams that handlers wait on.
		ts.CloseClientConnections()
		eng.Close()
		ts.Close()
	})
	return &Node{Eng: eng, TS: ts}
}

// Options says what New builds.
type Options struct {
	Model *model.Model
	// Config is both servers' configuration; New sets each one's Role,
	// and leaves the decode's host tier off (a decode keeps none).
	Config serve.Config
	// Decode, when set, changes the decode's configuration after that:
	// a pair that disagrees (a mismatch the handshake refuses).
	Decode func(*serve.Config)
	// WrapPrefill and WrapDecode, when set, stand in front of the
	// prefill and the decode server.
	WrapPrefill, WrapDecode func(http.Handler) http.Handler
	// Router configures the router; New fills in Prefill, Decode,
	// Logger (discarding) and ClusterSecret (Config.PD.Secret) where they
	// are empty.
	Router router.Options
	// HealthyWithin is how long New waits for the router to see both
	// servers healthy before it fails the test; 20s when zero.
	HealthyWithin time.Duration
}

// Cluster is a prefill, a decode, the prefill's registry and a router in
// front of them.
type Cluster struct {
	Prefill, Decode *Node
	Registry        string // the bootstrap registry's URL
	// Bootstrap is the registry itself, for a test to register in it as
	// a cluster member would.
	Bootstrap     *bootstrap.Registry
	Router        *httptest.Server
	RouterHandler *router.Router
}

// New starts a cluster and returns once the router's GET /health answers
// 200 with every prefill and decode server of its options healthy. The test's cleanup
// closes it all.
func New(t testing.TB, o Options) *Cluster {
	t.Helper()
	c := &Cluster{}
	// The registry's server starts first so that the prefill can report
	// its URL; the ranks register once the prefill engine exists. Until
	// then the registry answers 503.
	var reg *bootstrap.Registry
	var regMu sync.Mutex
	regTS := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		regMu.Lock()
		h := reg
		regMu.Unlock()
		if h == nil {
			http.Error(w, "registry not up yet", http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(regTS.Close)
	c.Registry = regTS.URL

	pc, dc := o.Config, o.Config
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	dc.HiCache.Enabled = false // a decode keeps no host tier
	if o.Decode != nil {
		o.Decode(&dc)
	}
	dc.PD.PrefillBootstrap = append(dc.PD.PrefillBootstrap, c.Registry)
	pc.PD.OnRankInfos = func(infos []pdproto.RankInfo) { // after a live index-K switch
		regMu.Lock()
		r := reg
		regMu.Unlock()
		if r != nil {
			if err := r.Replace(infos); err != nil {
				t.Errorf("re-registering the prefill's ranks: %v", err)
			}
		}
	}
	c.Prefill = NewNode(t, o.Model, pc, server.Options{BootstrapURL: c.Registry}, o.WrapPrefill)
	c.Decode = NewNode(t, o.Model, dc, server.Options{}, o.WrapDecode)
	r := bootstrap.NewRegistry(bootstrap.Options{TPSize: c.Prefill.Eng.View().Ranks()})
	for _, info := range c.Prefill.Eng.PD().RankInfos() {
		if _, err := r.Register(info); err != nil {
			t.Fatal(err)
		}
	}
	regMu.Lock()
	reg = r
	regMu.Unlock()
	c.Bootstrap = r

	ro := o.Router
	if len(ro.Prefill) == 0 {
		ro.Prefill = []string{c.Prefill.TS.URL}
	}
	if len(ro.Decode) == 0 {
		ro.Decode = []string{c.Decode.TS.URL}
	}
	if ro.Logger == nil {
		ro.Logger = quiet
	}
	if ro.ClusterSecret == nil {
		ro.ClusterSecret = o.Config.PD.Secret // as pdserve launch gives the router the servers' secret
	}
	if ro.CanaryInterval == 0 {
		ro.CanaryInterval = -1 // a test asks for canaries when it wants them
	}
	if ro.Admin == (httpx.AdminRule{}) {
		// As pdserve router's rule, on loopback.
		tok := ro.ClusterSecret.AdminToken()
		ro.Admin = httpx.AdminRule{Token: tok, Derived: tok != "", Loopback: true}
	}
	rt, err := router.New(ro)
	if err != nil {
		t.Fatal(err)
	}
	c.RouterHandler = rt
	c.Router = httptest.NewServer(rt)
	t.Cleanup(func() {
		c.Router.CloseClientConnections()
		c.Router.Close()
		rt.Close()
	})

	within := o.HealthyWithin
	if within <= 0 {
		within = 20 * time.Second
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: within}
	waitfor.For(t, "every server healthy at the router", within, func() bool {
		resp, err := hc.Get(c.Router.URL + "/health")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var h router.HealthResponse
		err = json.NewDecoder(resp.Body).Decode(&h)
		return err == nil && resp.StatusCode == http.StatusOK && h.HealthyPrefill == len(ro.Prefill) && h.HealthyDecode == len(ro.Decode)
	})
	return c
}
