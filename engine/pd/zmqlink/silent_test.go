package zmqlink

import (
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRedTeamSilentConnections: a stranger opens connections to an
// authenticated Inbox and says nothing, to hold the server's descriptors.
// Each is closed once the handshake timeout passes, and counted; both
// backends. (libzmq's own timeout is 30 s: without the bound the
// connections are still open when the test gives up.)
func TestRedTeamSilentConnections(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			checkGoroutines(t)
			var c collector
			in, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: b.zc, Auth: &testAuth},
				HandshakeTimeout: 200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			const n = 20
			addr := strings.TrimPrefix(in.Endpoint(), "tcp://")
			closed := make(chan error, n)
			for range n {
				conn, err := net.Dial("tcp", addr)
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				go func() { closed <- readUntilEnd(conn, 5*time.Second) }()
			}
			for range n {
				if err := <-closed; errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("a silent connection was still open after 5s: %v", err)
				}
			}
			waitfor.For(t, "the silent connections counted", 5*time.Second, func() bool { return in.Stats().AuthDenied >= n })
		})
	}
}

// readUntilEnd reads what the server sends (its greeting) until it ends
// the connection, and returns the read's error; the deadline only ends a
// test that failed (os.ErrDeadlineExceeded).
func readUntilEnd(conn net.Conn, within time.Duration) error {
	conn.SetReadDeadline(time.Now().Add(within))
	buf := make([]byte, 64)
	for {
		if _, err := conn.Read(buf); err != nil {
			return err
		}
	}
}
