package serve

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/mailbox"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRedTeamPDForgedWithoutCredentials: a PD pair sharing a cluster
// secret; strangers send well-formed KV_CHUNK, STATUS and ABORT frames for
// a room to both servers' sockets: with no credential, with the
// credentials of another secret (CURVE keys, a KV credential), and with a
// KV credential of the right secret sniffed long ago (past KVLifetime) or
// presented to the control socket, which takes CURVE only. Their
// connections are refused at the handshake and counted, nothing of theirs
// reaches a handler, and the pair serves a real request in that room
// afterwards.
func TestRedTeamPDForgedWithoutCredentials(t *testing.T) {
	secret, _ := clusterauth.Generate()
	pp := newPDPair(t, Config{PageSize: 4, KVTokens: 512, MaxRunning: 4, PD: PDConfig{Secret: secret}})
	other, _ := clusterauth.Generate()
	control, kv := pp.prefill.PD().Links()[0].Inbox.Endpoint, pp.decode.PD().Links()[0].Inbox.Endpoint
	plain := func(s *clusterauth.Secret, at time.Time) *zmqlink.SocketOptions {
		user, password := s.KVCredential(at)
		return &zmqlink.SocketOptions{Auth: &zmqlink.PlainAuth{Username: user, Password: password}}
	}
	sp, _, cp, cs, _ := other.CurveKeys()
	rsp, _, _, _, _ := secret.CurveKeys()
	now := time.Now()
	forgers := []struct {
		name      string
		opts      *zmqlink.SocketOptions
		endpoints []string
	}{
		{"no credential", nil, []string{control, kv}},
		{"another secret's KV credential", plain(other, now), []string{control, kv}},
		{"another secret's CURVE keys", &zmqlink.SocketOptions{Curve: &zmqlink.CurveKeys{ServerPublic: sp, ClientPublic: cp, ClientSecret: cs, ServerSecret: cs}}, []string{control}},
		{"another secret's client keys, the right server key", &zmqlink.SocketOptions{Curve: &zmqlink.CurveKeys{ServerPublic: rsp, ClientPublic: cp, ClientSecret: cs, ServerSecret: cs}}, []string{control}},
		{"a KV credential sniffed past its lifetime", plain(secret, now.Add(-clusterauth.KVLifetime-clusterauth.KVEpoch)), []string{kv}},
		{"a fresh KV credential at the control socket", plain(secret, now), []string{control}},
	}
	const room = 77
	forged := [][][]byte{}
	for _, m := range []pdproto.Message{
		&pdproto.KVChunk{Room: room, End: 4},
		&pdproto.Status{Room: room, State: pdproto.Failed, Error: "forged"},
		&pdproto.Abort{Room: room, Endpoint: "tcp://127.0.0.1:1", Reason: "forged"},
	} {
		f, err := pdproto.Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		forged = append(forged, f)
	}
	atControl, atKV := uint64(0), uint64(0)
	for _, fg := range forgers {
		opts := &zmqlink.OutboxOptions{}
		if fg.opts != nil {
			opts.SocketOptions = *fg.opts
		}
		out, err := zmqlink.NewOutbox(opts)
		if err != nil {
			t.Fatalf("%s: %v", fg.name, err)
		}
		defer out.Close()
		for _, ep := range fg.endpoints {
			if ep == control {
				atControl++
			} else {
				atKV++
			}
			for _, f := range forged {
				if err := out.Send(context.Background(), ep, zmqlink.CloneFrames(f)); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	waitfor.Check(t, "the forgers refused on both servers", 10*time.Second, func() bool {
		return pp.prefill.PD().Links()[0].Inbox.AuthDenied >= atControl && pp.decode.PD().Links()[0].Inbox.AuthDenied >= atKV
	})
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		if l := e.PD().Links()[0]; l.Inbox.Messages != 0 || l.Inbox.HandlerErrors != 0 {
			t.Errorf("%s: forged frames reached the handler: %+v", e.cfg.Role, l.Inbox)
		}
	}
	m := tinyModel(t)
	p := testmodel.Prompts(44, 1, 10, 20, m.Config.VocabSize)[0]
	toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: p, MaxTokens: 3, IgnoreEOS: true}, room)
	if len(toks) != 3 || dfin.Reason != ReasonLength || pfin.Reason == "" {
		t.Fatalf("the real request after the forgery: %d tokens, decode %q, prefill %q", len(toks), dfin.Reason, pfin.Reason)
	}
}

// TestMailboxBoundsARoomsChunks: chunks replayed for a room the loop has
// not taken yet stop being filed at the room's bound (a whole context's
// KV), counted; after the loop takes them the room files again.
func TestMailboxBoundsARoomsChunks(t *testing.T) {
	mb := newMailbox(mailbox.Config{Role: rooms.Decode, RoomBytes: 10 << 10}, func() {}, &faultSet{})
	mb.admit(5)
	chunk := func() *pdproto.KVChunk {
		return &pdproto.KVChunk{Room: 5, End: 1, Layers: []pdproto.LayerKV{{K: make([]byte, 1<<10), V: make([]byte, 1<<10)}}}
	}
	for range 100 {
		if _, _, err := mb.file(chunk()); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(mb.take(5).Chunks); got != 5 || mb.overQuota.Load() != 95 {
		t.Fatalf("filed %d chunks of 2 KiB under a 10 KiB bound, %d dropped", got, mb.overQuota.Load())
	}
	if _, _, err := mb.file(chunk()); err != nil || len(mb.take(5).Chunks) != 1 {
		t.Fatal("the room files no more after the loop took its chunks")
	}
}

// TestRepliesHeartbeatsFirst: a reply queue full of ABORT_ACKs (a flood of
// ABORTs naming endpoints) still takes a heartbeat, and hands it over
// before them.
func TestRepliesHeartbeatsFirst(t *testing.T) {
	r := &replies{queue: make(chan reply, 4), beats: make(chan reply, heartbeatLane), closing: make(chan struct{})}
	for i := range 10 {
		r.post(fmt.Sprintf("tcp://127.0.0.1:%d", 1+i), &pdproto.AbortAck{Room: uint64(i)})
	}
	r.post("tcp://127.0.0.1:9999", &pdproto.Heartbeat{Sender: "tcp://127.0.0.1:9998", Reply: true})
	if r.dropped.Load() != 6 {
		t.Fatalf("dropped %d, want the 6 acks past the queue", r.dropped.Load())
	}
	if rp, ok := r.next(); !ok || rp.to != "tcp://127.0.0.1:9999" {
		t.Fatalf("first handed over: %+v", rp)
	}
	if rp, _ := r.next(); rp.to != "tcp://127.0.0.1:1" {
		t.Fatalf("then: %+v", rp)
	}
}
