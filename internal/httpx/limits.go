package httpx

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdkit/pdkit/api/openai"
)

// Limits bound what a client can hold of a listener, so that slow or
// idle connections cannot take all of a server's connections or goroutines:
// how long reading a request's headers and body may take, and how many
// connections may be open at once. A zero field is no limit.
type Limits struct {
	// HeaderTimeout bounds reading a request's headers, from the first
	// byte (or the connection's opening) to the blank line.
	HeaderTimeout time.Duration
	// BodyTimeout bounds reading a request's body. It is a read deadline
	// set around the body only and cleared before the handler runs: a
	// response, a long SSE stream included, is never cut by it.
	BodyTimeout time.Duration
	// MaxConns caps the connections open at once on one listener; one
	// past the cap takes the place of the connection that has waited the
	// longest without sending a whole request, else of the kept-alive
	// connection idle the longest, or, when there is neither, is answered
	// 503 and closed at once.
	MaxConns int
	// MaxConnsPerAddr caps the connections one remote address holds, by
	// the same rule within that address's (zero: a quarter of MaxConns,
	// and no fewer than 64 or MaxConns), so that one client cannot hold
	// every place.
	MaxConnsPerAddr int
	// MaxBodyBytes is how much of a body is read under BodyTimeout before
	// the handler runs (default openai.DefaultMaxBodyBytes); the rest of a
	// larger body stays under the deadline for the handler, whose own
	// bound refuses it.
	MaxBodyBytes int64
}

// Defaults of the listener limits, the flags' defaults.
const (
	DefaultHeaderTimeout = 10 * time.Second
	DefaultBodyTimeout   = 30 * time.Second
	DefaultMaxConns      = 4096
)

// IdleTimeout is how long a kept-alive connection may wait for its next
// request: longer than the routers' idle pool (90s), so that a pooled
// connection is closed by its client first.
const IdleTimeout = 2 * time.Minute

// Limit names, the limit label of pdkit_http_limit_hits_total.
const (
	LimitHeaderTimeout = "header_timeout"
	LimitBodyTimeout   = "body_timeout"
	LimitConnections   = "connections"
	LimitPerAddress    = "connections_per_address"
	LimitAcceptErrors  = "accept_errors"
	LimitDescriptors   = "descriptors"
)

var limitNames = []string{LimitHeaderTimeout, LimitBodyTimeout, LimitConnections, LimitPerAddress, LimitAcceptErrors, LimitDescriptors}

var hitsDesc = prometheus.NewDesc("pdkit_http_limit_hits_total",
	"Requests or connections cut by a listener limit: header_timeout (headers not read within --header-timeout), body_timeout (body not read within --body-timeout, answered 408), connections (a connection past --max-connections: the connection waiting longest without a whole request, else the longest-idle kept-alive one, closed for it, or, with neither, it answered 503 and closed), connections_per_address (likewise, past --max-connections-per-address from one address), accept_errors (accepting failed, as when the process is out of file descriptors), descriptors (with the process out of file descriptors, a connection closed to free one: the longest waiting without a whole request, else the longest-idle kept-alive one, or, with neither, the newcomer answered 503 on the listener's spare descriptor).",
	[]string{"limit"}, nil)

// Guard enforces Limits on the listeners and servers it wraps and counts
// each limit hit. Safe for concurrent use.
type Guard struct {
	limits Limits
	hits   [6]atomic.Uint64 // by limitNames' order
	// clampedFrom is the MaxConns asked for when the descriptor limit
	// lowered it (0: not lowered).
	clampedFrom int
}

// NewGuard returns a Guard of l.
func NewGuard(l Limits) *Guard {
	if l.MaxBodyBytes <= 0 {
		l.MaxBodyBytes = openai.DefaultMaxBodyBytes
	}
	g := &Guard{}
	if limit := descriptorLimit(); l.MaxConns > 0 && limit > 0 {
		if most := ConnsWithin(limit); l.MaxConns > most {
			g.clampedFrom, l.MaxConns = l.MaxConns, most
		}
	}
	if l.MaxConnsPerAddr <= 0 {
		l.MaxConnsPerAddr = max(min(l.MaxConns, 64), l.MaxConns/4)
	}
	g.limits = l
	return g
}

// ConnsWithin is the most connections a listener takes in a process that
// may open limit file descriptors: the limit less a reserve (an eighth,
// and at least 32) for the model file, the PD sockets, the logs and the
// server's own connections, so that a flood of connections meets the cap,
// where the oldest silent one is shed for the newcomer, before the process
// runs out of descriptors.
func ConnsWithin(limit int) int {
	return max(1, limit-max(32, limit/8))
}

// Clamped reports the --max-connections asked for and the one taken when
// the process's descriptor limit lowered it (ConnsWithin); ok is false when
// it did not.
func (g *Guard) Clamped() (asked, taken int, ok bool) {
	return g.clampedFrom, g.limits.MaxConns, g.clampedFrom > 0
}

// Limits returns the guard's limits.
func (g *Guard) Limits() Limits { return g.limits }

// Hits returns how many times limit (a Limit* name) was hit.
func (g *Guard) Hits(limit string) uint64 {
	for i, n := range limitNames {
		if n == limit {
			return g.hits[i].Load()
		}
	}
	return 0
}

func (g *Guard) hit(limit string) {
	for i, n := range limitNames {
		if n == limit {
			g.hits[i].Add(1)
		}
	}
}

// Describe and Collect make the Guard a Prometheus collector of
// pdkit_http_limit_hits_total; register it on the server's /metrics.
func (g *Guard) Describe(ch chan<- *prometheus.Desc) { ch <- hitsDesc }

func (g *Guard) Collect(ch chan<- prometheus.Metric) {
	for i, n := range limitNames {
		ch <- prometheus.MustNewConstMetric(hitsDesc, prometheus.CounterValue, float64(g.hits[i].Load()), n)
	}
}

// Server returns an http.Server that serves h under the limits: the
// header timeout, the body timeout (around reading the body, see
// Limits.BodyTimeout) and IdleTimeout. It has no WriteTimeout, which
// would cut long streams. Serve it on Listener's wrapper, which enforces
// the connection cap and counts header timeouts.
func (g *Guard) Server(h http.Handler, errorLog *log.Logger) *http.Server {
	return &http.Server{
		Handler:           g.readBodyFirst(h),
		ReadHeaderTimeout: g.limits.HeaderTimeout,
		IdleTimeout:       IdleTimeout,
		ErrorLog:          errorLog,
		ConnState:         trackConnState,
	}
}

// Listener wraps ln: a connection past Limits.MaxConns takes the place of
// the kept-alive connection idle the longest, closed for it; when none is
// idle it is answered 503 with Retry-After and closed without its request
// being read (a client whose request is already on the wire may see a
// reset instead), so that it costs neither a goroutine nor a wait; a
// client or load balancer learns to retry elsewhere. Both are counted. Each connection also reports a header
// timeout to the guard.
func (g *Guard) Listener(ln net.Listener) net.Listener {
	l := &capListener{Listener: ln, g: g}
	l.spare, _ = os.Open(os.DevNull) // nil when even that fails: relieve then sheds only
	return l
}

type capListener struct {
	net.Listener
	g    *Guard
	open atomic.Int64
	// spare is a descriptor held back for when the process has run out:
	// closed, it lets Accept take the connection waiting in the backlog and
	// answer it (relieve). Only Accept's goroutine touches it.
	spare *os.File

	mu sync.Mutex
	// Every open connection, by its state: pending (accepted, or idle, and
	// waiting for a whole request: a silent stranger's look like this
	// until the header timeout) since when, idle (kept alive between
	// requests) since when; and the open connections per remote address.
	pending map[*guardedConn]time.Time
	idle    map[*guardedConn]time.Time
	byAddr  map[string][]*guardedConn
}

// markIdle records whether c waits between requests.
func (l *capListener) markIdle(c *guardedConn, idle bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.pending, c)
	if !idle {
		delete(l.idle, c)
		return
	}
	if l.idle == nil {
		l.idle = map[*guardedConn]time.Time{}
	}
	l.idle[c] = time.Now()
}

// sheddable picks the connection to close for a new one among those of
// within (nil: all): the one that has waited longest without sending a
// whole request, else the kept-alive one idle the longest; nil when every
// one is busy with a request. l.mu is held.
func (l *capListener) sheddable(within func(*guardedConn) bool) *guardedConn {
	for _, m := range []map[*guardedConn]time.Time{l.pending, l.idle} {
		var oldest *guardedConn
		var since time.Time
		for c, t := range m {
			if (within == nil || within(c)) && (oldest == nil || t.Before(since)) {
				oldest, since = c, t
			}
		}
		if oldest != nil {
			return oldest
		}
	}
	return nil
}

// shed closes a connection to make room for a new one (see sheddable):
// a connection that holds a place under the cap and no request in the
// server's hands must not keep a health probe, or anyone, out.
func (l *capListener) shed(within func(*guardedConn) bool) bool {
	l.mu.Lock()
	c := l.sheddable(within)
	if c != nil {
		delete(l.pending, c)
		delete(l.idle, c)
	}
	l.mu.Unlock()
	if c == nil {
		return false
	}
	c.Close()
	return true
}

// refusal is the whole answer to a connection past the cap.
var refusal = func() []byte {
	b, _ := json.Marshal(openai.ServerError("too many connections to this server; retry later").Body())
	b = append(b, '\n')
	return append(fmt.Appendf(nil, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"+
		"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n", len(b)), b...)
}()

// remote is c's remote address without its port.
func remote(c net.Conn) string {
	a := c.RemoteAddr()
	if a == nil {
		return ""
	}
	if host, _, err := net.SplitHostPort(a.String()); err == nil {
		return host
	}
	return a.String()
}

func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				l.closeSpare()
				return nil, err
			}
			l.g.hit(LimitAcceptErrors)
			if outOfDescriptors(err) && l.relieve() {
				continue
			}
			return nil, err // the server retries, backing off
		}
		addr := remote(c)
		l.mu.Lock()
		fromAddr := len(l.byAddr[addr])
		l.mu.Unlock()
		if per := l.g.limits.MaxConnsPerAddr; l.g.limits.MaxConns > 0 && fromAddr >= per {
			l.g.hit(LimitPerAddress)
			if !l.shed(func(o *guardedConn) bool { return o.addr == addr }) {
				refuse(c)
				continue
			}
		}
		if n := l.open.Add(1); l.g.limits.MaxConns > 0 && n > int64(l.g.limits.MaxConns) {
			l.g.hit(LimitConnections)
			if !l.shed(nil) {
				l.open.Add(-1)
				refuse(c)
				continue
			}
		}
		return l.guard(c, addr), nil
	}
}

// relieve frees a descriptor for the next Accept when the process has run
// out: it closes the connection that has waited longest without sending a
// whole request, else the kept-alive one idle the longest (as the cap
// does), so that a flood of silent connections cannot keep a health probe
// out even past the descriptor limit. With neither (every connection is
// busy with a request), it spends the spare descriptor on the connection
// waiting in the backlog, answering it 503 so that its client learns at
// once, and takes the spare back. It reports whether the next Accept may
// succeed.
func (l *capListener) relieve() bool {
	if l.shed(nil) {
		l.g.hit(LimitDescriptors)
		return true
	}
	if l.spare == nil {
		l.spare, _ = os.Open(os.DevNull)
		return false
	}
	l.spare.Close()
	l.spare = nil
	c, err := l.Listener.Accept()
	if err == nil {
		l.g.hit(LimitDescriptors)
		refuse(c)
	}
	l.spare, _ = os.Open(os.DevNull)
	return err == nil
}

// closeSpare gives the spare descriptor back once the listener is closed.
func (l *capListener) closeSpare() {
	if l.spare != nil {
		l.spare.Close()
		l.spare = nil
	}
}

// outOfDescriptors reports whether err is the process's or the system's
// file descriptor limit.
func outOfDescriptors(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

// refuse answers a connection past a cap 503 and closes it, without
// reading its request.
func refuse(c net.Conn) {
	c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	c.Write(refusal)
	c.Close()
}

// guard wraps an accepted connection, counted in open and pending until
// it sends a whole request.
func (l *capListener) guard(c net.Conn, addr string) *guardedConn {
	gc := &guardedConn{Conn: c, g: l.g, l: l, addr: addr}
	l.mu.Lock()
	if l.pending == nil {
		l.pending, l.byAddr = map[*guardedConn]time.Time{}, map[string][]*guardedConn{}
	}
	l.pending[gc] = time.Now()
	l.byAddr[addr] = append(l.byAddr[addr], gc)
	l.mu.Unlock()
	gc.release = sync.OnceFunc(func() {
		l.mu.Lock()
		delete(l.pending, gc)
		delete(l.idle, gc)
		if cs := slices.DeleteFunc(l.byAddr[addr], func(o *guardedConn) bool { return o == gc }); len(cs) > 0 {
			l.byAddr[addr] = cs
		} else {
			delete(l.byAddr, addr)
		}
		l.mu.Unlock()
		l.open.Add(-1)
	})
	return gc
}

// guardedConn is a connection of a capListener: its Close frees its place
// under the cap, and a read that times out while the server waits for a
// request's headers counts as a header timeout.
type guardedConn struct {
	net.Conn
	g       *Guard
	l       *capListener
	addr    string // the remote address, without its port
	release func()
	// active is set while the server handles a request on the conn (the
	// http.Server's StateActive): its reads are then the body's, timed by
	// the body timeout.
	active atomic.Bool
	// served says a request was read; readSince that bytes came since the
	// conn last went idle. A kept-alive connection that idles out is not
	// a hit; one that began a request, or never sent one, is.
	served, readSince atomic.Bool
	counted           atomic.Bool // its header timeout is counted
}

func (c *guardedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.readSince.Store(true)
	}
	if err != nil && !c.active.Load() && isTimeout(err) && (c.readSince.Load() || !c.served.Load()) &&
		c.counted.CompareAndSwap(false, true) {
		c.g.hit(LimitHeaderTimeout)
	}
	return n, err
}

func (c *guardedConn) Close() error {
	c.release()
	return c.Conn.Close()
}

// trackConnState follows a guarded connection's state (http.Server.ConnState).
func trackConnState(nc net.Conn, s http.ConnState) {
	c, ok := nc.(*guardedConn)
	if !ok {
		return
	}
	switch s {
	case http.StateActive:
		c.served.Store(true)
		c.active.Store(true)
		c.l.markIdle(c, false)
	case http.StateIdle:
		c.readSince.Store(false)
		c.active.Store(false)
		c.l.markIdle(c, true)
	case http.StateClosed, http.StateHijacked:
		c.release()
	}
}

func isTimeout(err error) bool {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// readBodyFirst reads a request's body (up to Limits.MaxBodyBytes) under
// a read deadline of Limits.BodyTimeout, clears the deadline, and hands
// the handler the body read. A body not read in time is answered 408 and
// counted; the connection is then closed.
func (g *Guard) readBodyFirst(h http.Handler) http.Handler {
	if g.limits.BodyTimeout <= 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
			h.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		if err := rc.SetReadDeadline(time.Now().Add(g.limits.BodyTimeout)); err != nil {
			h.ServeHTTP(w, r) // a writer without deadlines: nothing to enforce with
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, g.limits.MaxBodyBytes+1))
		switch {
		case err != nil && isTimeout(err):
			g.hit(LimitBodyTimeout)
			w.Header().Set("Connection", "close")
			(&openai.Error{Status: http.StatusRequestTimeout, Type: openai.TypeInvalidRequest,
				Message: "the request body was not received within " + g.limits.BodyTimeout.String()}).WriteJSON(w)
			return
		case err != nil:
			(&openai.Error{Status: http.StatusBadRequest, Type: openai.TypeInvalidRequest,
				Message: "reading the body: " + err.Error()}).WriteJSON(w)
			return
		case int64(len(body)) > g.limits.MaxBodyBytes:
			// Larger than any handler takes: the rest stays under the
			// deadline, and the handler's own bound answers.
			r.Body = readCloser{io.MultiReader(bytes.NewReader(body), &countTimeouts{r.Body, g}), r.Body}
		default:
			rc.SetReadDeadline(time.Time{})
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		h.ServeHTTP(w, r)
	})
}

type readCloser struct {
	io.Reader
	io.Closer
}

// countTimeouts counts a read that hits the body deadline.
type countTimeouts struct {
	r io.Reader
	g *Guard
}

func (c *countTimeouts) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	if err != nil && isTimeout(err) {
		c.g.hit(LimitBodyTimeout)
	}
	return n, err
}
