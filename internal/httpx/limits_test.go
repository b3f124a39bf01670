package httpx

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRedTeamIdleConnectionsYield: kept-alive connections idle between
// requests hold every place under the cap; a new connection (a health
// probe) takes the place of the one idle longest instead of being
// refused, and the hit is counted.
func TestRedTeamIdleConnectionsYield(t *testing.T) {
	g := NewGuard(Limits{HeaderTimeout: 5 * time.Second, BodyTimeout: 5 * time.Second, MaxConns: 2})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := g.Server(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }), nil)
	cl := g.Listener(ln).(*capListener)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(cl) }()
	defer func() {
		srv.Close()
		<-done
	}()
	base := "http://" + ln.Addr().String()
	get := func(c *http.Client) int {
		t.Helper()
		resp, err := c.Get(base + "/livez")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	for range 2 { // each keeps its connection open, idle
		c := &http.Client{Transport: &http.Transport{}}
		defer c.CloseIdleConnections()
		if code := get(c); code != 200 {
			t.Fatalf("under the cap: %d", code)
		}
	}
	// The server marks a connection idle once its answer is out.
	waitfor.NoError(t, "both connections idle", 5*time.Second, func() error {
		cl.mu.Lock()
		n := len(cl.idle)
		cl.mu.Unlock()
		if n != 2 {
			return fmt.Errorf("%d connections idle, want 2", n)
		}
		return nil
	})
	probe := &http.Client{Transport: &http.Transport{}}
	defer probe.CloseIdleConnections()
	if code := get(probe); code != 200 {
		t.Fatalf("a probe with every place held by idle connections: %d", code)
	}
	if got := g.Hits(LimitConnections); got != 1 {
		t.Errorf("connection hits %d, want 1", got)
	}
}
