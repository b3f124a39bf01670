package zmtp

// Interoperability with the project's real ZeroMQ sockets (libzmq, through
// both backends of engine/pd/zmqlink). Only this test file imports the
// engine; the package itself stays pure Go.

import (
	"bytes"
	"context"
	"errors"
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

// TestInteropCurvePushToInbox: a CURVE Push delivers to a zmqlink Inbox
// that is a CURVE server (libzmq's CurveZMQ), frames whole and in order, a
// large one included; a Push with another client key, or expecting
// another server key, is refused and delivers nothing.
func TestInteropCurvePushToInbox(t *testing.T) {
	keys, err := zmqlink.CurveKeysFrom("interop")
	if err != nil {
		t.Fatal(err)
	}
	other, err := zmqlink.CurveKeysFrom("stranger")
	if err != nil {
		t.Fatal(err)
	}
	auth := func(server, client *zmqlink.CurveKeys) *CurveAuth {
		return &CurveAuth{ServerPublic: [32]byte([]byte(server.ServerPublic)),
			ClientPublic: [32]byte([]byte(client.ClientPublic)), ClientSecret: [32]byte([]byte(client.ClientSecret))}
	}
	eachZeroCopy(t, func(t *testing.T, zc bool) {
		got := make(chan [][]byte, 8)
		in, err := zmqlink.Listen("tcp://127.0.0.1:0", func(fr [][]byte) error {
			got <- zmqlink.CloneFrames(fr)
			return nil
		}, &zmqlink.InboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: zc, Curve: keys}})
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, a := range []*CurveAuth{auth(keys, other), auth(other, keys)} {
			if p, err := DialCurve(ctx, in.Endpoint(), a); err == nil {
				p.Close()
				t.Fatal("a stranger's CURVE keys were admitted")
			} else if !errors.Is(err, ErrAuthRefused) {
				t.Errorf("a stranger's keys: %v, want ErrAuthRefused", err)
			}
		}
		if _, err := Dial(ctx, in.Endpoint()); !errors.Is(err, ErrAuthRequired) {
			t.Errorf("NULL against a CURVE server: %v, want ErrAuthRequired", err)
		}
		p, err := DialCurve(ctx, in.Endpoint(), auth(keys, keys))
		if err != nil {
			t.Fatal(err)
		}
		big := bytes.Repeat([]byte{0xCD}, 300<<10)
		for i := range 3 {
			if err := p.Send(ctx, [][]byte{{byte(i)}, {}, big}); err != nil {
				t.Fatal(err)
			}
		}
		p.Close()
		for i := range 3 {
			select {
			case m := <-got:
				if len(m) != 3 || !bytes.Equal(m[0], []byte{byte(i)}) || len(m[1]) != 0 || !bytes.Equal(m[2], big) {
					t.Fatalf("message %d: %d frames", i, len(m))
				}
			case <-ctx.Done():
				t.Fatalf("message %d never arrived", i)
			}
		}
		if st := in.Stats(); st.Messages != 3 || st.AuthAdmitted != 1 {
			t.Errorf("inbox stats %+v", st)
		}
	})
}
