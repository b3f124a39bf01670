package zmqlink

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRedTeamConnectionFlood: a stranger opens many connections to an
// Inbox and holds them, silent, to take the process's descriptors. Past
// MaxConnections each new one is shut at once and counted, those within
// it are kept, and a real peer that was refused meanwhile gets in once
// the stranger lets go; both backends, with and without Auth (each has
// its own monitor). Without the cap no connection is shut.
func TestRedTeamConnectionFlood(t *testing.T) {
	for _, b := range backends {
		for _, auth := range []*PlainAuth{nil, &testAuth} {
			t.Run(fmt.Sprintf("%s/auth=%v", b.name, auth != nil), func(t *testing.T) {
				testConnectionFlood(t, b.zc, auth)
			})
		}
	}
}

func testConnectionFlood(t *testing.T, zc bool, auth *PlainAuth) {
	checkGoroutines(t)
	const limit, flood = 4, 12
	var c collector
	in, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth},
		HandshakeTimeout: time.Minute, MaxConnections: limit})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	addr := strings.TrimPrefix(in.Endpoint(), "tcp://")
	ended := make(chan int, flood)
	conns := make([]net.Conn, flood)
	for i := range conns {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conns[i] = conn
		go func() {
			readUntilEnd(conn, 20*time.Second)
			ended <- i
		}()
		// One at a time, so that the first limit are the ones kept.
		waitfor.For(t, "the connection seen", 5*time.Second, func() bool {
			s := in.Stats()
			return s.Connections+int64(s.ConnectionsRefused) == int64(i+1)
		})
	}
	for range flood - limit {
		if i := <-ended; i < limit {
			t.Fatalf("connection %d, within the cap of %d, was shut", i, limit)
		}
	}
	// The cap's refusals are its own: neither lost peers nor failed
	// authentications.
	waitfor.For(t, "the shut connections' hang-ups read", 5*time.Second, func() bool { return in.conns.closing.Load() == 0 })
	if s := in.Stats(); s.Connections != limit || s.ConnectionsRefused != flood-limit || s.Disconnects != 0 || s.AuthDenied != 0 {
		t.Fatalf("after the flood: %d open, %d refused, %d disconnects, %d denied; want %d, %d, 0, 0",
			s.Connections, s.ConnectionsRefused, s.Disconnects, s.AuthDenied, limit, flood-limit)
	}

	// A member sends while the stranger holds every place: it is refused
	// (and reconnects) until the stranger lets go, then its message lands.
	// With Auth a refused connection is shut before its handshake is
	// answered, so nothing comes through it; without, the handshake needs
	// no answer from the Inbox and a message may slip through, or be lost
	// with the connection, before the shutdown: the member sends again.
	out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth}})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := out.Send(ctx, in.Endpoint(), msg(1)); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the member refused", 5*time.Second, func() bool { return in.Stats().ConnectionsRefused > flood-limit })
	if auth != nil && c.len() != 0 {
		t.Fatal("a message came through a connection past the cap")
	}
	for _, conn := range conns[:limit] {
		conn.Close()
	}
	if auth == nil {
		if err := out.Send(ctx, in.Endpoint(), msg(2)); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "the member's message, once the stranger let go", 10*time.Second, func() bool { return c.len() >= 1 })
}

// A connection whose hang-up the monitor dropped is found when the cap is
// reached: the descriptors remembered are no longer connections on the
// port, so they are forgotten and the new connection takes a place.
func TestConnCapForgetsLostHangUps(t *testing.T) {
	c := newConnCap(2)
	c.bound("tcp://127.0.0.1:5557")
	c.event(eventAccepted, 1<<20) // descriptors no process has open
	c.event(eventAccepted, 1<<20+1)
	c.event(eventAccepted, 1<<20+2)
	if _, ok := c.live[1<<20+2]; !ok || c.open.Load() != 1 || c.refused.Load() != 0 {
		t.Fatalf("live %v, %d open, %d refused: want only the last accept, none refused", c.live, c.open.Load(), c.refused.Load())
	}
}
