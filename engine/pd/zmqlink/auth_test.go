package zmqlink

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/waitfor"
)

var testAuth = PlainAuth{Username: "pdkit", Password: strings.Repeat("5e", 32)}

// forged is a correctly shaped PD message, as an attacker would send.
func forged(t *testing.T, room uint64) [][]byte {
	t.Helper()
	m, err := pdproto.Encode(&pdproto.Abort{Room: room, Endpoint: "tcp://127.0.0.1:9", Rank: 1, Reason: "forged"})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestRedTeamForgedWithoutCredentials: an off-path attacker who can reach
// an authenticated Inbox's port sends well-formed PD messages with no
// credential, a wrong password and a wrong username. None is delivered
// and each refused connection is counted; a peer with the right
// credential is delivered. Every pairing of the two backends.
func TestRedTeamForgedWithoutCredentials(t *testing.T) {
	for _, in := range backends {
		for _, out := range backends {
			t.Run(in.name+"-inbox/"+out.name+"-outbox", func(t *testing.T) {
				testForgedWithoutCredentials(t, in.zc, out.zc)
			})
		}
	}
}

func testForgedWithoutCredentials(t *testing.T, inZC, outZC bool) {
	checkGoroutines(t)
	var c collector
	in, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: inZC, Auth: &testAuth}})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	attackers := []*PlainAuth{
		nil,
		{Username: testAuth.Username, Password: strings.Repeat("00", 32)},
		{Username: "root", Password: testAuth.Password},
	}
	for i, a := range attackers {
		out := authOutbox(t, outZC, a)
		for range 3 {
			if err := out.Send(context.Background(), in.Endpoint(), forged(t, uint64(i))); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitfor.For(t, "every attacker refused", 20*time.Second, func() bool {
		return in.Stats().AuthDenied >= uint64(len(attackers)) || forgedDelivered(t, &c) >= 0
	})

	good := authOutbox(t, outZC, &testAuth)
	for _, room := range []uint64{99, 100} {
		if err := good.Send(context.Background(), in.Endpoint(), forged(t, room)); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "the authenticated messages", 20*time.Second, func() bool { return c.len() >= 2 })
	if i := forgedDelivered(t, &c); i >= 0 {
		t.Fatalf("a forged message from attacker %d (%+v) was delivered", i, attackers[i])
	}
	st := in.Stats()
	if st.Messages != 2 || st.AuthDenied < uint64(len(attackers)) || st.AuthAdmitted < 1 || st.LastAuthDenied == "" {
		t.Fatalf("inbox stats %+v", st)
	}
}

// forgedDelivered is the attacker whose message c received, or -1: the
// authenticated peer's rooms are 99 and up.
func forgedDelivered(t *testing.T, c *collector) int {
	t.Helper()
	for _, m := range c.snapshot() {
		msg, err := pdproto.Decode(m)
		if err != nil {
			t.Fatal(err)
		}
		if a := msg.(*pdproto.Abort); a.Room < 99 {
			return int(a.Room)
		}
	}
	return -1
}

// authOutbox is an Outbox presenting a (nil: no credential), closed
// with the test.
func authOutbox(t *testing.T, zc bool, a *PlainAuth) *Outbox {
	t.Helper()
	out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: a}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	return out
}

// Empty or oversized credentials are refused when the socket is made,
// not at the first handshake.
func TestAuthValidated(t *testing.T) {
	for _, a := range []*PlainAuth{{Username: "u"}, {Password: "p"}, {Username: "u", Password: strings.Repeat("p", 256)}} {
		if _, err := Listen("tcp://127.0.0.1:0", func([][]byte) error { return nil }, &InboxOptions{SocketOptions: SocketOptions{Auth: a}}); err == nil {
			t.Fatalf("Listen accepted %+v", a)
		}
		if _, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{Auth: a}}); err == nil {
			t.Fatalf("NewOutbox accepted %+v", a)
		}
	}
}

// CURVE (benchmarks only) works over both backends and between them, and
// its ZAP handler refuses a client key it was not given.
func TestCurveRoundTrip(t *testing.T) {
	keys, err := curveKeysFrom("test")
	if err != nil {
		t.Fatal(err)
	}
	other, err := curveKeysFrom("other")
	if err != nil {
		t.Fatal(err)
	}
	stranger := *keys
	stranger.clientPublic, stranger.clientSecret = other.clientPublic, other.clientSecret
	for _, in := range backends {
		for _, out := range backends {
			t.Run(in.name+"-inbox/"+out.name+"-outbox", func(t *testing.T) {
				var c collector
				inbox, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: in.zc, curve: keys}})
				if err != nil {
					t.Fatal(err)
				}
				defer inbox.Close()
				for _, k := range []*curveKeys{&stranger, keys} {
					o, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: out.zc, curve: k}})
					if err != nil {
						t.Fatal(err)
					}
					defer o.Close()
					if err := o.Send(context.Background(), inbox.Endpoint(), bigMsg(1)); err != nil {
						t.Fatal(err)
					}
				}
				waitfor.For(t, "the message and the refusal", 20*time.Second, func() bool {
					st := inbox.Stats()
					return c.len() == 1 && st.AuthDenied >= 1
				})
				if st := inbox.Stats(); st.Messages != 1 || st.AuthAdmitted != 1 {
					t.Fatalf("inbox stats %+v", st)
				}
			})
		}
	}
}
