package serve

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// switchPerTurn switches e's index-K precision to to[k] while the sessions'
// turn k runs, once half of that turn's requests have finished; turn k+1
// waits for switch k (its gate), so every switch meets the same load however
// the machine schedules: half a turn finished, the rest in the scheduler or
// the inbox. It returns the gate for runChatsGated and the switches'
// outcomes, which wait for the last.
func switchPerTurn(t *testing.T, e *Engine, sessions int, to ...kernels.IndexKDType) (func(turn int), func() []IndexKSwitch) {
	gates := make([]chan struct{}, len(to))
	for k := range gates {
		gates[k] = make(chan struct{})
	}
	var out []IndexKSwitch
	var wg sync.WaitGroup
	wg.Go(func() {
		defer func() { // a failed switch must not hold the sessions forever
			for _, g := range gates[len(out):] {
				close(g)
			}
		}()
		for k, dt := range to {
			want := uint64(k*sessions + sessions/2)
			if !waitfor.Check(t, fmt.Sprintf("half of turn %d finishing before the switch", k), 60*time.Second, func() bool {
				return e.View().Snapshot().Totals.Finished >= want
			}) {
				return
			}
			res, err := e.SetIndexK(context.Background(), dt, 30*time.Second)
			if err != nil {
				t.Error(err)
				return
			}
			out = append(out, res)
			close(gates[k])
		}
	})
	gate := func(turn int) {
		if turn == 0 || turn > len(gates) {
			return
		}
		select {
		case <-gates[turn-1]:
		case <-time.After(2 * time.Minute):
			t.Errorf("turn %d: switch %d never came", turn, turn-1)
		}
	}
	return gate, func() []IndexKSwitch { wg.Wait(); return out }
}

// A live index-K precision switch under a 60-session load, with HiCache on:
// every request finishes (the drain lets those in flight end, new ones wait
// in the inbox), every output equals its reference in the precision it ran
// in (fp8 or bf16; the two differ for most prompts, so the check means
// something), and no page leaks on either tier. The switch is visible in the
// settings and counted.
func TestIndexKSwitchUnderLoad(t *testing.T) {
	m := tinyModel(t)
	ss := sessions(61, 60, 2, 24, m.Config.VocabSize)
	const maxTok = 3
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 6, MaxBatchTokens: 64, PrefillChunk: 16, IndexK: kernels.IndexFP8}
	refFP8 := runChats(t, newEngine(t, m, cfg), ss, maxTok)
	bf := cfg
	bf.IndexK = kernels.IndexBF16
	refBF16 := runChats(t, newEngine(t, m, bf), ss, maxTok)
	differ := 0
	for i := range ss {
		for j := range ss[i] {
			if !slices.Equal(refFP8[i][j], refBF16[i][j]) {
				differ++
			}
		}
	}
	if differ < len(ss) {
		t.Fatalf("only %d of %d prompts give other tokens in bf16: the test could not tell the precisions apart", differ, 2*len(ss))
	}

	on := cfg
	on.HiCache = HiCacheConfig{Enabled: true, Ratio: 4}
	e := newEngine(t, m, on)
	gate, wait := switchPerTurn(t, e, len(ss), kernels.IndexBF16, kernels.IndexFP8)
	got := runChatsGated(t, e, ss, maxTok, gate)
	switches := wait()
	if len(switches) != 2 {
		t.Fatalf("switches %+v", switches)
	}
	for _, sw := range switches {
		if !sw.Changed || sw.Aborted != 0 || sw.Paused <= 0 {
			t.Errorf("switch %+v: want a change that aborted nothing", sw)
		}
		t.Logf("switch %v → %v: paused %v", sw.From, sw.To, sw.Paused)
	}
	inBF16 := 0
	for i := range ss {
		for j := range ss[i] {
			switch {
			case slices.Equal(got[i][j], refFP8[i][j]):
			case slices.Equal(got[i][j], refBF16[i][j]):
				inBF16++
			default:
				t.Errorf("chat %d turn %d: %v, neither the fp8 reference %v nor the bf16 one %v", i, j, got[i][j], refFP8[i][j], refBF16[i][j])
			}
		}
	}
	// The snapshot is published at the end of the iteration that switched.
	waitfor.Check(t, "two switches counted", 10*time.Second, func() bool { return e.View().Snapshot().Totals.IndexKSwitches == 2 })
	if e.View().IndexK() != kernels.IndexFP8 || e.View().Settings().IndexK != "fp8" {
		t.Errorf("after two switches: index-K %v, settings %q, switches %d", e.View().IndexK(), e.View().Settings().IndexK, e.View().Snapshot().Totals.IndexKSwitches)
	}
	t.Logf("%d of %d requests ran in bf16 (the others in fp8)", inBF16, 2*len(ss))
	checkPools(t, e)
	for _, ts := range e.View().HiCache() {
		if !ts.On {
			t.Errorf("rank %d: hicache off after the switches", ts.Rank)
		}
	}
	closeAndCheckCaches(t, e)
}

// A switch whose drain bound runs out aborts what is still in flight, each
// with its reason, and switches; the engine then serves in the new precision.
func TestIndexKSwitchDrainBound(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{TP: 1, PageSize: 4, KVTokens: 512, MaxRunning: 4, IndexK: kernels.IndexFP8})
	var streams []*Stream
	for i := range 4 {
		s, err := e.Submit(context.Background(), Request{Prompt: []int32{1, 2, 3, int32(i)}, MaxTokens: 500, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	waitfor.Check(t, "the requests running", 20*time.Second, func() bool { return e.View().Snapshot().Totals.Sampled >= 8 })
	res, err := e.SetIndexK(context.Background(), kernels.IndexBF16, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Aborted == 0 || !res.Changed || res.To != kernels.IndexBF16 {
		t.Fatalf("switch %+v: want the running requests aborted", res)
	}
	// A request may have finished between the poll and the switch on a
	// loaded machine; every other one is aborted, as the switch counted.
	aborted := 0
	for _, s := range streams {
		switch _, f := collect(t, s, 20*time.Second); {
		case f.Reason == ReasonAbort:
			aborted++
		case f.Reason != ReasonLength || f.CompletionTokens != 500:
			t.Errorf("request %d: %+v", s.ID, f)
		}
	}
	if aborted != res.Aborted {
		t.Errorf("%d streams aborted, the switch says %d", aborted, res.Aborted)
	}
	s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 3, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if toks, f := collect(t, s, 20*time.Second); f.Reason != ReasonLength || len(toks) != 3 {
		t.Errorf("after the switch: %v %+v", toks, f)
	}
	if again, err := e.SetIndexK(context.Background(), kernels.IndexBF16, time.Second); err != nil || again.Changed {
		t.Errorf("a switch to the precision in use: %+v %v", again, err)
	}
	checkPools(t, e)
}

// switchPair is a PD pair whose prefill re-registers its ranks after a
// switch, as pdserve does.
func switchPair(t *testing.T, cfg Config) *pdPair {
	t.Helper()
	return switchPairCfg(t, cfg, cfg)
}

// switchPairCfg is switchPair with a config for each side.
func switchPairCfg(t *testing.T, pc, dc Config) *pdPair {
	t.Helper()
	m := tinyModel(t)
	var reg atomic.Pointer[bootstrap.Registry]
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	pc.PD.OnRankInfos = func(infos []pdproto.RankInfo) {
		if err := reg.Load().Replace(infos); err != nil {
			t.Errorf("re-registering: %v", err)
		}
	}
	p := newEngine(t, m, pc)
	d := newEngine(t, m, dc)
	r := bootstrap.NewRegistry(bootstrap.Options{TPSize: p.View().Ranks()})
	for _, info := range p.PD().RankInfos() {
		if _, err := r.Register(info); err != nil {
			t.Fatal(err)
		}
	}
	reg.Store(r)
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, r)
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	allowRegistry(t, d, ts.URL)
	return &pdPair{prefill: p, decode: d, url: ts.URL}
}

// A PD pair switched side by side under load: requests in flight either
// finish in one precision on both sides or fail with the handshake's reason
// (the precisions differ), never with the KV of one precision landing in a
// pool of the other; once both sides run bf16, every request succeeds with
// the bf16 reference's tokens, through the re-registered registry.
func TestIndexKSwitchPD(t *testing.T) {
	m := tinyModel(t)
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, MaxBatchTokens: 32, PrefillChunk: 8, IndexK: kernels.IndexFP8,
		PD: PDConfig{BootstrapTimeout: time.Second}} // a room the decode refused waits this long on the prefill
	ps := sessions(71, 40, 1, 20, m.Config.VocabSize)
	bf := cfg
	bf.IndexK = kernels.IndexBF16
	refFP8 := runChats(t, newEngine(t, m, cfg), ps, 3)
	refBF16 := runChats(t, newEngine(t, m, bf), ps, 3)

	pp := switchPair(t, cfg)
	var wg sync.WaitGroup
	var mu sync.Mutex
	failed, ok := 0, 0
	for i, c := range ps {
		wg.Go(func() {
			toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: c[0], MaxTokens: 3, IgnoreEOS: true}, uint64(30000+i))
			mu.Lock()
			defer mu.Unlock()
			if dfin.Reason != ReasonLength {
				failed++
				// The reason names the precisions where rank 0 decided
				// the failure; where another rank did, rank 0's stream
				// says so and that rank's log names them.
				named := func(r string) bool {
					return strings.Contains(r, "index_k_dtype") || strings.Contains(r, "index-K") || strings.Contains(r, "another rank failed the room")
				}
				if !named(dfin.Reason) && !named(pfin.Reason) {
					t.Errorf("prompt %d failed without naming the precision: decode %+v, prefill %+v", i, dfin, pfin)
				}
				return
			}
			ok++
			if !slices.Equal(toks, refFP8[i][0]) && !slices.Equal(toks, refBF16[i][0]) {
				t.Errorf("prompt %d: %v, neither reference (fp8 %v, bf16 %v)", i, toks, refFP8[i][0], refBF16[i][0])
			}
		})
	}
	// The prefill first: its rooms need the decode's word, which a decode
	// already switched would refuse to send.
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		res, err := e.SetIndexK(context.Background(), kernels.IndexBF16, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: paused %v, aborted %d", e.cfg.Role, res.Paused, res.Aborted)
	}
	wg.Wait()
	t.Logf("during the switch: %d finished, %d failed", ok, failed)
	for i, c := range ps {
		toks, dfin, _ := pp.run(t, context.Background(), Request{Prompt: c[0], MaxTokens: 3, IgnoreEOS: true}, uint64(40000+i))
		if !slices.Equal(toks, refBF16[i][0]) {
			t.Errorf("prompt %d after the switch: %v (%s), bf16 reference %v", i, toks, dfin.Reason, refBF16[i][0])
		}
	}
	for _, e := range []*Engine{pp.prefill, pp.decode} {
		checkPools(t, e)
		if e.View().IndexK() != kernels.IndexBF16 {
			t.Errorf("%s: index-K %v", e.cfg.Role, e.View().IndexK())
		}
	}
}

// A prefill's switch does not wait for the rooms still waiting for their
// decode's word: they hold nothing in either precision, and their decode
// may be waiting for pages that only requests the drain holds back would
// free. Here the decode has pages for one request. A holds them, its KV
// due from a prefill half that reaches the prefill only after the switch
// began (the drain keeps it queued); B, admitted on both sides before,
// waits for those pages, its decode renewing B's lease on the prefill.
// A drain that waited for B would wait out A's transfer timeout or its own
// bound. Instead the switch runs at once; A then fails on the handshake
// (its decode is still fp8), which frees B's pages, and B fails the same
// way; once the decode switches too, the pair serves.
func TestIndexKSwitchSkipsRoomsInBootstrap(t *testing.T) {
	pc := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, IndexK: kernels.IndexFP8,
		PD: PDConfig{BootstrapTimeout: time.Minute, TransferTimeout: time.Minute}}
	dc := pc
	dc.KVTokens, dc.PD.ReservedDecodeTokens = 32, -1 // one request's pages (each 5 for its prompt, 1 for its first token)
	pp := switchPairCfg(t, pc, dc)
	vocab := pp.prefill.m.Config.VocabSize
	ps := testmodel.Prompts(73, 3, 20, 20, vocab)
	q := func(i int) Request { return Request{Prompt: ps[i], MaxTokens: 4, IgnoreEOS: true} }

	da := pp.decodeHalf(t, q(0), 31000)
	waitfor.Check(t, "A waiting for its KV", 20*time.Second, func() bool { return inQueue(pp.decode, da.s.ID, "transfer") })
	pb, db := pp.prefillHalf(t, q(1), 31001), pp.decodeHalf(t, q(1), 31001)
	waitfor.Check(t, "B in bootstrap, its decode waiting for pages", 20*time.Second, func() bool {
		return inQueue(pp.prefill, pb.s.ID, "bootstrap") && inQueue(pp.decode, db.s.ID, "prealloc")
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := pp.prefill.SetIndexK(ctx, kernels.IndexBF16, time.Minute)
	if err != nil {
		t.Fatalf("the prefill's switch: %v", err)
	}
	if !res.Changed || res.Aborted != 0 {
		t.Errorf("the prefill's switch: %+v, want it done with nothing aborted", res)
	}
	pa := pp.prefillHalf(t, q(0), 31000)
	// Each stream names the precisions, or on rank 0 the rank that did;
	// the counts below say which reasons the owners had.
	precisions := finishHas(`decode index-K "fp8", prefill "bf16"`, "another rank failed the room")
	for _, h := range []struct {
		what string
		s    *Stream
	}{{"A's prefill", pa.s}, {"A's decode", da.s}, {"B's prefill", pb.s}, {"B's decode", db.s}} {
		expectEnd(t, h.what, h.s, precisions)
	}
	for _, c := range []struct {
		e    *Engine
		want map[string]uint64
	}{{pp.prefill, map[string]uint64{"refused": 2}}, {pp.decode, map[string]uint64{"peer-failed": 2}}} {
		// The rank that owns a failure counts it as it ends the room;
		// with TP 2 that may be rank 1, after rank 0 ended the stream.
		if !waitfor.Check(t, "the failures counted", 20*time.Second, func() bool { return maps.Equal(c.e.PD().FailuresByReason(), c.want) }) {
			t.Errorf("%s: failures %v, want %v", c.e.cfg.Role, c.e.PD().FailuresByReason(), c.want)
		}
	}
	if _, err := pp.decode.SetIndexK(ctx, kernels.IndexBF16, time.Minute); err != nil {
		t.Fatalf("the decode's switch: %v", err)
	}
	toks, dfin, pfin := pp.run(t, ctx, q(2), 31002)
	if len(toks) != 4 || dfin.Reason != ReasonLength || pfin.Reason != ReasonLength {
		t.Errorf("after both switches: %v, decode %+v, prefill %+v", toks, dfin, pfin)
	}
	pp.settle(t, 20*time.Second)
}

// pastTheBound waits until e's rank 0 has begun two iterations after
// deadline: the second began its step input, where a draining switch cuts,
// after the deadline.
func pastTheBound(t *testing.T, e *Engine, deadline time.Time) {
	t.Helper()
	var first time.Time
	waitfor.Check(t, "two iterations past the drain bound", 20*time.Second, func() bool {
		start := e.View().Snapshot().Step.Start
		switch {
		case !start.After(deadline):
			return false
		case first.IsZero():
			first = start
			return false
		}
		return start.After(first)
	})
}

// Past its drain bound a prefill's switch cuts, at every step, what holds
// the drain: here B, which was in the handshake at the bound (spared: it
// held nothing) and passed it later, when its decode's word came; its
// prompt takes six steps to prefill, so a step's cut finds it in Active.
// X, in Inflight at the bound, is not cut (an abort would not change a room
// that only waits for its decode's STATUS): it ends by that STATUS, and
// the switch then runs, counting B alone. (A room that passes the
// handshake and prefills in one step is in Inflight at the next cut, and
// holds the drain until its STATUS or inflight timeout, as X does.)
func TestIndexKSwitchCutsPastTheBound(t *testing.T) {
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, MaxBatchTokens: 8, PrefillChunk: 8, IndexK: kernels.IndexFP8,
		PD: PDConfig{BootstrapTimeout: time.Minute, InflightTimeout: time.Minute}}
	pp := newPDPair(t, cfg)
	f := newFakeDecode(t, pp)
	vocab := pp.prefill.m.Config.VocabSize
	qx := Request{Prompt: testmodel.Prompts(79, 1, 8, 8, vocab)[0], MaxTokens: 1}
	qb := Request{Prompt: testmodel.Prompts(83, 1, 48, 48, vocab)[0], MaxTokens: 1}
	x := f.inflight(qx, 32000)
	b := pp.prefillHalf(t, qb, 32001)
	waitfor.Check(t, "B in bootstrap", 20*time.Second, func() bool { return inQueue(pp.prefill, b.s.ID, "bootstrap") })

	const drain = 50 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type outcome struct {
		res IndexKSwitch
		err error
	}
	done := make(chan outcome, 1)
	deadline := time.Now().Add(drain)
	go func() {
		res, err := pp.prefill.SetIndexK(ctx, kernels.IndexBF16, drain)
		done <- outcome{res, err}
	}()
	pastTheBound(t, pp.prefill, deadline)
	if !inQueue(pp.prefill, b.s.ID, "bootstrap") || !inQueue(pp.prefill, x.s.ID, "inflight") {
		t.Fatalf("past the bound: B in bootstrap %v, X in flight %v; want both still held", inQueue(pp.prefill, b.s.ID, "bootstrap"), inQueue(pp.prefill, x.s.ID, "inflight"))
	}
	f.toEach(func(r int) pdproto.Message {
		return &pdproto.TransferInfo{Room: 32001, Endpoint: f.inbox[r].Endpoint(), Rank: uint32(r), Tokens: uint32(len(qb.Prompt)),
			Prompt: pdproto.PromptFingerprint(qb.Prompt), IndexKDType: "fp8", RequestID: "fake"}
	})
	expectEnd(t, "B, past the handshake after the bound", b.s, finishIs(ReasonAbort))
	f.status(32000, pdproto.Success, "")
	expectEnd(t, "X, acknowledged", x.s, finishIs(ReasonLength))
	o := <-done
	if o.err != nil || !o.res.Changed || o.res.Aborted != 1 {
		t.Errorf("the switch: %+v %v, want it done with B alone aborted", o.res, o.err)
	}
	pp.settle(t, 20*time.Second)
}

// A decode's switch past its bound cuts the room that holds the drain (A,
// waiting for KV its prefill never gets) and spares a request still in the
// handshake with all its samples (B, two of them, whose prefill registry
// has not answered yet): once A's abort has run the switch goes, counting
// A alone. B then meets the new precision at its handshake: its prefill,
// still fp8, no longer fits, and both samples end with that failure.
func TestIndexKSwitchSparesSamplesInTheHandshake(t *testing.T) {
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, IndexK: kernels.IndexFP8,
		PD: PDConfig{BootstrapTimeout: time.Minute, TransferTimeout: time.Minute}}
	pp := switchPairCfg(t, cfg, cfg)
	ps := testmodel.Prompts(89, 2, 20, 20, pp.prefill.m.Config.VocabSize)
	// B's registry: the prefill's, answering once released.
	release := make(chan struct{})
	target, err := url.Parse(pp.url)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(slow.Close)
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before slow.Close: it waits for the handler
	allowRegistry(t, pp.decode, slow.URL)

	da := pp.decodeHalf(t, Request{Prompt: ps[0], MaxTokens: 4, IgnoreEOS: true}, 33000)
	waitfor.Check(t, "A waiting for its KV", 20*time.Second, func() bool { return inQueue(pp.decode, da.s.ID, "transfer") })
	dbs, err := pp.decode.SubmitN(context.Background(), Request{Prompt: ps[1], MaxTokens: 4, IgnoreEOS: true, N: 2,
		PD: &PDRequest{Room: 33001, BootstrapURL: slow.URL}})
	if err != nil {
		t.Fatal(err)
	}
	pb := pp.prefillHalf(t, Request{Prompt: ps[1], MaxTokens: 4, IgnoreEOS: true}, 33001)
	waitfor.Check(t, "B resolving its registry", 20*time.Second, func() bool { return inQueue(pp.decode, dbs[0].ID, "prealloc") })

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := pp.decode.SetIndexK(ctx, kernels.IndexBF16, 50*time.Millisecond)
	if err != nil || !res.Changed || res.Aborted != 1 {
		t.Errorf("the decode's switch: %+v %v, want it done with A alone aborted", res, err)
	}
	free()
	expectEnd(t, "A", da.s, finishIs(ReasonAbort))
	precisions := finishHas("index_k_dtype", "index-K", "another rank failed the room")
	for i, s := range dbs {
		expectEnd(t, fmt.Sprintf("B's sample %d", i), s, precisions)
	}
	// The decode failed B before it knew B's prefill rank: the prefill
	// hears nothing until its bootstrap timeout; the client goes first.
	pb.cancel()
	expectEnd(t, "B's prefill", pb.s, finishIs(ReasonAbort))
	pp.settle(t, 20*time.Second)
}
