package server

import (
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRedTeamSilentFloodOnPDSockets: a stranger with no credential and no
// ZeroMQ opens twice --pd-max-connections silent TCP connections to a
// decode's KV socket and to a prefill's control socket, and reopens each
// as it is shut. The pair's own connections, first made during the flood,
// get in and a PD request is served; /debug/v1/pd and /metrics name what
// was shed and from where. Before the pending bounds, the silent
// connections held every place for the handshake timeout (here a
// minute), and the request failed.
func TestRedTeamSilentFloodOnPDSockets(t *testing.T) {
	secret, _ := clusterauth.Generate()
	const limit = 16
	pe, de, registry := newPDServers(t, serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: serve.PDConfig{Secret: secret, MaxConnections: limit, HandshakeTimeout: time.Minute,
			BootstrapTimeout: 20 * time.Second, TransferTimeout: 20 * time.Second}})
	socketOf := func(e *env) string {
		var r debug.PDResponse
		getJSON(t, e, debug.PDPath, &r)
		ep := r.Ranks[0].Socket.Endpoint
		return strings.TrimPrefix(ep, "tcp://")
	}
	stop := make(chan struct{})
	var flooders []chan struct{}
	for _, addr := range []string{socketOf(de), socketOf(pe)} {
		done := make(chan struct{})
		flooders = append(flooders, done)
		opened := make(chan struct{})
		go flood(addr, 2*limit, stop, opened, done)
		<-opened
	}
	defer func() {
		close(stop)
		for _, done := range flooders {
			<-done
		}
	}()
	for _, e := range []*env{de, pe} {
		waitfor.For(t, "the flood past the cap", 20*time.Second, func() bool {
			var r debug.PDResponse
			getJSON(t, e, debug.PDPath, &r)
			return r.Ranks[0].Socket.ConnectionsRefused >= limit
		})
	}

	pb, db := pdHalves(redPrompt, 41, registry)
	type reply struct {
		code int
		body []byte
	}
	pch := make(chan reply, 1)
	go func() {
		code, body := postSigned(t, pe, "/v1/completions", pb, secret, time.Now(), nil)
		pch <- reply{code, body}
	}()
	dcode, dbody := postSigned(t, de, "/v1/completions", db, secret, time.Now(), nil)
	if pr := <-pch; dcode != http.StatusOK || pr.code != http.StatusOK || !strings.Contains(string(dbody), `"finish_reason":"length"`) {
		t.Fatalf("a PD request during the flood: decode %d %s, prefill %d %s; want both served", dcode, dbody, pr.code, pr.body)
	}
	for _, e := range []*env{de, pe} {
		role := e.eng.Config().Role
		var r debug.PDResponse
		getJSON(t, e, debug.PDPath, &r)
		s := r.Ranks[0].Socket
		if s.ConnectionsShed < limit || !strings.Contains(s.LastShed, "127.0.1.1") {
			t.Errorf("%s socket: %d shed, last %q; want the flood shed and its source named", role, s.ConnectionsShed, s.LastShed)
		}
		if got := scrape(t, e).must(t, `pdkit_pd_connections_shed_total{rank="0"}`); got < limit {
			t.Errorf("%s pdkit_pd_connections_shed_total %v, want at least %d", role, got, limit)
		}
	}
}

// flood keeps n silent TCP connections from 127.0.1.1 open to addr,
// reopening each one the server shuts, until stop; opened is closed once
// the first n are open, done when every connection is closed.
func flood(addr string, n int, stop <-chan struct{}, opened, done chan<- struct{}) {
	defer close(done)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	ended := make(chan struct{}, 4*n)
	dial := func() {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1, 1)}, Timeout: 5 * time.Second}
		conn, err := d.Dial("tcp", addr)
		if err != nil {
			return
		}
		conns = append(conns, conn)
		go func() {
			conn.SetReadDeadline(time.Now().Add(time.Minute))
			buf := make([]byte, 64)
			for {
				if _, err := conn.Read(buf); err != nil {
					break
				}
			}
			ended <- struct{}{}
		}()
	}
	for range n {
		dial()
	}
	close(opened)
	for {
		select {
		case <-stop:
			return
		case <-ended:
			dial()
		}
	}
}
