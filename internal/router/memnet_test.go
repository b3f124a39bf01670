package router

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// memNet is an in-memory network of net.Pipe connections, for tests run
// in a testing/synctest bubble: a goroutine blocked on a pipe is durably
// blocked, so the bubble's fake clock moves while the servers wait, and
// the timeouts under test (deadlines on the pipes, the router's timers)
// fire on it, whatever the machine's speed. Real sockets would not let
// the bubble's clock move.
type memNet struct {
	mu  sync.Mutex
	lns map[string]*memListener
	n   int
}

func newMemNet() *memNet { return &memNet{lns: map[string]*memListener{}} }

// listen returns a listener at a new address, named after what.
func (m *memNet) listen(what string) net.Listener {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.n++
	addr := memAddr(what + "-" + string(rune('a'+m.n-1)) + ".mem:80")
	ln := &memListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
	m.lns[string(addr)] = ln
	return ln
}

// dial connects to the listener at addr.
func (m *memNet) dial(ctx context.Context, addr string) (net.Conn, error) {
	m.mu.Lock()
	ln := m.lns[addr]
	m.mu.Unlock()
	if ln == nil {
		return nil, &net.OpError{Op: "dial", Net: "mem", Err: errors.New("no listener at " + addr)}
	}
	client, server := net.Pipe()
	select {
	case ln.conns <- server:
		return client, nil
	case <-ln.done:
	case <-ctx.Done():
	}
	client.Close()
	server.Close()
	return nil, &net.OpError{Op: "dial", Net: "mem", Err: errors.New("connection refused")}
}

// client returns an HTTP client of the network; its idle connections are
// closed at the test's end.
func (m *memNet) client(t *testing.T) *http.Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) { return m.dial(ctx, addr) },
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// serve starts an httptest.Server of h on a listener of the network.
func (m *memNet) serve(t *testing.T, what string, h http.Handler) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = m.listen(what)
	srv.Start()
	return srv
}

type memAddr string

func (a memAddr) Network() string { return "mem" }
func (a memAddr) String() string  { return string(a) }

type memListener struct {
	addr  memAddr
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *memListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *memListener) Addr() net.Addr { return l.addr }

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
