package router

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/memnet"
)

// memNet is the in-memory network of internal/memnet, with the short
// names these tests use.
type memNet struct{ *memnet.Net }

func newMemNet() *memNet { return &memNet{memnet.New()} }

func (m *memNet) client(t *testing.T) *http.Client { return m.Client(t) }

func (m *memNet) serve(t *testing.T, what string, h http.Handler) *httptest.Server {
	return m.Serve(t, what, h)
}

// newMemStub is newStub on m.
func newMemStub(t *testing.T, m *memNet, role string, setup func(*stub)) *stub {
	t.Helper()
	s := &stub{role: role, cancels: make(chan string, 1024)}
	s.healthy.Store(true)
	if setup != nil {
		setup(s)
	}
	s.srv = m.serve(t, role, http.HandlerFunc(s.serve))
	t.Cleanup(s.srv.Close)
	return s
}

// startMem is start on m: the router sends its upstream requests and is
// served on m, and the cluster's own requests go over m.
func startMem(t *testing.T, m *memNet, prefill, decode []*stub, tweaks ...func(*Options)) *cluster {
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
	opts.Client = m.client(t)
	for _, tw := range tweaks {
		tw(&opts)
	}
	rt, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := m.serve(t, "router", rt)
	t.Cleanup(func() {
		srv.Close()
		rt.Close()
	})
	c := &cluster{rt: rt, srv: srv, client: m.client(t), bubble: true}
	c.waitChecked(t)
	return c
}
