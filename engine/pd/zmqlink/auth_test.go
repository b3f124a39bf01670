package zmqlink

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
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

// Only one mechanism at a time, and a rotating credential needs all its
// parts.
func TestAuthMechanismsExclusive(t *testing.T) {
	keys, err := CurveKeysFrom("test")
	if err != nil {
		t.Fatal(err)
	}
	rot := &RotatingAuth{Credential: func(time.Time) (string, string) { return "u", "p" },
		Admit: func([]byte, []byte, time.Time) bool { return true }, Rotate: time.Minute}
	for _, o := range []SocketOptions{
		{Auth: &testAuth, Curve: keys},
		{Rotating: rot, Curve: keys},
		{Rotating: &RotatingAuth{Rotate: time.Minute}},
		{Curve: &CurveKeys{ServerPublic: "short"}},
	} {
		if _, err := NewOutbox(&OutboxOptions{SocketOptions: o}); err == nil {
			t.Errorf("NewOutbox accepted %+v", o)
		}
	}
}

// A rotating credential: each Outbox socket presents its own, the Inbox
// admits what Admit says, and a socket older than Rotate is made anew
// with a fresh credential once quiet, its messages still in order.
func TestRotatingCredential(t *testing.T) {
	var mu sync.Mutex
	var made, seen []string
	n := 0
	rot := &RotatingAuth{
		Credential: func(time.Time) (string, string) {
			mu.Lock()
			defer mu.Unlock()
			n++
			u := fmt.Sprintf("kv-%d", n)
			made = append(made, u)
			return u, "pw-" + u
		},
		Admit: func(user, password []byte, _ time.Time) bool {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, string(user))
			return string(password) == "pw-"+string(user) && string(user) != "kv-refused"
		},
		Rotate: time.Nanosecond, Quiet: time.Nanosecond,
	}
	var c collector
	inbox, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{Rotating: rot}})
	if err != nil {
		t.Fatal(err)
	}
	defer inbox.Close()
	o, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{Rotating: rot}})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	for i := range 3 {
		if err := o.Send(context.Background(), inbox.Endpoint(), [][]byte{{byte(i)}}); err != nil {
			t.Fatal(err)
		}
		waitfor.For(t, fmt.Sprintf("message %d", i), 20*time.Second, func() bool { return c.len() == i+1 })
	}
	for i, m := range c.snapshot() {
		if len(m) != 1 || m[0][0] != byte(i) {
			t.Fatalf("message %d: %v", i, m)
		}
	}
	if st := o.Stats(); st.Rotated != 2 {
		t.Errorf("rotated %d sockets, want 2", st.Rotated)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(made) != 3 || !slices.Equal(seen, made) {
		t.Errorf("credentials made %q, admitted %q: want a fresh one per socket, each admitted", made, seen)
	}
}

// CURVE works over both backends and between them, and
// its ZAP handler refuses a client key it was not given.
func TestCurveRoundTrip(t *testing.T) {
	keys, err := CurveKeysFrom("test")
	if err != nil {
		t.Fatal(err)
	}
	other, err := CurveKeysFrom("other")
	if err != nil {
		t.Fatal(err)
	}
	stranger := *keys
	stranger.ClientPublic, stranger.ClientSecret = other.ClientPublic, other.ClientSecret
	for _, in := range backends {
		for _, out := range backends {
			t.Run(in.name+"-inbox/"+out.name+"-outbox", func(t *testing.T) {
				var c collector
				inbox, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: in.zc, Curve: keys}})
				if err != nil {
					t.Fatal(err)
				}
				defer inbox.Close()
				for _, k := range []*CurveKeys{&stranger, keys} {
					o, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: out.zc, Curve: k}})
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
