package httpx

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// pipeListener is a listener of net.Pipe connections, for a test in a
// synctest bubble: a goroutine blocked on a pipe is durably blocked, so
// synctest.Wait can tell when the server has nothing left to do, where a
// real socket leaves a poll on the wall clock.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

// dial connects a new pipe to the listener.
func (l *pipeListener) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	client, server := net.Pipe()
	select {
	case l.conns <- server:
		return client, nil
	case <-l.done:
	case <-ctx.Done():
	}
	client.Close()
	server.Close()
	return nil, errors.New("connection refused")
}

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }

// TestRedTeamIdleConnectionsYield: kept-alive connections idle between
// requests hold every place under the cap; a new connection (a health
// probe) takes the place of the one idle longest instead of being
// refused, and the hit is counted. It runs in a synctest bubble over
// pipes: synctest.Wait, not a poll, says when the server has marked the
// connections idle.
func TestRedTeamIdleConnectionsYield(t *testing.T) {
	synctest.Test(t, testIdleConnectionsYield)
}

func testIdleConnectionsYield(t *testing.T) {
	g := NewGuard(Limits{HeaderTimeout: 5 * time.Second, BodyTimeout: 5 * time.Second, MaxConns: 2, MaxConnsPerAddr: 3})
	ln := newPipeListener()
	srv := g.Server(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }), nil)
	cl := g.Listener(ln).(*capListener)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(cl) }()
	defer func() {
		srv.Close()
		<-done
	}()
	newClient := func() *http.Client {
		tr := &http.Transport{DialContext: ln.dial}
		t.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr}
	}
	get := func(c *http.Client) int {
		t.Helper()
		resp, err := c.Get("http://pipe/livez")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	for range 2 { // each keeps its connection open, idle
		if code := get(newClient()); code != 200 {
			t.Fatalf("under the cap: %d", code)
		}
		// The server marks a connection idle once its answer is out.
		synctest.Wait()
		// The bubble's clock moves on: the first connection is idle longer.
		time.Sleep(time.Second)
	}
	idleSince := func() []time.Time {
		cl.mu.Lock()
		defer cl.mu.Unlock()
		var ts []time.Time
		for _, since := range cl.idle {
			ts = append(ts, since)
		}
		slices.SortFunc(ts, time.Time.Compare)
		return ts
	}
	before := idleSince()
	if len(before) != 2 {
		t.Fatalf("%d connections idle, want 2", len(before))
	}
	if code := get(newClient()); code != 200 {
		t.Fatalf("a probe with every place held by idle connections: %d", code)
	}
	synctest.Wait()
	if after := idleSince(); len(after) != 2 || slices.Contains(after, before[0]) || !slices.Contains(after, before[1]) {
		t.Errorf("idle since %v, then %v after the probe: want the one idle longest closed", before, after)
	}
	if got := g.Hits(LimitConnections); got != 1 {
		t.Errorf("connection hits %d, want 1", got)
	}
}

// A flood of silent connections (opened, nothing sent: no ZeroMQ, no HTTP)
// holds every place under the cap; a health probe still gets in, taking
// the place of the one silent the longest, and a kept-alive client's idle
// connection is not shed while a silent one is left. From one address the
// per-address cap sheds that address's silent connections first, and
// connections from another address keep their places. Real sockets on
// loopback (127.0.0.2 is a second address of it).
func TestRedTeamSilentConnectionsYieldToRequests(t *testing.T) {
	const cap = 16
	g := NewGuard(Limits{HeaderTimeout: time.Minute, BodyTimeout: time.Minute, MaxConns: cap, MaxConnsPerAddr: 8})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := g.Listener(ln).(*capListener)
	srv := g.Server(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }), nil)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(cl) }()
	defer func() { srv.Close(); <-done }()
	addr := ln.Addr().String()
	openConns := func() int64 { return cl.open.Load() }
	dialFrom := func(local string) net.Conn {
		t.Helper()
		d := net.Dialer{Timeout: 10 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// A client from 127.0.0.1 with a kept-alive connection, idle.
	var keepDials atomic.Int32
	keep := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		keepDials.Add(1)
		return dialFrom("127.0.0.1"), nil
	}}
	defer keep.CloseIdleConnections()
	kc := &http.Client{Transport: keep, Timeout: 10 * time.Second}
	get := func(c *http.Client) int {
		t.Helper()
		resp, err := c.Get("http://" + addr + "/livez")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(kc); code != 200 {
		t.Fatalf("the kept-alive client: %d", code)
	}
	// Silent connections: 7 from 127.0.0.1 (with the kept-alive one, that
	// address's 8), and 12 from 127.0.0.2, past its cap of 8.
	for range 7 {
		dialFrom("127.0.0.1")
	}
	for range 12 {
		dialFrom("127.0.0.2")
	}
	// Each of 127.0.0.2's connections past its 8 took the place of its
	// oldest silent one.
	waitfor.For(t, "every connection accepted", 10*time.Second, func() bool {
		cl.mu.Lock()
		defer cl.mu.Unlock()
		return g.Hits(LimitPerAddress) == 4 && len(cl.byAddr["127.0.0.1"]) == 8 && len(cl.byAddr["127.0.0.2"]) == 8
	})
	if n := openConns(); n != cap {
		t.Fatalf("%d connections open, want the cap %d", n, cap)
	}
	// Every place is held; a probe from a third address gets in.
	probe := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return dialFrom("127.0.0.3"), nil }}}
	for i := range 5 {
		if code := get(probe); code != 200 {
			t.Fatalf("probe %d with every place held by silent connections: %d", i, code)
		}
	}
	// The kept-alive client's connection is still its own: it is served
	// on it, not on a new one.
	if code := get(kc); code != 200 || keepDials.Load() != 1 {
		t.Fatalf("the kept-alive client after the flood: %d on its connection number %d, want its first", code, keepDials.Load())
	}
	// The first probe took a silent connection's place; each later one
	// the place the last probe left.
	if got := g.Hits(LimitConnections); got < 1 {
		t.Errorf("connection hits %d, want the first probe's", got)
	}
}
