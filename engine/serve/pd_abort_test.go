package serve

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/clock"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// Abort in every state × cause, on both sides.
//
// States: prefill bootstrap (waiting for TRANSFER_INFO), active (in the
// prefill's scheduler), inflight (last chunk sent, waiting for the decode's
// STATUS); decode prealloc (registry, pages), transfer (waiting for the KV),
// running (in the decode's scheduler, after the first token).
//
// Causes: client (the request's context ends), operator (Engine.Abort by
// id), timeout (the state's timeout), peer (the other side aborts or fails).
//
// Every cell: the streams end with the expected finish within a deadline,
// both sides' PD queues drain, both KV pools end fully free, and a real
// request through the same pair succeeds afterwards.
//
// The prefill's inflight state lasts one decode iteration with a real
// decode (it acknowledges the last chunk at once), so its cells run against
// a scripted decode: ZeroMQ sockets of the test that send TRANSFER_INFO,
// take the chunks and answer (or not) as each cell needs.

// abortFinishWithin bounds how long a stream may take to end once its cell
// has done what ends it (timeouts included: they are at most 300ms here).
const abortFinishWithin = 10 * time.Second

var abortRoom atomic.Uint64

func init() { abortRoom.Store(60000) }

func newAbortRoom() uint64 { return abortRoom.Add(1) }

// newPDPairCfg is newPDPair with a configuration per side.
func newPDPairCfg(t *testing.T, pc, dc Config) *pdPair {
	t.Helper()
	m := tinyModel(t)
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	p := newEngine(t, m, pc)
	d := newEngine(t, m, dc)
	url := serveRegistry(t, p, pc.TP)
	allowRegistry(t, d, url)
	return &pdPair{prefill: p, decode: d, url: url}
}

// serveRegistry serves a bootstrap registry of tpSize ranks with e's ranks
// registered (none when e is nil: it answers 503 for ever).
func serveRegistry(t *testing.T, e *Engine, tpSize int) string {
	t.Helper()
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: tpSize})
	if e != nil {
		for _, info := range e.PD().RankInfos() {
			if _, err := reg.Register(info); err != nil {
				t.Fatal(err)
			}
		}
	}
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	return ts.URL
}

// abortCfg is the cells' base configuration: TP 2, small pages and
// chunks, short abort-ack deadline (a prefill rank that died acknowledges
// nothing).
func abortCfg() Config {
	return Config{TP: 2, PageSize: 4, KVTokens: 1024, MaxRunning: 4, MaxBatchTokens: 16, PrefillChunk: 4,
		PD: PDConfig{AbortAckTimeout: 300 * time.Millisecond}}
}

// half submits one side of a PD request under its own context.
type half struct {
	s      *Stream
	cancel context.CancelFunc
}

func submitHalf(t *testing.T, e *Engine, q Request, room uint64, url string) half {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	q.PD = &PDRequest{Room: room, BootstrapURL: url}
	if e.cfg.Role == pdproto.RoleDecode {
		allowRegistry(t, e, url)
	}
	s, err := e.Submit(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	return half{s: s, cancel: cancel}
}

// prefillHalf and decodeHalf submit the two sides of room on pp.
func (pp *pdPair) prefillHalf(t *testing.T, q Request, room uint64) half {
	t.Helper()
	return submitHalf(t, pp.prefill, q, room, "")
}

func (pp *pdPair) decodeHalf(t *testing.T, q Request, room uint64) half {
	t.Helper()
	return submitHalf(t, pp.decode, q, room, pp.url)
}

// prefilling reports whether request id is prefilling in e's scheduler.
func prefilling(e *Engine, id uint64) bool {
	return slices.ContainsFunc(e.View().Snapshot().Queue.Prefilling, func(r sched.ReqInfo) bool { return r.ID == id })
}

// pdEntry returns request id's entry on rank 0 of e.
func pdEntry(e *Engine, id uint64) (PDEntry, bool) {
	for _, en := range e.PD().QueueEntries()[0] {
		if en.ID == id {
			return en, true
		}
	}
	return PDEntry{}, false
}

// settle waits until both sides hold no PD request and their loops are
// quiet, then checks that every rank's KV pool is fully free: what drained
// and checkPools check, with one difference: it judges quiet from what
// each rank published: rank 0's snapshot of step N holds nothing, and
// every rank has published a record of step N or later and, after it,
// empty PD queues (a rank publishes its queues after the iteration's
// releases, and all ranks release a room in the same iteration).
// checkPools instead wants every record later than the snapshot, which
// holds only in the instant of an idle iteration between another rank's
// record and rank 0's next snapshot (rank 0 waits its heartbeat before
// each idle iteration), so its poll catches it by chance, after hundreds
// of milliseconds or seconds. Both poll through waitfor, which backs off
// rather than spinning (a spinning poll competes with the loops for the
// CPUs).
func (pp *pdPair) settle(t *testing.T, within time.Duration) {
	t.Helper()
	quiet := func(e *Engine) bool {
		for _, v := range e.PD().Queues() {
			if v != 0 {
				return false
			}
		}
		snap := e.View().Snapshot()
		if snap.Queue.HeldPages != 0 || snap.Totals.Finished != e.nextID.Load() {
			return false
		}
		for r, rec := range e.View().RankSteps() {
			if rec.Step < snap.Step.Step || len(e.PD().QueueEntries()[r]) != 0 {
				return false
			}
		}
		return betweenIterations(e)
	}
	if !waitfor.Poll(within, func() bool { return quiet(pp.prefill) && quiet(pp.decode) }) {
		for _, e := range []*Engine{pp.prefill, pp.decode} {
			snap := e.View().Snapshot()
			t.Errorf("%s not quiet within %v: queues %v, %d pages held, %d of %d requests finished",
				e.cfg.Role, within, e.PD().Queues(), snap.Queue.HeldPages, snap.Totals.Finished, e.nextID.Load())
		}
		return
	}
	// The loops are idle and between iterations: reading the pools is
	// ordered after their last changes (the records were published after
	// them), and no rank is inside an iteration that could change them.
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		for r, l := range e.sup.loops {
			p := l.rk.Pool()
			cached := 0
			if l.cache != nil {
				cached = l.cache.Evictable()
			}
			if p.FreePages()+cached != p.TotalPages() || p.CachedPages() != cached || p.Live() != 0 {
				t.Errorf("%s rank %d: %d of %d pages free, %d cached (%d evictable), %d live sequences",
					e.cfg.Role, r, p.FreePages(), p.TotalPages(), p.CachedPages(), cached, p.Live())
			}
			if err := p.Check(); err != nil {
				t.Errorf("%s rank %d: %v", e.cfg.Role, r, err)
			}
		}
	}
}

// betweenIterations reports whether every rank of e is between two
// iterations: all have completed the same control collectives, and each
// is either waiting in the next step input's broadcast or, rank 0 only,
// outside any collective and any iteration (waiting for work). A rank's published step
// record alone does not say so: a rank can be inside the next iteration,
// applying its input (an index-K switch, say), while its record still
// shows the last.
func betweenIterations(e *Engine) bool {
	groups := e.View().Collectives()
	ctl, fwd := groups[0], groups[1]
	for r, rs := range ctl.Ranks {
		switch {
		case rs.LastCompleted != ctl.Ranks[0].LastCompleted || fwd.Ranks[r].Waiting != nil:
			return false
		case rs.Waiting == nil && r == 0:
			if e.View().RankDecisions(0, ^uint64(0)).Open != nil {
				return false // inside an iteration, between its collectives
			}
		case rs.Waiting == nil || rs.Waiting.Tag != rankcore.Input.String() || rs.Waiting.Seq != rs.LastCompleted+1:
			return false
		}
	}
	return true
}

// finishMatch is what a cell expects of a stream's finish reason.
type finishMatch struct {
	exact string   // the reason, or
	has   []string // substrings the reason contains (any of them)
}

func finishIs(reason string) finishMatch   { return finishMatch{exact: reason} }
func finishHas(subs ...string) finishMatch { return finishMatch{has: subs} }
func (m finishMatch) String() string       { return fmt.Sprintf("%q%q", m.exact, m.has) }
func (m finishMatch) ok(reason string) bool {
	if m.exact != "" {
		return reason == m.exact
	}
	return slices.ContainsFunc(m.has, func(s string) bool { return strings.Contains(reason, s) })
}

// expectEnd reads s to its finish and checks the reason; it returns the
// tokens.
func expectEnd(t *testing.T, what string, s *Stream, want finishMatch) []int32 {
	t.Helper()
	toks, fin := collect(t, s, abortFinishWithin)
	if !want.ok(fin.Reason) {
		t.Errorf("%s: finish %q, want %v", what, fin.Reason, want)
	}
	return toks
}

// followUp runs a real request through pp and checks it, then that
// everything drained again.
func (pp *pdPair) followUp(t *testing.T) {
	t.Helper()
	m := pp.prefill.m
	p := testmodel.Prompts(newAbortRoom(), 1, 6, 12, m.Config.VocabSize)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	toks, dfin, pfin := pp.run(t, ctx, Request{Prompt: p, MaxTokens: 3, IgnoreEOS: true}, newAbortRoom())
	if len(toks) != 3 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
		t.Errorf("follow-up request: %d tokens, decode %q, prefill %q", len(toks), dfin.Reason, pfin.Reason)
	}
	pp.settle(t, 5*time.Second)
}

// fakeDecode is a scripted decode: one ZeroMQ socket per prefill rank, as
// the decode's ranks have, that records what the prefill sends it.
type fakeDecode struct {
	t      *testing.T
	pp     *pdPair
	inbox  []*zmqlink.Inbox
	out    *zmqlink.Outbox
	mu     sync.Mutex
	finals map[uint64]int // room: final chunks received (over the ranks)
	acks   map[uint64]int // room: ABORT_ACKs received
	fails  map[uint64]int // room: STATUS Failed received
}

func newFakeDecode(t *testing.T, pp *pdPair) *fakeDecode {
	t.Helper()
	f := &fakeDecode{t: t, pp: pp, finals: map[uint64]int{}, acks: map[uint64]int{}, fails: map[uint64]int{}}
	out, err := zmqlink.NewOutbox(nil)
	if err != nil {
		t.Fatal(err)
	}
	f.out = out
	t.Cleanup(func() { out.Close() })
	for range pp.prefill.View().Ranks() {
		in, err := zmqlink.Listen("tcp://127.0.0.1:0", f.handle, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { in.Close() })
		f.inbox = append(f.inbox, in)
	}
	return f
}

func (f *fakeDecode) handle(frames [][]byte) error {
	m, err := pdproto.Decode(frames)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	switch m := m.(type) {
	case *pdproto.KVChunk:
		if m.Final != nil {
			f.finals[m.Room]++
		}
	case *pdproto.AbortAck:
		f.acks[m.Room]++
	case *pdproto.Status:
		if m.State == pdproto.Failed {
			f.fails[m.Room]++
		}
	}
	return nil
}

func (f *fakeDecode) count(c map[uint64]int, room uint64) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return c[room]
}

// toEach sends every prefill rank the message msg(rank) builds.
func (f *fakeDecode) toEach(msg func(r int) pdproto.Message) {
	f.t.Helper()
	for r, l := range f.pp.prefill.PD().Links() {
		frames, err := pdproto.Encode(msg(r))
		if err != nil {
			f.t.Fatal(err)
		}
		if err := f.out.Send(context.Background(), l.Inbox.Endpoint, frames); err != nil {
			f.t.Fatal(err)
		}
	}
}

// inflight submits a prefill half for room, hands it the fake's transfer
// info and waits until the prefill sent its last chunk and holds the
// request in its inflight queue.
func (f *fakeDecode) inflight(q Request, room uint64) half {
	f.t.Helper()
	h := f.pp.prefillHalf(f.t, q, room)
	ik := f.pp.prefill.PD().RankInfos()[0].IndexKDType
	f.toEach(func(r int) pdproto.Message {
		return &pdproto.TransferInfo{Room: room, Endpoint: f.inbox[r].Endpoint(), Rank: uint32(r), Tokens: uint32(len(q.Prompt)),
			Prompt: pdproto.PromptFingerprint(q.Prompt), IndexKDType: ik, RequestID: "fake"}
	})
	waitfor.Check(f.t, "prefill inflight", abortFinishWithin, func() bool {
		return f.count(f.finals, room) == len(f.inbox) && inQueue(f.pp.prefill, h.s.ID, "inflight")
	})
	return h
}

func (f *fakeDecode) status(room uint64, st pdproto.KVPoll, why string) {
	f.toEach(func(r int) pdproto.Message {
		return &pdproto.Status{Room: room, Rank: uint32(r), State: st, Error: why}
	})
}

func (f *fakeDecode) abort(room uint64) {
	f.toEach(func(r int) pdproto.Message {
		return &pdproto.Abort{Room: room, Endpoint: f.inbox[r].Endpoint(), Rank: uint32(r), Reason: "the client went"}
	})
}

// abortCell is one (side, state, cause) of the table.
type abortCell struct {
	side, state, cause string
	pc, dc             func(*Config) // configuration tweaks per side, nil for none
	run                func(t *testing.T, pp *pdPair)
}

// abortSmoke are the cells make test runs over real sockets: one per side
// and state, every cause among them. The whole matrix (state × cause ×
// side) is traced through both groups' loops and their PD machines in
// engine/rankcore/testdata/cluster-abort-*.txt; -tags abortmatrix runs all
// 24 cells here too.
var abortSmoke = map[string]bool{
	"prefill/bootstrap/timeout": true, "prefill/active/peer": true, "prefill/inflight/client": true, "prefill/inflight/timeout": true,
	"decode/prealloc/peer": true, "decode/transfer/operator": true, "decode/transfer/timeout": true, "decode/running/client": true,
}

func TestPDAbortEveryStateAndCause(t *testing.T) {
	m := tinyModel(t)
	vocab := m.Config.VocabSize
	prompt := func(n int) []int32 { return testmodel.Prompts(uint64(n)*7+1, 1, n, n, vocab)[0] }
	short := Request{Prompt: prompt(10), MaxTokens: 4, IgnoreEOS: true}
	// long keeps a prefill in its scheduler for a hundred steps (chunks
	// of 4 tokens).
	long := Request{Prompt: prompt(400), MaxTokens: 4, IgnoreEOS: true}
	longest := Request{Prompt: prompt(500), MaxTokens: 4, IgnoreEOS: true}
	const ms300 = 300 * time.Millisecond
	// A peer's failure as the other side reports it: the peer's word as
	// rank 0 heard it, or (when another rank heard it first) the side
	// that failed the room.
	byPrefill := finishHas("error: pd: the prefill failed", "error: pd: another rank failed the room: its prefill peer")
	// An end the peer's side was asked for (its client, an operator) is an
	// abort on this side too, whichever rank heard it first: the agreed
	// vote carries it.
	byAbort := finishIs(ReasonAbort)

	// activeSession opens both halves of a long request and waits until
	// the prefill is prefilling it (the decode, whose info the prefill
	// has, is then in transfer: it has no last chunk yet).
	activeSession := func(t *testing.T, pp *pdPair, long Request) (p, d half) {
		t.Helper()
		room := newAbortRoom()
		p = pp.prefillHalf(t, long, room)
		d = pp.decodeHalf(t, long, room)
		waitfor.Check(t, "prefill prefilling", abortFinishWithin, func() bool { return prefilling(pp.prefill, p.s.ID) })
		if !inQueue(pp.prefill, p.s.ID, "active") || !inQueue(pp.decode, d.s.ID, "transfer") {
			t.Errorf("not active/transfer: prefill %v, decode %v", pp.prefill.PD().QueueEntries()[0], pp.decode.PD().QueueEntries()[0])
		}
		return p, d
	}
	// bootstrapping submits a prefill half alone and waits for it in the
	// bootstrap queue.
	bootstrapping := func(t *testing.T, pp *pdPair) half {
		t.Helper()
		p := pp.prefillHalf(t, short, newAbortRoom())
		waitfor.Check(t, "prefill bootstrap", abortFinishWithin, func() bool { return inQueue(pp.prefill, p.s.ID, "bootstrap") })
		return p
	}
	// transferring submits a decode half alone and waits for it in the
	// transfer queue (pages reserved, info sent, no prefill to answer).
	transferring := func(t *testing.T, pp *pdPair) half {
		t.Helper()
		d := pp.decodeHalf(t, short, newAbortRoom())
		waitfor.Check(t, "decode transfer", abortFinishWithin, func() bool { return inQueue(pp.decode, d.s.ID, "transfer") })
		return d
	}
	// preallocating submits a decode half alone against a registry that
	// answers 503 for ever (a TP-2 group nobody registered in).
	preallocating := func(t *testing.T, pp *pdPair) half {
		t.Helper()
		d := submitHalf(t, pp.decode, short, newAbortRoom(), serveRegistry(t, nil, 2))
		waitfor.Check(t, "decode prealloc", abortFinishWithin, func() bool { return inQueue(pp.decode, d.s.ID, "prealloc") })
		return d
	}
	// running opens both halves of a request with many tokens to decode
	// and waits for its first token on the decode.
	running := func(t *testing.T, pp *pdPair, maxTokens int) (p, d half) {
		t.Helper()
		room := newAbortRoom()
		q := Request{Prompt: prompt(8), MaxTokens: maxTokens, IgnoreEOS: true}
		p = pp.prefillHalf(t, q, room)
		d = pp.decodeHalf(t, q, room)
		select {
		case ev := <-d.s.Events:
			if ev.Finish != nil {
				t.Fatalf("decode finished before its first token: %+v", ev.Finish)
			}
		case <-time.After(abortFinishWithin):
			t.Fatal("no first token on the decode")
		}
		return p, d
	}
	// The decode's ABORT after a prefill abort or failure is answered by
	// the prefill (or dropped as late): the decode's aborting queue drains
	// by the ack or its deadline either way, which drained checks.

	cells := []abortCell{
		// Prefill: bootstrap.
		{side: "prefill", state: "bootstrap", cause: "client", run: func(t *testing.T, pp *pdPair) {
			p := bootstrapping(t, pp)
			p.cancel()
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
		}},
		{side: "prefill", state: "bootstrap", cause: "operator", run: func(t *testing.T, pp *pdPair) {
			p := bootstrapping(t, pp)
			pp.prefill.Abort(p.s.ID)
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
		}},
		{side: "prefill", state: "bootstrap", cause: "timeout", pc: func(c *Config) { c.PD.BootstrapTimeout = ms300 }, run: func(t *testing.T, pp *pdPair) {
			p := bootstrapping(t, pp)
			expectEnd(t, "prefill", p.s, finishHas("no word from the decode within 300ms"))
		}},
		{side: "prefill", state: "bootstrap", cause: "peer", dc: func(c *Config) { c.KVTokens = 64 }, run: func(t *testing.T, pp *pdPair) {
			// The decode resolved the prefill but waits for pages (a
			// decode-only blocker holds them), so it sent no info: its
			// abort reaches the prefill in bootstrap.
			q := Request{Prompt: prompt(40), MaxTokens: 4, IgnoreEOS: true}
			blocker := pp.decodeHalf(t, q, newAbortRoom())
			waitfor.Check(t, "blocker in transfer", abortFinishWithin, func() bool { return inQueue(pp.decode, blocker.s.ID, "transfer") })
			room := newAbortRoom()
			p := pp.prefillHalf(t, q, room)
			waitfor.Check(t, "prefill bootstrap", abortFinishWithin, func() bool { return inQueue(pp.prefill, p.s.ID, "bootstrap") })
			d := pp.decodeHalf(t, q, room)
			waitfor.Check(t, "decode waiting for pages", abortFinishWithin, func() bool {
				en, ok := pdEntry(pp.decode, d.s.ID)
				return ok && en.Queue == "prealloc" && en.Peer != ""
			})
			if !inQueue(pp.prefill, p.s.ID, "bootstrap") {
				t.Errorf("prefill not in bootstrap: %v", pp.prefill.PD().QueueEntries()[0])
			}
			pp.decode.Abort(d.s.ID)
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
			expectEnd(t, "prefill", p.s, byAbort)
			blocker.cancel()
			expectEnd(t, "blocker", blocker.s, finishIs(ReasonAbort))
		}},

		// Prefill: active (prefilling in the scheduler).
		{side: "prefill", state: "active", cause: "client", run: func(t *testing.T, pp *pdPair) {
			p, d := activeSession(t, pp, long)
			p.cancel()
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
			expectEnd(t, "decode", d.s, byAbort)
		}},
		{side: "prefill", state: "active", cause: "operator", run: func(t *testing.T, pp *pdPair) {
			p, d := activeSession(t, pp, long)
			pp.prefill.Abort(p.s.ID)
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
			expectEnd(t, "decode", d.s, byAbort)
		}},
		{side: "prefill", state: "active", cause: "timeout", pc: func(c *Config) {
			c.PrefillTimeout, c.PrefillChunk, c.Clock = time.Minute, 1, clock.NewManual(time.Now())
		}, run: func(t *testing.T, pp *pdPair) {
			// 500 tokens one a step: the prefill is still running when
			// its clock jumps past the timeout.
			p, d := activeSession(t, pp, longest)
			pp.prefill.cfg.Clock.(*clock.Manual).Advance(time.Hour)
			expectEnd(t, "prefill", p.s, finishIs(ReasonTimeout))
			expectEnd(t, "decode", d.s, byPrefill)
		}},
		{side: "prefill", state: "active", cause: "peer", run: func(t *testing.T, pp *pdPair) {
			p, d := activeSession(t, pp, long)
			pp.decode.Abort(d.s.ID)
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
			expectEnd(t, "prefill", p.s, byAbort)
		}},

		// Prefill: inflight, against the scripted decode.
		{side: "prefill", state: "inflight", cause: "client", run: func(t *testing.T, pp *pdPair) {
			f := newFakeDecode(t, pp)
			room := newAbortRoom()
			p := f.inflight(short, room)
			p.cancel()
			// The prefill's work is done; the abort ends the stream with
			// the decode's word (here its ack), or the inflight timeout.
			f.status(room, pdproto.Success, "")
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
		}},
		{side: "prefill", state: "inflight", cause: "operator", run: func(t *testing.T, pp *pdPair) {
			f := newFakeDecode(t, pp)
			room := newAbortRoom()
			p := f.inflight(short, room)
			pp.prefill.Abort(p.s.ID)
			f.abort(room) // the router's abort, fanned out to the decode
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
			// Every rank acknowledges its ABORT: at once if it had the
			// room then, or, when another rank's ABORT failed the room
			// on every rank first (this rank then sent STATUS Failed),
			// as an ABORT for a room it no longer has.
			waitfor.Check(t, "every prefill rank acknowledged the ABORT", abortFinishWithin, func() bool {
				return f.count(f.acks, room) == pp.prefill.View().Ranks()
			})
		}},
		{side: "prefill", state: "inflight", cause: "timeout", pc: func(c *Config) { c.PD.InflightTimeout = ms300 }, run: func(t *testing.T, pp *pdPair) {
			f := newFakeDecode(t, pp)
			room := newAbortRoom()
			p := f.inflight(short, room)
			expectEnd(t, "prefill", p.s, finishHas("error: pd: no acknowledgement from the decode within 300ms"))
		}},
		{side: "prefill", state: "inflight", cause: "peer", run: func(t *testing.T, pp *pdPair) {
			f := newFakeDecode(t, pp)
			room := newAbortRoom()
			p := f.inflight(short, room)
			f.status(room, pdproto.Failed, "decode out of memory")
			expectEnd(t, "prefill", p.s, finishHas("error: pd: the decode failed: decode out of memory", "error: pd: another rank failed the room: its decode"))
		}},

		// Decode: prealloc.
		{side: "decode", state: "prealloc", cause: "client", run: func(t *testing.T, pp *pdPair) {
			d := preallocating(t, pp)
			d.cancel()
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
		}},
		{side: "decode", state: "prealloc", cause: "operator", run: func(t *testing.T, pp *pdPair) {
			d := preallocating(t, pp)
			pp.decode.Abort(d.s.ID)
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
		}},
		{side: "decode", state: "prealloc", cause: "timeout", dc: func(c *Config) { c.PD.BootstrapTimeout = ms300 }, run: func(t *testing.T, pp *pdPair) {
			d := preallocating(t, pp)
			// The lookup gives up by the same deadline the queue judges.
			expectEnd(t, "decode", d.s, finishHas("not resolved within 300ms", "did not answer within 300ms"))
		}},
		{side: "decode", state: "prealloc", cause: "peer", run: func(t *testing.T, pp *pdPair) {
			// The prefill group refuses the decode's layout (another page
			// size): the handshake fails at once, naming the prefill and
			// the field.
			oc := abortCfg()
			oc.Role, oc.PageSize = pdproto.RolePrefill, 8
			other := newEngine(t, pp.prefill.m, oc)
			d := submitHalf(t, pp.decode, short, newAbortRoom(), serveRegistry(t, other, oc.TP))
			expectEnd(t, "decode", d.s, finishHas("does not fit this decode (page_size differs"))
		}},

		// Decode: transfer.
		{side: "decode", state: "transfer", cause: "client", run: func(t *testing.T, pp *pdPair) {
			d := transferring(t, pp)
			d.cancel()
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
		}},
		{side: "decode", state: "transfer", cause: "operator", run: func(t *testing.T, pp *pdPair) {
			d := transferring(t, pp)
			pp.decode.Abort(d.s.ID)
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
			// Its pages stay reserved until the deadline (the prefill
			// never saw the room, so nobody acknowledges).
			waitfor.Check(t, "decode aborting with ABORT sent", abortFinishWithin, func() bool {
				en, ok := pdEntry(pp.decode, d.s.ID)
				return !ok || en.Queue == "aborting" && en.AbortSent
			})
		}},
		{side: "decode", state: "transfer", cause: "timeout", dc: func(c *Config) { c.PD.TransferTimeout = ms300 }, run: func(t *testing.T, pp *pdPair) {
			d := transferring(t, pp)
			expectEnd(t, "decode", d.s, finishHas("error: pd: KV not received within 300ms"))
		}},
		{side: "decode", state: "transfer", cause: "peer", run: func(t *testing.T, pp *pdPair) {
			// The decode waits alone, then its prefill half arrives and
			// is aborted by the prefill's operator mid-prefill.
			room := newAbortRoom()
			d := pp.decodeHalf(t, long, room)
			waitfor.Check(t, "decode transfer", abortFinishWithin, func() bool { return inQueue(pp.decode, d.s.ID, "transfer") })
			p := pp.prefillHalf(t, long, room)
			waitfor.Check(t, "prefill prefilling", abortFinishWithin, func() bool { return prefilling(pp.prefill, p.s.ID) })
			pp.prefill.Abort(p.s.ID)
			expectEnd(t, "prefill", p.s, finishIs(ReasonAbort))
			expectEnd(t, "decode", d.s, byAbort)
		}},

		// Decode: in its scheduler (after the first token).
		{side: "decode", state: "running", cause: "client", run: func(t *testing.T, pp *pdPair) {
			p, d := running(t, pp, 400)
			expectEnd(t, "prefill", p.s, finishIs(ReasonLength))
			d.cancel()
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
		}},
		{side: "decode", state: "running", cause: "operator", run: func(t *testing.T, pp *pdPair) {
			p, d := running(t, pp, 400)
			pp.decode.Abort(d.s.ID)
			expectEnd(t, "decode", d.s, finishIs(ReasonAbort))
			expectEnd(t, "prefill", p.s, finishIs(ReasonLength))
		}},
		{side: "decode", state: "running", cause: "timeout", dc: func(c *Config) {
			c.RequestTimeout, c.Clock = time.Minute, clock.NewManual(time.Now())
		}, run: func(t *testing.T, pp *pdPair) {
			// 500 tokens to decode one a step: the decode is still
			// running when its clock jumps past the timeout.
			p, d := running(t, pp, 500)
			pp.decode.cfg.Clock.(*clock.Manual).Advance(time.Hour)
			expectEnd(t, "decode", d.s, finishIs(ReasonTimeout))
			expectEnd(t, "prefill", p.s, finishIs(ReasonLength))
		}},
		{side: "decode", state: "running", cause: "peer", run: func(t *testing.T, pp *pdPair) {
			// The prefill is done with the request once the decode holds
			// its KV: an abort there changes nothing here.
			p, d := running(t, pp, 20)
			pp.prefill.Abort(p.s.ID)
			p.cancel()
			// Its stream ends as the abort found it: done (length), or
			// still waiting for the decode's ack (abort).
			expectEnd(t, "prefill", p.s, finishHas(ReasonLength, ReasonAbort))
			if toks := expectEnd(t, "decode", d.s, finishIs(ReasonLength)); len(toks) != 19 {
				t.Errorf("decode streamed %d more tokens, want 19", len(toks))
			}
		}},
	}
	for _, c := range cells {
		name := c.side + "/" + c.state + "/" + c.cause
		if !allAbortCells && !abortSmoke[name] {
			continue
		}
		t.Run(name, func(t *testing.T) {
			pc, dc := abortCfg(), abortCfg()
			if c.pc != nil {
				c.pc(&pc)
			}
			if c.dc != nil {
				c.dc(&dc)
			}
			pp := newPDPairCfg(t, pc, dc)
			start := time.Now()
			c.run(t, pp)
			pp.settle(t, 5*time.Second)
			t.Logf("ended and drained in %v", time.Since(start).Round(time.Millisecond))
			if t.Failed() {
				return
			}
			pp.followUp(t)
		})
	}
}

// TestPDAbortAckUnknownRoom: a prefill rank acknowledges an ABORT for a
// room it does not have, whether the room has not arrived yet or has ended,
// since it writes nothing for such a room; a request for the room that
// arrives after its ABORT fails on it.
func TestPDAbortAckUnknownRoom(t *testing.T) {
	pp := newPDPairCfg(t, abortCfg(), abortCfg())
	m := pp.prefill.m
	f := newFakeDecode(t, pp)
	ranks := pp.prefill.View().Ranks()
	q := Request{Prompt: testmodel.Prompts(5, 1, 10, 10, m.Config.VocabSize)[0], MaxTokens: 2, IgnoreEOS: true}

	// Not arrived yet.
	early := newAbortRoom()
	f.abort(early)
	waitfor.Check(t, "the ABORTs for a room not arrived acknowledged", abortFinishWithin, func() bool { return f.count(f.acks, early) == ranks })
	p := pp.prefillHalf(t, q, early)
	expectEnd(t, "prefill after its ABORT", p.s, finishHas("error: pd: aborted by the decode: the client went"))

	// Ended: the scripted decode took the KV and said Success.
	done := newAbortRoom()
	p = f.inflight(q, done)
	f.status(done, pdproto.Success, "")
	expectEnd(t, "prefill", p.s, finishIs(ReasonLength))
	waitfor.Check(t, "the room gone from every rank", abortFinishWithin, func() bool {
		for _, es := range pp.prefill.PD().QueueEntries() {
			if len(es) != 0 {
				return false
			}
		}
		return true
	})
	f.abort(done)
	waitfor.Check(t, "the ABORTs for an ended room acknowledged", abortFinishWithin, func() bool { return f.count(f.acks, done) == ranks })
	pp.settle(t, 5*time.Second)
	pp.followUp(t)
}
