package httpx

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
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
	g := NewGuard(Limits{HeaderTimeout: 5 * time.Second, BodyTimeout: 5 * time.Second, MaxConns: 2})
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
