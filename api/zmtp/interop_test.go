package zmtp

// Interoperability with the project's real ZeroMQ sockets (libzmq, through
// both backends of engine/pd/zmqlink). Only this test file imports the
// engine; the package itself stays pure Go.

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
)

func eachZeroCopy(t *testing.T, test func(t *testing.T, zc bool)) {
	for _, zc := range []bool{false, true} {
		t.Run(fmt.Sprintf("zerocopy=%v", zc), func(t *testing.T) { test(t, zc) })
	}
}

// TestInteropPushToInbox: what a Push sends, a zmqlink Inbox receives.
func TestInteropPushToInbox(t *testing.T) {
	eachZeroCopy(t, func(t *testing.T, zc bool) {
		got := make(chan [][]byte, 4)
		in, err := zmqlink.Listen("tcp://127.0.0.1:0", func(fr [][]byte) error {
			got <- zmqlink.CloneFrames(fr)
			return nil
		}, &zmqlink.InboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: zc}})
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		abort, err := pdproto.Encode(&pdproto.Abort{Room: 7, Endpoint: "tcp://127.0.0.1:9", Rank: 1, Reason: "pdctl"})
		if err != nil {
			t.Fatal(err)
		}
		big := bytes.Repeat([]byte{0xAB}, 100<<10)
		p, err := Dial(ctx, in.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Send(ctx, abort); err != nil {
			t.Fatal(err)
		}
		if err := p.Send(ctx, [][]byte{{}, big}); err != nil {
			t.Fatal(err)
		}
		p.Close()
		select {
		case m := <-got:
			msg, err := pdproto.Decode(m)
			if err != nil {
				t.Fatal(err)
			}
			if a, ok := msg.(*pdproto.Abort); !ok || *a != (pdproto.Abort{Room: 7, Endpoint: "tcp://127.0.0.1:9", Rank: 1, Reason: "pdctl"}) {
				t.Fatalf("received %#v", msg)
			}
		case <-ctx.Done():
			t.Fatal("the Inbox received nothing")
		}
		select {
		case m := <-got:
			if len(m) != 2 || len(m[0]) != 0 || !bytes.Equal(m[1], big) {
				t.Fatalf("second message: %d frames", len(m))
			}
		case <-ctx.Done():
			t.Fatal("the Inbox received no second message")
		}
	})
}

// TestInteropOutboxToPull: what a zmqlink Outbox sends, a Pull receives.
func TestInteropOutboxToPull(t *testing.T) {
	eachZeroCopy(t, func(t *testing.T, zc bool) {
		p, err := Listen("tcp://127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		out, err := zmqlink.NewOutbox(&zmqlink.OutboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: zc}})
		if err != nil {
			t.Fatal(err)
		}
		defer out.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		big := bytes.Repeat([]byte{0xCD}, 64<<10) // over the shim's zero-copy threshold
		for room := range uint64(3) {
			ack, err := pdproto.Encode(&pdproto.AbortAck{Room: room, Rank: 1, InFlight: room == 2})
			if err != nil {
				t.Fatal(err)
			}
			if err := out.Send(ctx, p.Endpoint(), ack); err != nil {
				t.Fatal(err)
			}
		}
		if err := out.Send(ctx, p.Endpoint(), [][]byte{big, {}, []byte("z")}); err != nil {
			t.Fatal(err)
		}
		for room := range uint64(3) {
			m, err := p.Recv(ctx)
			if err != nil {
				t.Fatal(err)
			}
			msg, err := pdproto.Decode(m)
			if err != nil {
				t.Fatal(err)
			}
			if a, ok := msg.(*pdproto.AbortAck); !ok || *a != (pdproto.AbortAck{Room: room, Rank: 1, InFlight: room == 2}) {
				t.Fatalf("received %#v", msg)
			}
		}
		m, err := p.Recv(ctx)
		if err != nil || len(m) != 3 || !bytes.Equal(m[0], big) || len(m[1]) != 0 || string(m[2]) != "z" {
			t.Fatalf("last message: %d frames, %v", len(m), err)
		}
		if errs := p.Errors(); len(errs) > 0 {
			t.Fatalf("peer errors: %v", errs)
		}
	})
}
