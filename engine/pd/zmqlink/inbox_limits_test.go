package zmqlink

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/procstat"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// rssBytes is the process's resident set size.
func rssBytes(t *testing.T) int64 {
	t.Helper()
	n, err := procstat.Resident(0)
	if err != nil {
		t.Skipf("no resident set to read here: %v", err)
	}
	return n
}

// zmtpPush opens a raw ZMTP 3.0 connection to a PULL socket as a PUSH
// peer with the NULL mechanism: greeting, then READY.
func zmtpPush(t *testing.T, endpoint string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(endpoint, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], "NULL")
	ready := []byte{0x04, 0, 5}
	ready = append(ready, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, 4)
	ready = append(ready, "PUSH"...)
	ready[1] = byte(len(ready) - 2)
	if _, err := c.Write(append(greeting, ready...)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 64)); err != nil { // the Inbox's greeting
		t.Fatal(err)
	}
	go io.Copy(io.Discard, c) // its READY, then EOF when it drops us
	return c
}

// TestRedTeamHugeFrame: a peer that declares a 1 GiB frame is dropped as
// soon as the Inbox reads the frame's header (MaxMsgSize), the drop is
// counted, the receiver's memory does not grow with what the peer sends,
// and the Inbox goes on serving real peers. The peer writes up to 256 MiB
// of the frame: without the bound libzmq takes all of it into a 1 GiB
// buffer; with it the connection is gone after the kernel's socket buffers.
func TestRedTeamHugeFrame(t *testing.T) {
	checkGoroutines(t)
	const maxMsg, declared, sent = 1 << 20, 1 << 30, 256 << 20
	eachBackend(t, func(t *testing.T, zc bool) {
		c := &collector{}
		opts := inOpts(zc)
		opts.MaxMsgSize = maxMsg
		in, err := Listen("tcp://127.0.0.1:0", c.handle, opts)
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		rss := rssBytes(t)
		conn := zmtpPush(t, in.Endpoint())
		defer conn.Close()
		header := binary.BigEndian.AppendUint64([]byte{0x02}, declared) // a long, last frame
		if _, err := conn.Write(header); err != nil {
			t.Fatal(err)
		}
		if err := conn.SetWriteDeadline(time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		chunk := make([]byte, 1<<20)
		accepted := 0
		for accepted < sent {
			n, err := conn.Write(chunk)
			accepted += n
			if err != nil {
				break
			}
		}
		if accepted >= sent {
			t.Fatalf("the Inbox took %d MiB of a %d MiB frame over its %d byte bound", accepted>>20, declared>>20, maxMsg)
		}
		waitfor.For(t, "the dropped peer counted", 10*time.Second, func() bool { return in.Stats().Disconnects == 1 })
		if grew := rssBytes(t) - rss; grew > 64<<20 {
			t.Errorf("resident memory grew %d MiB", grew>>20)
		}
		out, err := NewOutbox(outOpts(zc))
		if err != nil {
			t.Fatal(err)
		}
		defer out.Close()
		if err := out.Send(context.Background(), in.Endpoint(), msg(1)); err != nil {
			t.Fatal(err)
		}
		waitfor.For(t, "a real message after the drop", 10*time.Second, func() bool { return c.len() == 1 })
		t.Logf("the peer's writes failed after %d MiB; %+v", accepted>>20, in.Stats())
	})
}

// TestInboxCountsOversizedPeers: a real peer's frame over MaxMsgSize is
// never delivered, its connection drop is counted, with or without
// authentication (whose handshake monitor then counts it), and the peer's
// next message, on a new connection, arrives.
func TestInboxCountsOversizedPeers(t *testing.T) {
	checkGoroutines(t)
	for _, a := range []struct {
		name string
		auth *PlainAuth
	}{{"null", nil}, {"plain", &testAuth}} {
		auth := a.auth
		t.Run(a.name, func(t *testing.T) {
			eachBackend(t, func(t *testing.T, zc bool) {
				c := &collector{}
				in, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth}, MaxMsgSize: 64 << 10})
				if err != nil {
					t.Fatal(err)
				}
				defer in.Close()
				out := authOutbox(t, zc, auth)
				if err := out.Send(context.Background(), in.Endpoint(), [][]byte{make([]byte, 128<<10)}); err != nil {
					t.Fatal(err)
				}
				waitfor.For(t, "the oversized peer dropped and counted", 10*time.Second, func() bool { return in.Stats().Disconnects >= 1 })
				if err := out.Send(context.Background(), in.Endpoint(), msg(1)); err != nil {
					t.Fatal(err)
				}
				waitfor.For(t, "the next message", 10*time.Second, func() bool { return c.len() == 1 })
				if s := in.Stats(); s.Messages != 1 {
					t.Errorf("delivered %d messages, want the small one only", s.Messages)
				}
			})
		})
	}
}
