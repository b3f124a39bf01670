package serve

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// forger sends a hostile peer's messages to every prefill rank's control
// socket, from one Outbox of its own.
type forger struct {
	t   *testing.T
	pp  *pdPair
	out *zmqlink.Outbox
}

func newForger(t *testing.T, pp *pdPair) *forger {
	t.Helper()
	out, err := zmqlink.NewOutbox(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	return &forger{t: t, pp: pp, out: out}
}

// flood sends n messages msg(rank, i) to every prefill rank and returns a
// wait for each rank's socket to have taken them in.
func (f *forger) flood(n int, msg func(r, i int) pdproto.Message) (taken func()) {
	f.t.Helper()
	links := f.pp.prefill.PD().Links()
	for _, l := range links {
		for i := range n {
			frames, err := pdproto.Encode(msg(l.Rank, i))
			if err != nil {
				f.t.Fatal(err)
			}
			if err := f.out.Send(context.Background(), l.Inbox.Endpoint, frames); err != nil {
				f.t.Fatal(err)
			}
		}
	}
	return func() {
		f.t.Helper()
		waitfor.Check(f.t, "the flood taken in by every prefill rank", 30*time.Second, func() bool {
			for r, l := range f.pp.prefill.PD().Links() {
				if l.Inbox.Messages < links[r].Inbox.Messages+uint64(n) {
					return false
				}
			}
			return true
		})
	}
}

// deadEndpoint is a TCP endpoint nothing listens on.
func deadEndpoint(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + l.Addr().String()
	l.Close()
	return ep
}

// runReal runs n real requests through pp at once and checks that each
// completes within within; it returns the slowest one's time.
func (pp *pdPair) runReal(t *testing.T, n int, within time.Duration) time.Duration {
	t.Helper()
	vocab := pp.prefill.m.Config.VocabSize
	var wg sync.WaitGroup
	var mu sync.Mutex
	var slowest time.Duration
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), within)
			defer cancel()
			start := time.Now()
			p := testmodel.Prompts(uint64(i)+11, 1, 6, 12, vocab)[0]
			toks, dfin, pfin := pp.run(t, ctx, Request{Prompt: p, MaxTokens: 3, IgnoreEOS: true}, newAbortRoom())
			took := time.Since(start)
			if len(toks) != 3 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
				t.Errorf("request %d: %d tokens in %v (bound %v), decode %q, prefill %q", i, len(toks), took.Round(time.Millisecond), within, dfin.Reason, pfin.Reason)
			}
			mu.Lock()
			slowest = max(slowest, took)
			mu.Unlock()
		})
	}
	wg.Wait()
	return slowest
}

// TestRedTeamAbortBurstDeadEndpoint: a burst of forged ABORTs whose ack
// endpoint is dead leaves serving working, at its latency. The prefill
// owes an ABORT_ACK for each (their rooms are unknown to it), and none can
// be delivered; the acks go out through the bounded reply queue and the
// Outbox's per-peer backlog, the rest dropped and counted, so the receive
// goroutine goes on reading: real requests, sent right behind the burst,
// complete while the acks are still undeliverable. The prefill's send
// timeout is long here (20s), so a receive path that waited on the dead
// peer even once would hold them past their bound, half of it; how much
// slower than before the burst they were is logged, not judged (the
// machine's noise is no failure). (The per-sender quota, which would cap
// the acks one endpoint can cause, is lifted here.)
func TestRedTeamAbortBurstDeadEndpoint(t *testing.T) {
	pc := abortCfg()
	pc.PD.EarlyRoomsPerSender = maxUnknownRooms
	pc.PD.SendTimeout = 20 * time.Second
	pp := newPDPairCfg(t, pc, abortCfg())
	within := pc.PD.SendTimeout / 2
	before := pp.runReal(t, 8, within)
	dead := deadEndpoint(t)
	const burst = 1500
	taken := newForger(t, pp).flood(burst, func(r, i int) pdproto.Message {
		return &pdproto.Abort{Room: 9_000_000 + uint64(i), Endpoint: dead, Rank: uint32(r), Reason: "forged"}
	})
	during := pp.runReal(t, 8, within)
	taken()
	t.Logf("slowest of 8 requests: %v before the burst, %v behind it (%.2fx)", before.Round(time.Millisecond), during.Round(time.Millisecond), float64(during)/float64(before))
	for _, l := range pp.prefill.PD().Links() {
		if l.RepliesDropped == 0 {
			t.Errorf("rank %d: no ack to the dead endpoint was dropped: %+v", l.Rank, l.Outbox)
		}
		t.Logf("rank %d: replies dropped %d, early rooms over quota %d, outbox %+v", l.Rank, l.RepliesDropped, l.OverQuota, l.Outbox)
	}
	pp.settle(t, 10*time.Second)
}

// TestRedTeamPendingFlood: one sender floods the prefill with TRANSFER_INFO
// for rooms that never come, more than the pending table holds. Its rooms
// stop at its quota (counted), so the other senders' TRANSFER_INFO, which
// arrives before the prefill has the room, still finds a place, and their
// requests are served.
func TestRedTeamPendingFlood(t *testing.T) {
	pp := newPDPairCfg(t, abortCfg(), abortCfg())
	ik := pp.prefill.PD().RankInfos()[0].IndexKDType
	flooder := deadEndpoint(t)
	newForger(t, pp).flood(maxUnknownRooms+500, func(r, i int) pdproto.Message {
		return &pdproto.TransferInfo{Room: 8_000_000 + uint64(i), Endpoint: flooder, Rank: uint32(r), Tokens: 8,
			IndexKDType: ik, RequestID: "flood"}
	})()
	for _, l := range pp.prefill.PD().Links() {
		if l.OverQuota == 0 {
			t.Errorf("rank %d: the flood never hit its sender's quota", l.Rank)
		}
	}
	vocab := pp.prefill.m.Config.VocabSize
	for i := range 4 {
		// The decode first: its TRANSFER_INFO reaches the prefill before
		// the prefill has the room, and needs a place in the table.
		q := Request{Prompt: testmodel.Prompts(uint64(i)+31, 1, 6, 12, vocab)[0], MaxTokens: 3, IgnoreEOS: true}
		room := newAbortRoom()
		d := pp.decodeHalf(t, q, room)
		waitfor.Check(t, "the decode's TRANSFER_INFO sent", 10*time.Second, func() bool { return inQueue(pp.decode, d.s.ID, "transfer") })
		p := pp.prefillHalf(t, q, room)
		expectEnd(t, "decode", d.s, finishIs(ReasonLength))
		expectEnd(t, "prefill", p.s, finishIs(ReasonLength))
	}
}

// TestPDLongestChunkFitsDerivedBound: the derived frame bound of a decode's
// KV socket takes the largest legal KV_CHUNK, a whole context's prompt in
// one chunk, and a prefill's control socket a TRANSFER_INFO of a context's
// pages at page size 1.
func TestPDLongestChunkFitsDerivedBound(t *testing.T) {
	m := tinyModel(t)
	ctxLen := m.Config.ContextLen
	cfg := Config{TP: 2, PageSize: 1, KVTokens: 2 * ctxLen, MaxRunning: 2, MaxBatchTokens: ctxLen, PrefillChunk: ctxLen}
	pp := newPDPairCfg(t, cfg, cfg)
	c := &m.Config
	wantKV := int64(ctxLen*max(c.KVDim()/cfg.TP*4, c.Indexer.Dim*2)) + messageHeadroom
	if got := pp.decode.maxMessageBytes(); got != wantKV {
		t.Errorf("decode bound %d, want %d", got, wantKV)
	}
	if got, want := pp.prefill.maxMessageBytes(), int64(4*ctxLen)+messageHeadroom; got != want {
		t.Errorf("prefill bound %d, want %d", got, want)
	}
	q := Request{Prompt: testmodel.Prompts(3, 1, ctxLen-1, ctxLen-1, c.VocabSize)[0], MaxTokens: 1, IgnoreEOS: true}
	toks, dfin, pfin := pp.run(t, context.Background(), q, newAbortRoom())
	if len(toks) != 1 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
		t.Fatalf("a context-long prompt in one chunk: %d tokens, decode %q, prefill %q", len(toks), dfin.Reason, pfin.Reason)
	}
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		for _, l := range e.PD().Links() {
			if l.Inbox.Disconnects != 0 {
				t.Errorf("%s rank %d dropped a peer: %+v", e.cfg.Role, l.Rank, l.Inbox)
			}
		}
	}
}

// TestRepliesDropWhatCannotGo: replies to a dead endpoint go out within
// its backlog in the Outbox; every one past it, or past a full queue, is
// dropped and counted, and posting never waits. Stopping twice is
// harmless.
func TestRepliesDropWhatCannotGo(t *testing.T) {
	out, err := zmqlink.NewOutbox(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	r := newReplies(out, 8, time.Second, func(string, pdproto.Message, error) {})
	dead := deadEndpoint(t)
	const n = 2000
	for i := range n {
		r.post(dead, &pdproto.AbortAck{Room: uint64(i)})
	}
	waitfor.Check(t, "every reply sent, held or dropped", 10*time.Second, func() bool {
		s := out.Stats()
		return r.dropped.Load()+s.Sent+uint64(s.Backlog) == n
	})
	if s := out.Stats(); s.Backlog > 256 || r.dropped.Load() == 0 {
		t.Errorf("backlog %d (the per-peer bound is 256), dropped %d", s.Backlog, r.dropped.Load())
	}
	r.stop()
	r.stop()
	r.post(dead, &pdproto.AbortAck{}) // after stop: queued, never sent, never blocks
}

// TestRedTeamAbortEndpointsBounded: 3,000 forged ABORTs, each naming an ack
// endpoint of its own where nothing listens (as 3,000 runs of a tool that
// sends one ABORT each would), leave each prefill rank with no more peer
// sockets open than its bound, and serving working.
func TestRedTeamAbortEndpointsBounded(t *testing.T) {
	const endpoints, maxPeers = 3000, 32
	pc := abortCfg()
	pc.PD.MaxPeerSockets = maxPeers
	pp := newPDPairCfg(t, pc, abortCfg())
	newForger(t, pp).flood(endpoints, func(r, i int) pdproto.Message {
		return &pdproto.Abort{Room: 7_000_000 + uint64(i), Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 1+i), Rank: uint32(r), Reason: "forged"}
	})()
	waitfor.Check(t, "every ack sent, evicted with its peer, or dropped", 30*time.Second, func() bool {
		for _, l := range pp.prefill.PD().Links() {
			if l.Outbox.Sent+l.Outbox.SendErrors+l.Outbox.QueueFull+l.RepliesDropped < endpoints {
				return false
			}
		}
		return true
	})
	for _, l := range pp.prefill.PD().Links() {
		if l.Outbox.Peers > maxPeers || l.Outbox.Evicted == 0 {
			t.Errorf("rank %d: %d peer sockets open (bound %d), %d evicted", l.Rank, l.Outbox.Peers, maxPeers, l.Outbox.Evicted)
		}
	}
	pp.runReal(t, 4, 30*time.Second)
}
