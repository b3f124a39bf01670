package zmtp

// PLAIN against libzmq: a zmqlink Inbox or Outbox with SocketOptions.Auth,
// over both of its backends; and against this package's own Pull.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/internal/waitfor"
)

var (
	testAuth  = PlainAuth{Username: "pdkit", Password: strings.Repeat("a7", 32)}
	wrongAuth = PlainAuth{Username: "pdkit", Password: strings.Repeat("00", 32)}
	linkAuth  = zmqlink.PlainAuth{Username: testAuth.Username, Password: testAuth.Password}
)

func abortFrames(t *testing.T, room uint64) [][]byte {
	t.Helper()
	m, err := pdproto.Encode(&pdproto.Abort{Room: room, Endpoint: "tcp://127.0.0.1:9", Rank: 1, Reason: "pdctl"})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestRedTeamForgedPlainCredentials: a pure-Go ZMTP client, as pdctl or
// an attacker would use, sends well-formed PD frames to an authenticated
// zmqlink Inbox. Without a credential it is told the peer requires PLAIN,
// with a wrong one that it was refused; neither is delivered and both are
// counted. With the right credential its frames are delivered.
func TestRedTeamForgedPlainCredentials(t *testing.T) {
	eachZeroCopy(t, func(t *testing.T, zc bool) {
		got := make(chan [][]byte, 8)
		in, err := zmqlink.Listen("tcp://127.0.0.1:0", func(fr [][]byte) error {
			got <- zmqlink.CloneFrames(fr)
			return nil
		}, &zmqlink.InboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: zc, Auth: &linkAuth}})
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()

		err = Send(ctx, in.Endpoint(), abortFrames(t, 1))
		if !errors.Is(err, ErrAuthRequired) || !strings.Contains(err.Error(), "requires the PLAIN mechanism") {
			t.Fatalf("without a credential: %v, want ErrAuthRequired", err)
		}
		err = SendAuth(ctx, in.Endpoint(), &wrongAuth, abortFrames(t, 2))
		if !errors.Is(err, ErrAuthRefused) || !strings.Contains(err.Error(), "refused the credentials") {
			t.Fatalf("with a wrong credential: %v, want ErrAuthRefused", err)
		}
		if err := SendAuth(ctx, in.Endpoint(), &testAuth, abortFrames(t, 3)); err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-got:
			msg, err := pdproto.Decode(m)
			if err != nil {
				t.Fatal(err)
			}
			if a := msg.(*pdproto.Abort); a.Room != 3 {
				t.Fatalf("a forged message, room %d, was delivered", a.Room)
			}
		case <-ctx.Done():
			t.Fatal("the authenticated message was not delivered")
		}
		waitfor.NoError(t, "2 refusals", 10*time.Second, func() error {
			if st := in.Stats(); st.AuthDenied < 2 {
				return fmt.Errorf("inbox stats %+v", st)
			}
			return nil
		})
		if st := in.Stats(); st.Messages != 1 || st.AuthAdmitted != 1 {
			t.Fatalf("inbox stats %+v", st)
		}
	})
}

// An authenticated zmqlink Outbox reaches a Pull with the same
// credential; one with a wrong credential is refused and recorded.
func TestPlainOutboxToPull(t *testing.T) {
	eachZeroCopy(t, func(t *testing.T, zc bool) {
		p, err := ListenAuth("tcp://127.0.0.1:0", &testAuth)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		bad := zmqlink.PlainAuth{Username: wrongAuth.Username, Password: wrongAuth.Password}
		for _, a := range []*zmqlink.PlainAuth{&bad, &linkAuth} {
			out, err := zmqlink.NewOutbox(&zmqlink.OutboxOptions{SocketOptions: zmqlink.SocketOptions{ZeroCopy: zc, Auth: a}})
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			if err := out.Send(ctx, p.Endpoint(), [][]byte{[]byte(a.Password)}); err != nil {
				t.Fatal(err)
			}
		}
		m, err := p.Recv(ctx)
		if err != nil || len(m) != 1 || string(m[0]) != testAuth.Password {
			t.Fatalf("received %q, %v", m, err)
		}
		waitfor.For(t, "the wrong credential refused", 10*time.Second, func() bool { return len(p.Errors()) != 0 })
		if err := p.Errors()[0]; !errors.Is(err, ErrAuthRefused) {
			t.Fatalf("error %v, want ErrAuthRefused", err)
		}
	})
}

// Push and Pull of this package, both PLAIN, over TCP.
func TestPlainPushToPull(t *testing.T) {
	p, err := ListenAuth("tcp://127.0.0.1:0", &testAuth)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := SendAuth(ctx, p.Endpoint(), &wrongAuth, [][]byte{[]byte("forged")}); !errors.Is(err, ErrAuthRefused) {
		t.Fatalf("wrong credential: %v (%v)", err, p.Errors())
	}
	if err := Send(ctx, p.Endpoint(), [][]byte{[]byte("forged")}); !errors.Is(err, ErrAuthRequired) {
		t.Fatalf("no credential: %v", err)
	}
	if err := SendAuth(ctx, p.Endpoint(), &testAuth, [][]byte{[]byte("a"), {}}); err != nil {
		t.Fatal(err)
	}
	m, err := p.Recv(ctx)
	if err != nil || len(m) != 2 || string(m[0]) != "a" {
		t.Fatalf("received %q, %v", m, err)
	}
	if _, err := DialAuth(ctx, p.Endpoint(), &PlainAuth{Username: "u"}); err == nil {
		t.Fatal("an empty password was accepted")
	}
	// A Pull without a credential refuses a Push with one: no fallback.
	open, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	if err := SendAuth(ctx, open.Endpoint(), &testAuth, [][]byte{[]byte("x")}); !errors.Is(err, ErrAuthRequired) {
		t.Fatalf("PLAIN to NULL: %v", err)
	}
}

// A PLAIN Pull refuses a malformed or wrong HELLO with an error that
// says what was wrong, never delivers, and answers a wrong credential
// with ERROR 400.
func TestPlainPullRefusesHello(t *testing.T) {
	good := hello(&testAuth)
	tests := []struct {
		name  string
		hello []byte
		want  string
	}{
		{"wrong password", hello(&wrongAuth), `zmtp: refused the credentials of user "pdkit"`},
		{"username past the end", append(command("HELLO"), 200, 'u'), "zmtp: HELLO cut short in its username"},
		{"password past the end", append(command("HELLO"), 1, 'u', 9, 'p'), "zmtp: HELLO's password is cut short or followed by other bytes"},
		{"trailing bytes", append(append([]byte{}, good...), 'x'), "zmtp: HELLO's password is cut short or followed by other bytes"},
		{"other command", command("READY"), `zmtp: expected the HELLO command, got "READY"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := ListenAuth("tcp://127.0.0.1:0", &testAuth)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			c, err := net.Dial("tcp", strings.TrimPrefix(p.Endpoint(), "tcp://"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			peer := &rawPeer{t: t, c: c}
			<-peer.write(append(greeting(mechPLAIN, false), appendFrame(nil, flagCommand, tt.hello)...))
			if g := peer.read(greetingLen); string(g[12:17]) != mechPLAIN {
				t.Fatalf("greeting % x", g)
			}
			if tt.name == "wrong password" {
				if _, body := peer.frame(); string(body) != "\x05ERROR\x03400" {
					t.Fatalf("reply %q, want ERROR 400", body)
				}
			}
			waitfor.For(t, "an error recorded", 5*time.Second, func() bool { return len(p.Errors()) != 0 })
			if got := p.Errors()[0].Error(); got != tt.want {
				t.Fatalf("error %q, want %q", got, tt.want)
			}
		})
	}
}
