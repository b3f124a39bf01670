package router

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/httpx"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// guarded serves the router behind an httpx.Guard of limits on a real
// listener, as pdserve router does, and returns its base URL.
func guarded(t *testing.T, c *cluster, g *httpx.Guard) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return serveGuarded(t, ln, c, g)
}

// guardedMem is guarded on the in-memory network m, for a test in a
// synctest bubble.
func guardedMem(t *testing.T, m *memNet, c *cluster, g *httpx.Guard) string {
	t.Helper()
	ln := m.Listen("guarded")
	return serveGuarded(t, ln, c, g)
}

// waitHits polls the guard until limit was hit want times.
func waitHits(t *testing.T, g *httpx.Guard, limit string, want uint64, within time.Duration) {
	t.Helper()
	waitfor.NoError(t, limit+" hits", within, func() error {
		if got := g.Hits(limit); got < want {
			return fmt.Errorf("%d, want %d", got, want)
		}
		return nil
	})
}

// metricLine returns the /metrics line of pdkit_http_limit_hits_total
// for limit.
func metricLine(t *testing.T, client *http.Client, base, limit string) string {
	t.Helper()
	resp, err := client.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for line := range strings.SplitSeq(string(body), "\n") {
		if strings.HasPrefix(line, `pdkit_http_limit_hits_total{limit="`+limit+`"}`) {
			return line
		}
	}
	return ""
}

// slowBodies opens n connections that each send a generation request's
// headers and then its body a byte at a time every interval, and returns
// a channel that gets, per connection, the first line of its answer (or
// the read error) once the server has answered or closed it.
func slowBodies(t *testing.T, m *memNet, addr string, n int, interval time.Duration) <-chan string {
	t.Helper()
	out := make(chan string, n)
	body := `{"prompt":"` + strings.Repeat("x", 4000) + `"}`
	for range n {
		conn, err := m.Dial(t.Context(), addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(body))
		stop := make(chan struct{})
		go func() {
			for i := 0; i < len(body); i++ {
				select {
				case <-stop:
					return
				case <-time.After(interval):
				}
				if _, err := conn.Write([]byte{body[i]}); err != nil {
					return
				}
			}
		}()
		go func() {
			defer close(stop)
			line, err := bufio.NewReader(conn).ReadString('\n')
			if err != nil {
				line = "error: " + err.Error()
			}
			out <- line
		}()
	}
	return out
}

// Connections that send their body slowly are answered 408 and cut at the
// body timeout, and counted, while a normal request is served meanwhile.
// It runs in a synctest bubble over an in-memory network: the body
// timeout fires on the bubble's clock, at 500ms of it however loaded the
// machine is.
func TestRedTeamSlowBody(t *testing.T) {
	synctest.Test(t, func(t *testing.T) { testSlowBody(t, 20) })
}

// testSlowBody runs inside a synctest bubble.
func testSlowBody(t *testing.T, n int) {
	const bodyTimeout = 500 * time.Millisecond
	m := newMemNet()
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d := newMemStub(t, m, pdproto.RoleDecode, nil)
	g := httpx.NewGuard(httpx.Limits{HeaderTimeout: 5 * time.Second, BodyTimeout: bodyTimeout, MaxConns: n + 16})
	c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.Guard = g })
	base := guardedMem(t, m, c, g)
	client := m.client(t)
	start := time.Now()
	answers := slowBodies(t, m, strings.TrimPrefix(base, "http://"), n, 50*time.Millisecond)

	// Served meanwhile.
	resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("a normal request beside the slow ones: %d %s", resp.StatusCode, body)
	}
	for range n {
		select {
		case line := <-answers:
			if !strings.Contains(line, " 408 ") {
				t.Fatalf("a slow body's answer: %q, want 408", line)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("slow bodies still held after %v (body timeout %v)", time.Since(start), bodyTimeout)
		}
	}
	// The bubble's clock moves only when everything waits: the slow
	// bodies were cut at the body timeout, to the tick of their writers.
	if took := time.Since(start); took < bodyTimeout || took > bodyTimeout+50*time.Millisecond {
		t.Errorf("the slow bodies were cut after %v, want the %v body timeout", took, bodyTimeout)
	}
	waitHits(t, g, httpx.LimitBodyTimeout, uint64(n), 5*time.Second)
	if line := metricLine(t, client, base, httpx.LimitBodyTimeout); !strings.HasSuffix(line, fmt.Sprintf(" %d", n)) {
		t.Errorf("metrics: %q, want %d body timeouts", line, n)
	}
	if p.count() != 1 {
		t.Errorf("the servers got %d requests, want only the normal one", p.count())
	}
}

// Connections that send their headers slowly (or nothing) are closed at
// the header timeout and counted. In a synctest bubble over an in-memory
// network, the header timeout fires on the bubble's clock.
func TestRedTeamSlowHeaders(t *testing.T) {
	synctest.Test(t, testSlowHeaders)
}

func testSlowHeaders(t *testing.T) {
	const headerTimeout = 300 * time.Millisecond
	m := newMemNet()
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d := newMemStub(t, m, pdproto.RoleDecode, nil)
	g := httpx.NewGuard(httpx.Limits{HeaderTimeout: headerTimeout, BodyTimeout: 5 * time.Second, MaxConns: 64})
	c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.Guard = g })
	base := guardedMem(t, m, c, g)
	const n = 6
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		conn, err := m.Dial(t.Context(), strings.TrimPrefix(base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		wg.Go(func() {
			if i%2 == 0 {
				conn.Write([]byte("GET /health HTTP/1.1\r\nHost: r")) // never ends its headers
			}
			conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadAll(conn); err != nil {
				t.Errorf("a slow header connection was not closed: %v", err)
			}
		})
	}
	wg.Wait()
	if took := time.Since(start); took < headerTimeout || took > headerTimeout+time.Millisecond {
		t.Errorf("the slow header connections were closed after %v, want the %v header timeout", took, headerTimeout)
	}
	waitHits(t, g, httpx.LimitHeaderTimeout, n, 5*time.Second)
	// A kept-alive connection that idles is not a hit.
	resp, err := m.client(t).Get(base + "/health")
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if got := g.Hits(httpx.LimitHeaderTimeout); got != n {
		t.Errorf("header timeout hits %d, want %d", got, n)
	}
}

// Connections past the cap are answered 503 at once and counted; under
// the cap they are served, and a freed place serves again.
func TestRedTeamConnectionCap(t *testing.T) {
	const capacity = 4
	p := newStub(t, pdproto.RolePrefill, blocking)
	d := newStub(t, pdproto.RoleDecode, blocking)
	g := httpx.NewGuard(httpx.Limits{HeaderTimeout: 5 * time.Second, BodyTimeout: 5 * time.Second, MaxConns: capacity, MaxConnsPerAddr: 4 * capacity})
	c := start(t, []*stub{p}, []*stub{d}, func(o *Options) { o.Guard = g })
	base := guarded(t, c, g)
	addr := strings.TrimPrefix(base, "http://")

	// capacity streams hold every place, each on its own connection.
	var cancels []context.CancelFunc
	for i := range capacity {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		cancels = append(cancels, cancel)
		client := &http.Client{Transport: &http.Transport{}}
		req, _ := http.NewRequestWithContext(ctx, "POST", base+"/v1/completions", strings.NewReader(`{"prompt":"hold","stream":true}`))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("stream %d under the cap: %v", i, err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("stream %d under the cap: %d", i, resp.StatusCode)
		}
	}

	// Past the cap: refused at once, before anything is read.
	for i := range 3 {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, err := io.ReadAll(conn)
		conn.Close()
		if err != nil || !strings.HasPrefix(string(got), "HTTP/1.1 503 ") || !strings.Contains(string(got), "too many connections") {
			t.Fatalf("connection %d past the cap: %q %v", i, got, err)
		}
	}
	if got := g.Hits(httpx.LimitConnections); got != 3 {
		t.Errorf("connection hits %d, want 3", got)
	}

	// A place freed serves again.
	cancels[0]()
	waitfor.NoError(t, "a place freed after a stream ended", 5*time.Second, func() error {
		client := &http.Client{Transport: &http.Transport{}}
		resp, err := client.Get(base + "/health")
		if err != nil {
			return err
		}
		if body := readAll(t, resp); resp.StatusCode != 200 {
			return fmt.Errorf("%d %s", resp.StatusCode, body)
		}
		return nil
	})
	if line := metricLine(t, http.DefaultClient, c.srv.URL, httpx.LimitConnections); !strings.HasPrefix(line, "pdkit_http_limit_hits_total") {
		t.Errorf("metrics: no connections line: %q", line)
	}
}

// The body timeout bounds reading the body only: a stream that lasts far
// longer than it, on a connection whose body came in time, is not cut. In
// a synctest bubble over an in-memory network: the stream outlasts the
// body timeout on the bubble's clock, which the deadline under test reads.
func TestBodyTimeoutSparesStreams(t *testing.T) {
	synctest.Test(t, testBodyTimeoutSparesStreams)
}

func testBodyTimeoutSparesStreams(t *testing.T) {
	const bodyTimeout = 100 * time.Millisecond
	m := newMemNet()
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d := newMemStub(t, m, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			for range 8 {
				openai.WriteEvent(w, map[string]any{"id": "cmpl-1", "choices": []any{map[string]any{"text": "a"}}})
				w.(http.Flusher).Flush()
				// The bubble's clock moves between events: the stream
				// must outlast the body timeout.
				time.Sleep(50 * time.Millisecond)
			}
			openai.WriteDone(w)
		}
	})
	g := httpx.NewGuard(httpx.Limits{HeaderTimeout: 5 * time.Second, BodyTimeout: bodyTimeout, MaxConns: 8})
	c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.Guard = g })
	base := guardedMem(t, m, c, g)
	client := m.client(t)
	for range 2 { // the second on the kept-alive connection
		start := time.Now()
		resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x","stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		if body := readAll(t, resp); resp.StatusCode != 200 || !strings.Contains(body, "[DONE]") {
			t.Fatalf("a stream longer than the body timeout: %d %q", resp.StatusCode, body)
		}
		if took := time.Since(start); took < 4*bodyTimeout {
			t.Fatalf("the stream lasted %v, not past the %v body timeout", took, bodyTimeout)
		}
	}
	if h := g.Hits(httpx.LimitBodyTimeout) + g.Hits(httpx.LimitHeaderTimeout); h != 0 {
		t.Errorf("limit hits %d on streams that sent their request in time", h)
	}
}

// serveGuarded serves the router of c on ln through guard g until the test
// ends, and returns its URL.
func serveGuarded(t *testing.T, ln net.Listener, c *cluster, g *httpx.Guard) string {
	t.Helper()
	srv := g.Server(c.rt, nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv.Serve(g.Listener(ln))
	}()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return "http://" + ln.Addr().String()
}
