// Package memnet is an in-memory network of net.Pipe connections for tests
// run in a testing/synctest bubble, where real sockets would keep the
// bubble's clock from moving.
package memnet

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
)

// Net is an in-memory network of net.Pipe connections, for tests run
// in a testing/synctest bubble: a goroutine blocked on a pipe is durably
// blocked, so the bubble's fake clock moves while the servers wait, and
// the timeouts under test (deadlines on the pipes, the router's timers)
// fire on it, whatever the machine's speed. Real sockets would not let
// the bubble's clock move.
type Net struct {
	mu  sync.Mutex
	lns map[string]*memListener
	n   int
}

// New returns an empty network.
func New() *Net { return &Net{lns: map[string]*memListener{}} }

// Listen returns a listener at a new address, named after what.
func (m *Net) Listen(what string) net.Listener {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.n++
	addr := memAddr(what + "-" + string(rune('a'+m.n-1)) + ".mem:80")
	ln := &memListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
	m.lns[string(addr)] = ln
	return ln
}

// Dial connects to the listener at addr.
func (m *Net) Dial(ctx context.Context, addr string) (net.Conn, error) {
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

// Client returns an HTTP client of the network; its idle connections are
// closed at the test's end.
func (m *Net) Client(t testing.TB) *http.Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) { return m.Dial(ctx, addr) },
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// Serve starts an httptest.Server of h on a listener of the network.
func (m *Net) Serve(t testing.TB, what string, h http.Handler) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = m.Listen(what)
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
