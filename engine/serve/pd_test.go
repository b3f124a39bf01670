package serve

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/pd/mailbox"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// pdPair is a prefill and a decode engine in one process, on real ZeroMQ
// sockets, with the prefill's registry on a real HTTP server.
type pdPair struct {
	prefill, decode *Engine
	url             string
}

func newPDPair(t *testing.T, cfg Config) *pdPair {
	t.Helper()
	return newPDPairOf(t, tinyModel(t), cfg)
}

// newPDPairOf is newPDPair over model m.
func newPDPairOf(t *testing.T, m *model.Model, cfg Config) *pdPair {
	t.Helper()
	pc, dc := cfg, cfg
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	dc.HiCache.Enabled = false // a decode keeps no host tier
	p := newEngine(t, m, pc)
	d := newEngine(t, m, dc)
	url := serveRegistry(t, p, p.View().Ranks())
	allowRegistry(t, d, url)
	return &pdPair{prefill: p, decode: d, url: url}
}

// allowRegistry lets decode e take requests for the registry at url.
func allowRegistry(t *testing.T, e *Engine, url string) {
	t.Helper()
	if err := e.AllowPrefillBootstrap(url); err != nil {
		t.Fatal(err)
	}
}

// run sends one request to both sides under a fresh room, as a router does,
// and returns the decode's tokens and finish and the prefill's finish.
func (pp *pdPair) run(t *testing.T, ctx context.Context, q Request, room uint64) ([]int32, Finish, Finish) {
	t.Helper()
	ps, ds := pp.submit(t, ctx, q, room)
	toks, dfin := collect(t, ds, 30*time.Second)
	_, pfin := collect(t, ps, 30*time.Second)
	return toks, dfin, pfin
}

// session is one PD request as a router runs it: both sides under one room,
// both cancelled together when the client goes.
type session struct {
	cancel context.CancelFunc
	p, d   *Stream
}

func (pp *pdPair) open(t *testing.T, q Request, room uint64) *session {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ps, ds := pp.submit(t, ctx, q, room)
	return &session{cancel: cancel, p: ps, d: ds}
}

// submit sends q to both sides under room, as a router does.
func (pp *pdPair) submit(t *testing.T, ctx context.Context, q Request, room uint64) (prefill, decode *Stream) {
	t.Helper()
	pq, dq := q, q
	pq.PD = &PDRequest{Room: room}
	dq.PD = &PDRequest{Room: room, BootstrapURL: pp.url}
	ps, err := pp.prefill.Submit(ctx, pq)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := pp.decode.Submit(ctx, dq)
	if err != nil {
		t.Fatal(err)
	}
	return ps, ds
}

// submitN sends q of q.N samples to both sides under room, as a router
// does: the prefill's one stream and the decode's, one a sample.
func (pp *pdPair) submitN(t *testing.T, q Request, room uint64) (prefill, decode []*Stream) {
	t.Helper()
	pq, dq := q, q
	pq.PD = &PDRequest{Room: room}
	dq.PD = &PDRequest{Room: room, BootstrapURL: pp.url}
	ps, err := pp.prefill.SubmitN(context.Background(), pq)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := pp.decode.SubmitN(context.Background(), dq)
	if err != nil {
		t.Fatal(err)
	}
	return ps, ds
}

// inQueue reports whether request id is in queue on rank 0 of e.
func inQueue(e *Engine, id uint64, queue string) bool {
	for _, en := range e.PD().QueueEntries()[0] {
		if en.ID == id && en.Queue == queue {
			return true
		}
	}
	return false
}

// drained waits until both sides hold no PD request and no KV.
func (pp *pdPair) drained(t *testing.T, within time.Duration) {
	t.Helper()
	waitfor.Check(t, "PD queues empty", within, func() bool {
		for _, e := range []*Engine{pp.prefill, pp.decode} {
			for _, v := range e.PD().Queues() {
				if v != 0 {
					return false
				}
			}
		}
		return true
	})
	checkPools(t, pp.prefill)
	checkPools(t, pp.decode)
}

// The mass-abort drill: sessions aborted in every phase (waiting for the
// handshake, transferring, decoding) leave both sides empty and serving.
func TestPDMassAbortDrill(t *testing.T) {
	m := tinyModel(t)
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 1024, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 8, PD: PDConfig{AbortAckTimeout: time.Second}}
	pp := newPDPair(t, cfg)
	ps := testmodel.Prompts(29, 60, 8, 60, m.Config.VocabSize)
	phases := []string{"prealloc", "transfer", "decoding", "early"}
	var wg sync.WaitGroup
	for i, p := range ps {
		phase := phases[i%len(phases)]
		wg.Go(func() {
			s := pp.open(t, Request{Prompt: p, MaxTokens: 40, IgnoreEOS: true}, uint64(9000+i))
			switch phase {
			case "prealloc", "transfer":
				// Best effort: the phase may pass before it is seen.
				waitfor.Poll(5*time.Second, func() bool { return inQueue(pp.decode, s.d.ID, phase) || len(s.d.Events) != 0 })
			case "decoding":
				if ev := <-s.d.Events; ev.Finish != nil {
					t.Errorf("session %d finished before decoding: %+v", i, ev.Finish)
					return
				}
			}
			s.cancel()
			collect(t, s.d, 30*time.Second)
			collect(t, s.p, 30*time.Second)
		})
	}
	wg.Wait()
	if p, d := pp.prefill.View().Snapshot().Err, pp.decode.View().Snapshot().Err; p != "" || d != "" {
		t.Fatalf("engine failed: prefill %q, decode %q", p, d)
	}
	pp.drained(t, 2*time.Second)
	// Both sides serve again.
	for i, p := range testmodel.Prompts(31, 20, 4, 30, m.Config.VocabSize) {
		toks, dfin, _ := pp.run(t, context.Background(), Request{Prompt: p, MaxTokens: 5, IgnoreEOS: true}, uint64(19000+i))
		if len(toks) != 5 || dfin.Reason != ReasonLength {
			t.Errorf("after the drill, request %d: %d tokens, %q", i, len(toks), dfin.Reason)
		}
	}
	pp.drained(t, 10*time.Second)
}

// With bootstrap-abort-crash on, the first ABORT kills the prefill's control
// loop; a new request then waits for a handshake that never comes, until
// its timeout: the wedge, visible in the prefill's socket state.
func TestPDBootstrapAbortCrashWedges(t *testing.T) {
	m := tinyModel(t)
	cfg := Config{PageSize: 4, KVTokens: 512, MaxRunning: 4, PD: PDConfig{BootstrapTimeout: 2 * time.Second, TransferTimeout: 2 * time.Second, AbortAckTimeout: time.Second}}
	pp := newPDPair(t, cfg)
	if err := pp.prefill.SetFault(FaultBootstrapAbortCrash, true); err != nil {
		t.Fatal(err)
	}
	if err := pp.decode.SetFault(FaultBootstrapAbortCrash, true); err == nil {
		t.Error("a prefill fault switched on at a decode server")
	}
	ps := testmodel.Prompts(37, 2, 200, 300, m.Config.VocabSize)
	// Abort a session in transfer: the decode sends ABORT to the prefill.
	s := pp.open(t, Request{Prompt: ps[0], MaxTokens: 8, IgnoreEOS: true}, 1)
	waitfor.Check(t, "in transfer", 10*time.Second, func() bool { return inQueue(pp.decode, s.d.ID, "transfer") || len(s.d.Events) > 0 })
	s.cancel()
	collect(t, s.d, 30*time.Second)
	collect(t, s.p, 30*time.Second)
	waitfor.Check(t, "control loop dead", 10*time.Second, func() bool { return !pp.prefill.PD().Links()[0].Inbox.Alive })
	if r := pp.prefill.PD().Links()[0].Inbox.ExitReason; !strings.Contains(r, "unknown message type ABORT") {
		t.Errorf("exit reason %q", r)
	}
	// A new request hangs in the handshake and fails only by its timeout.
	toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: ps[1], MaxTokens: 4}, 2)
	if len(toks) != 0 || !strings.Contains(pfin.Reason, "no word from the decode") || !strings.HasPrefix(dfin.Reason, "error: pd:") {
		t.Errorf("wedged cluster served: %d tokens, decode %q, prefill %q", len(toks), dfin.Reason, pfin.Reason)
	}
	t.Logf("decode %q; prefill %q", dfin.Reason, pfin.Reason)
}

// A prefill that dies while a decode waits for its KV fails the decode's
// rooms within the heartbeat timeout, frees their pages, and a restarted
// prefill (new endpoints, same registry) serves again without restarting
// the decode.
func TestPDPrefillDeathAndRestart(t *testing.T) {
	m := tinyModel(t)
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: PDConfig{HeartbeatInterval: 50 * time.Millisecond, HeartbeatTimeout: 500 * time.Millisecond}}
	pc, dc := cfg, cfg
	pc.Role, dc.Role, pc.Backend = pdproto.RolePrefill, pdproto.RoleDecode, cpuBackend
	prefill, err := New(m, pc)
	if err != nil {
		t.Fatal(err)
	}
	decode := newEngine(t, m, dc)
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: cfg.TP})
	register := func(e *Engine) {
		for _, info := range e.PD().RankInfos() {
			if _, err := reg.Register(info); err != nil {
				t.Fatal(err)
			}
		}
	}
	register(prefill)
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	pp := &pdPair{prefill: prefill, decode: decode, url: ts.URL}
	allowRegistry(t, decode, ts.URL)

	// The decode side alone: it reserves, sends its info and waits.
	ps := testmodel.Prompts(41, 2, 10, 20, m.Config.VocabSize)
	ds, err := decode.Submit(context.Background(), Request{Prompt: ps[0], MaxTokens: 4, PD: &PDRequest{Room: 77, BootstrapURL: ts.URL}})
	if err != nil {
		t.Fatal(err)
	}
	waitfor.Check(t, "in transfer", 10*time.Second, func() bool { return inQueue(decode, ds.ID, "transfer") })
	died := time.Now()
	if err := prefill.Close(); err != nil {
		t.Fatal(err)
	}
	_, fin := collect(t, ds, 20*time.Second)
	if !strings.Contains(fin.Reason, "silent") {
		t.Errorf("decode finish %q, want the prefill found silent", fin.Reason)
	}
	t.Logf("failed %v after the prefill died: %s", time.Since(died).Round(time.Millisecond), fin.Reason)
	waitfor.Check(t, "decode queues empty", 10*time.Second, func() bool { return decode.PD().Queues()["aborting"] == 0 && decode.PD().Queues()["transfer"] == 0 })
	checkPools(t, decode)

	restarted := newEngine(t, m, pc)
	register(restarted)
	pp.prefill = restarted
	toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: ps[1], MaxTokens: 4, IgnoreEOS: true}, 78)
	if len(toks) != 4 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
		t.Errorf("after the restart: %d tokens, decode %q, prefill %q", len(toks), dfin.Reason, pfin.Reason)
	}
}

// Garbage on the PD sockets (malformed, unknown, misplaced and late
// messages) is counted and dropped: the receive loops stay alive and a real
// transfer succeeds afterwards.
func TestPDSocketsSurviveGarbage(t *testing.T) {
	m := tinyModel(t)
	pp := newPDPair(t, Config{PageSize: 4, KVTokens: 512, MaxRunning: 4})
	out, err := zmqlink.NewOutbox(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	rng := rand.New(rand.NewPCG(5, 5))
	valid := func(msg pdproto.Message) [][]byte {
		f, err := pdproto.Encode(msg)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	msgs := [][][]byte{
		{[]byte("hello")},
		{pdproto.Guard(), []byte("NO_SUCH_TYPE"), {1, 2, 3}},
		valid(&pdproto.KVChunk{Room: 404, Start: 0, End: 0}),                   // late on the decode, misplaced on the prefill
		valid(&pdproto.TransferInfo{Room: 405, Endpoint: "tcp://127.0.0.1:1"}), // misplaced on the decode
		valid(&pdproto.AbortAck{Room: 406}),
		valid(&pdproto.Heartbeat{Sender: "tcp://127.0.0.1:1", Reply: true}),
	}
	for range 200 {
		n := 1 + rng.IntN(5)
		frames := make([][]byte, n)
		for i := range frames {
			frames[i] = make([]byte, rng.IntN(64))
			for j := range frames[i] {
				frames[i][j] = byte(rng.Uint32())
			}
		}
		if rng.IntN(2) == 0 {
			frames[0] = pdproto.Guard()
		}
		msgs = append(msgs, frames)
	}
	endpoints := []string{pp.prefill.PD().Links()[0].Inbox.Endpoint, pp.decode.PD().Links()[0].Inbox.Endpoint}
	for _, ep := range endpoints {
		for _, f := range msgs {
			if err := out.Send(context.Background(), ep, f); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitfor.Check(t, "garbage received", 10*time.Second, func() bool {
		return pp.prefill.PD().Links()[0].Inbox.Messages >= uint64(len(msgs)) && pp.decode.PD().Links()[0].Inbox.Messages >= uint64(len(msgs))
	})
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		l := e.PD().Links()[0]
		if !l.Inbox.Alive || l.Inbox.HandlerErrors == 0 || l.Late+l.Misplaced == 0 {
			t.Errorf("%s: %+v", e.cfg.Role, l)
		}
	}
	p := testmodel.Prompts(43, 1, 10, 20, m.Config.VocabSize)[0]
	if toks, dfin, _ := pp.run(t, context.Background(), Request{Prompt: p, MaxTokens: 3, IgnoreEOS: true}, 99); len(toks) != 3 {
		t.Errorf("after the garbage: %d tokens, %q", len(toks), dfin.Reason)
	}
}

func FuzzMailbox(f *testing.F) {
	for _, msg := range []pdproto.Message{&pdproto.KVChunk{Room: 1}, &pdproto.TransferInfo{Room: 1}, &pdproto.Abort{Room: 1},
		&pdproto.Status{Room: 1}, &pdproto.AbortAck{Room: 1}, &pdproto.Heartbeat{Sender: "x"}} {
		frames, _ := pdproto.Encode(msg)
		f.Add(bytes.Join(frames, []byte{0xff, 0xfe}))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		frames := bytes.Split(b, []byte{0xff, 0xfe})
		for _, prefill := range []bool{true, false} {
			role := rooms.Decode
			if prefill {
				role = rooms.Prefill
			}
			mb := newMailbox(mailbox.Config{Role: role, Sender: "self"}, func() {}, &faultSet{})
			mb.reply = func(string, pdproto.Message) {}
			mb.probe("x", 0, time.Second) // a peer whose replies count
			mb.admit(1)
			mb.handle(frames) // must not panic; errors are the transport's to count
			mb.take(1)
			mb.forget(1, "gone", false)
			mb.expire(time.Now())
		}
	})
}

// pdHandshake starts a prefill engine with pc and a decode engine with dc
// (their roles set here) on the tiny model, sends the decode one PD request
// for the prefill's registry, and returns both engines and the decode's
// tokens and finish.
func pdHandshake(t *testing.T, pc, dc Config) (p, d *Engine, toks []int32, fin Finish) {
	t.Helper()
	m := tinyModel(t)
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	p = newEngine(t, m, pc)
	d = newEngine(t, m, dc)
	url := serveRegistry(t, p, 1)
	allowRegistry(t, d, url)
	s, err := d.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 2, PD: &PDRequest{Room: 3, BootstrapURL: url}})
	if err != nil {
		t.Fatal(err)
	}
	toks, fin = collect(t, s, 20*time.Second)
	return p, d, toks, fin
}

// A decode refuses a prefill whose pools do not match its own at the
// handshake, with an error naming the field; no pages are held after.
func TestPDHandshakeRefusesMismatch(t *testing.T) {
	_, d, _, fin := pdHandshake(t,
		Config{PageSize: 4, KVTokens: 256, MaxRunning: 2},
		Config{PageSize: 8, KVTokens: 256, MaxRunning: 2})
	if !strings.Contains(fin.Reason, "page_size") {
		t.Errorf("finish %q, want the page size mismatch named", fin.Reason)
	}
	checkPools(t, d)
}

// TestPDSmallDecodePool: sixty concurrent requests through a decode whose
// pool holds a few of them at once all complete. With the decode's room
// for growth off, transfers take the pages the running requests grow into,
// those are retracted, and a retracted request that does not fit any more
// must be passed by the parked transferred requests that hold the pages
// (it waited behind them for ever before); with the room for growth on
// (the default) a transfer never takes a running request's growth, so
// nothing is retracted at all.
func TestPDSmallDecodePool(t *testing.T) {
	for _, tc := range []struct {
		name    string
		reserve int
	}{{"no reserve", -1}, {"reserve", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{TP: 2, PageSize: 4, KVTokens: 128, MaxRunning: 4,
				PD: PDConfig{BootstrapTimeout: time.Minute, TransferTimeout: time.Minute, ReservedDecodeTokens: tc.reserve}}
			pp := newPDPair(t, cfg)
			vocab := pp.prefill.m.Config.VocabSize
			prompts := testmodel.Prompts(31, 60, 12, 20, vocab)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var wg sync.WaitGroup
			var mu sync.Mutex
			var short []string
			for i, p := range prompts {
				wg.Go(func() {
					toks, dfin, pfin := pp.run(t, ctx, Request{Prompt: p, MaxTokens: 40, IgnoreEOS: true}, uint64(70000+i))
					if len(toks) != 40 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
						mu.Lock()
						short = append(short, fmt.Sprintf("request %d: %d tokens, decode %q, prefill %q", i, len(toks), dfin.Reason, pfin.Reason))
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			for _, s := range short {
				t.Error(s)
			}
			retracted := pp.decode.View().Snapshot().Totals.Retractions
			t.Logf("decode retractions: %d", retracted)
			if tc.reserve == 0 && retracted != 0 {
				t.Errorf("the decode retracted %d requests with its room for growth on", retracted)
			}
			pp.drained(t, 10*time.Second)
		})
	}
}

// A PD failure is logged once, by the rank whose vote decided it, with
// the request, room, rank, peer and reason, and counted once by reason
// and by queue: here a decode at TP 2 whose prefill never gets its half
// of the request times out in its transfer queue.
func TestPDFailureLoggedOnce(t *testing.T) {
	var logs syncbuf.Buffer
	dc := abortCfg()
	dc.PD.TransferTimeout = 300 * time.Millisecond
	dc.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	pp := newPDPairCfg(t, abortCfg(), dc)
	room := newAbortRoom()
	d := pp.decodeHalf(t, Request{Prompt: []int32{5, 6, 7, 8, 9}, MaxTokens: 3}, room)
	_, fin := collect(t, d.s, abortFinishWithin)
	if !strings.Contains(fin.Reason, "KV not received within 300ms") {
		t.Fatalf("finish %q, want the transfer timeout", fin.Reason)
	}
	pp.drained(t, abortFinishWithin)
	var lines []string
	for l := range strings.SplitSeq(logs.String(), "\n") {
		if strings.Contains(l, "pd: request failed") {
			lines = append(lines, l)
		}
	}
	if len(lines) != 1 {
		t.Fatalf("%d failure log lines, want 1:\n%s", len(lines), logs.String())
	}
	for _, want := range []string{fmt.Sprintf("room=%d", room), "rank=0", "phase=transfer", "reason=timeout", "peer=tcp://"} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("log line %q lacks %q", lines[0], want)
		}
	}
	if got := pp.decode.PD().FailuresByReason(); got["timeout"] != 1 || len(got) != 1 {
		t.Errorf("failures by reason %v, want timeout 1", got)
	}
	if got := pp.decode.PD().FailuresByQueue(); got["transfer"] != 1 || pp.decode.PD().Failures() != 1 {
		t.Errorf("failures by queue %v, total %d", got, pp.decode.PD().Failures())
	}
}

// An ABORT that reaches a prefill rank after the loop last took the room's
// mail, and before the room ends, is still acknowledged: the room's end
// answers it, or the decode would hold its pages to the abort-ack deadline.
func TestMailboxAcksAnAbortLeftAtForget(t *testing.T) {
	mb := newMailbox(mailbox.Config{Role: rooms.Prefill, Rank: 1}, func() {}, &faultSet{})
	var sent []pdproto.Message
	mb.reply = func(_ string, m pdproto.Message) { sent = append(sent, m) }
	mb.admit(7)
	frames, err := pdproto.Encode(&pdproto.Abort{Room: 7, Endpoint: "tcp://decode", Rank: 1, Reason: "client gone"})
	if err != nil {
		t.Fatal(err)
	}
	if err := mb.handle(frames); err != nil {
		t.Fatal(err)
	}
	if len(sent) != 0 {
		t.Fatalf("a known room's ABORT was answered by the receive goroutine: %v", sent)
	}
	to, ack := mb.forget(7, "", false)
	if ack == nil || to != "tcp://decode" || ack.Room != 7 || ack.Rank != 1 || !ack.Known {
		t.Fatalf("forget answered %q %+v, want an ABORT_ACK of room 7 from rank 1 to tcp://decode, known", to, ack)
	}
	// An ABORT for a room the rank never had is acked at once, not known.
	frames, err = pdproto.Encode(&pdproto.Abort{Room: 8, Endpoint: "tcp://decode", Rank: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := mb.handle(frames); err != nil {
		t.Fatal(err)
	}
	if len(sent) != 1 || sent[0].(*pdproto.AbortAck).Known {
		t.Fatalf("an ABORT for unknown room 8 answered %+v, want one ack, not known", sent)
	}
	if to, ack := mb.forget(7, "", false); ack != nil {
		t.Errorf("a second forget answered again: %q %+v", to, ack)
	}
}

// Busy is not dead: requests that queue at a decode for memory far longer
// than the bootstrap timeout all complete, because the decode tells the
// prefill that each waiting room is queued (QUEUED), renewing its lease
// there. With the prefill dropping every QUEUED (the drop-queued fault
// switch stands in for a decode without the lease), the same load fails
// rooms by the prefill's bootstrap timeout.
func TestPDQueuedOutlivesBootstrapTimeout(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault []string
	}{{"lease", nil}, {"no lease", []string{FaultDrop(pdproto.TypeQueued)}}} {
		t.Run(tc.name, func(t *testing.T) {
			pd := PDConfig{BootstrapTimeout: 150 * time.Millisecond, HeartbeatInterval: 20 * time.Millisecond, HeartbeatTimeout: 5 * time.Second}
			pc := Config{TP: 2, PageSize: 4, KVTokens: 1024, MaxRunning: 4, PD: pd, Faults: tc.fault}
			// The decode holds two requests at a time: the rest queue.
			dc := Config{TP: 2, PageSize: 4, KVTokens: 320, MaxRunning: 2, PD: pd}
			pp := newPDPairCfg(t, pc, dc)
			prompts := testmodel.Prompts(33, 16, 8, 12, pp.prefill.m.Config.VocabSize)
			var wg sync.WaitGroup
			var mu sync.Mutex
			var failed []string
			for i, p := range prompts {
				wg.Go(func() {
					toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: p, MaxTokens: 128, IgnoreEOS: true}, uint64(91000+i))
					if len(toks) != 128 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
						mu.Lock()
						failed = append(failed, fmt.Sprintf("request %d: %d tokens, decode %q, prefill %q", i, len(toks), dfin.Reason, pfin.Reason))
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			if tc.fault == nil {
				for _, f := range failed {
					t.Error(f)
				}
			} else if len(failed) == 0 || !strings.Contains(strings.Join(failed, "\n"), "no word from the decode within 150ms") {
				t.Errorf("without the lease every queued request completed: the load did not queue past the bootstrap timeout (%d failed)", len(failed))
			}
			t.Logf("%d of %d requests failed", len(failed), len(prompts))
			pp.drained(t, 10*time.Second)
		})
	}
}

// A decode that asks about a room the prefill already failed and forgot
// (TRANSFER_INFO or QUEUED of a room it kept waiting) hears STATUS Failed
// with the reason at once, instead of waiting out its transfer timeout;
// a room that ended well, or that never was, is not answered.
func TestMailboxAnswersForAFailedRoom(t *testing.T) {
	mb := newMailbox(mailbox.Config{Role: rooms.Prefill}, func() {}, &faultSet{})
	type sent struct {
		to string
		m  pdproto.Message
	}
	var out []sent
	mb.reply = func(to string, m pdproto.Message) { out = append(out, sent{to, m}) }
	deliver := func(m pdproto.Message) {
		t.Helper()
		frames, err := pdproto.Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := mb.handle(frames); err != nil {
			t.Fatal(err)
		}
	}
	mb.admit(5)
	mb.forget(5, "no word from the decode within 10s", false)
	mb.admit(6)
	mb.forget(6, "", false)
	deliver(&pdproto.Queued{Room: 5, Endpoint: "tcp://d0", Position: 3})
	deliver(&pdproto.TransferInfo{Room: 5, Endpoint: "tcp://d0", Tokens: 4})
	deliver(&pdproto.TransferInfo{Room: 6, Endpoint: "tcp://d0", Tokens: 4})
	deliver(&pdproto.TransferInfo{Room: 7, Endpoint: "tcp://d0", Tokens: 4})
	if len(out) != 2 {
		t.Fatalf("%d answers, want 2 (QUEUED and TRANSFER_INFO of the failed room 5): %+v", len(out), out)
	}
	for _, s := range out {
		st, ok := s.m.(*pdproto.Status)
		if !ok || s.to != "tcp://d0" || st.Room != 5 || st.State != pdproto.Failed || !strings.Contains(st.Error, "no word from the decode") {
			t.Errorf("answer %q %+v, want STATUS Failed of room 5 with the reason", s.to, s.m)
		}
	}
}

// A bootstrap room belongs to one live request per server: a second
// request for a live room is refused at Submit (two would share one
// mailbox, and one's KV could land in the other); once the first ends,
// the room is free again.
func TestSubmitRefusesALiveRoom(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 256, MaxRunning: 2, Role: pdproto.RolePrefill, PD: PDConfig{BootstrapTimeout: 200 * time.Millisecond}})
	q := Request{Prompt: []int32{5, 6, 7}, MaxTokens: 1, PD: &PDRequest{Room: 77}}
	s, err := e.Submit(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Submit(context.Background(), q); !errors.Is(err, ErrRoomInUse) {
		t.Fatalf("second request for live room 77: %v, want ErrRoomInUse", err)
	}
	collect(t, s, 10*time.Second) // no decode: it ends by the bootstrap timeout
	s, err = e.Submit(context.Background(), q)
	if err != nil {
		t.Fatalf("room 77 after its request ended: %v", err)
	}
	s.Abort()
	collect(t, s, 10*time.Second)
}
