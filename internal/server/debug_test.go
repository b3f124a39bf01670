package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// newEnvWith is newEnv with the engine's configuration and the server's
// options given.
func newEnvWith(t *testing.T, cfg serve.Config, opts Options) *env {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	eng, err := serve.New(m, withCPU(cfg))
	if err != nil {
		t.Fatal(err)
	}
	if opts.ModelName == "" {
		opts.ModelName = "tiny"
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	srv := New(eng, m, opts)
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return &env{m: m, eng: eng, srv: srv, ts: ts}
}

// withCPU gives cfg's ranks one-thread cpu kernels unless it names a
// backend.
func withCPU(cfg serve.Config) serve.Config {
	if cfg.Backend == nil {
		cfg.Backend = func(int) kernels.Backend { return cpu.New(1) }
	}
	return cfg
}

// getJSON GETs path, wants 200 and decodes the body into v.
func getJSON(t *testing.T, e *env, path string, v any) {
	t.Helper()
	code, b := get(t, e, path)
	if code != 200 {
		t.Fatalf("GET %s: %d %s", path, code, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("GET %s: %v: %s", path, err, b)
	}
}

// openStream starts a streamed completion and reads its first chunk; it
// returns the response id and the reader positioned after that chunk.
func openStream(t *testing.T, e *env, body map[string]any) (string, *bufio.Reader, io.Closer) {
	t.Helper()
	body["stream"] = true
	b, _ := json.Marshal(body)
	resp, err := e.ts.Client().Post(e.ts.URL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var c openai.CompletionChunk
	if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &c); err != nil {
		t.Fatalf("%v: %q", err, line)
	}
	return c.ID, rd, resp.Body
}

func TestDebugStepsTP2(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 8}, Options{})
	e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 5, "ignore_eos": true})
	waitIdle(t, e.eng)
	var last debug.StepsResponse
	waitfor.For(t, "ranks agreeing", 20*time.Second, func() bool {
		getJSON(t, e, "/debug/v1/steps", &last)
		return last.Agree
	})
	if len(last.Ranks) != 2 || last.Spread != 0 {
		t.Fatalf("steps: %+v", last)
	}
	for i, r := range last.Ranks {
		if r.Rank != i || r.Step == 0 || r.Step != last.Ranks[0].Step || len(r.Digest) != 16 || r.ControlSeq == 0 || r.ForwardSeq == 0 ||
			r.End.Before(r.Start) || r.DurationMS < 0 || r.Phase == "" {
			t.Errorf("rank %d: %+v", i, r)
		}
	}
	// The field names are the documented snake_case ones.
	_, b := get(t, e, "/debug/v1/steps")
	for _, f := range []string{`"agree"`, `"spread"`, `"batch_size"`, `"batch_tokens"`, `"control_seq"`, `"forward_seq"`, `"duration_ms"`} {
		if !bytes.Contains(b, []byte(f)) {
			t.Errorf("steps lacks %s: %s", f, b)
		}
	}
}

func TestDebugCollectivesIdle(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 8}, Options{})
	e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 5, "ignore_eos": true})
	waitIdle(t, e.eng)
	// Idle, rank 0 waits for work outside any collective, while the other
	// ranks wait for its next step input in a control broadcast (a
	// heartbeat at most); no rank is in a forward collective.
	var c debug.CollectivesResponse
	waitfor.For(t, "rank 0 out of collectives", 20*time.Second, func() bool {
		getJSON(t, e, "/debug/v1/collectives", &c)
		return len(c.Comms) == 2 && c.Comms[0].Rank(0).Waiting == nil && c.Comms[1].Rank(0).Waiting == nil
	})
	if c.Comms[0].Name != debug.CommControl || c.Comms[1].Name != debug.CommForward || c.StallThresholdMS != 5000 {
		t.Fatalf("collectives: %+v", c)
	}
	ctrl, fwd := c.Comm(debug.CommControl), c.Comm(debug.CommForward)
	if w := ctrl.Rank(1).Waiting; w != nil && (w.Op != "Broadcast" || w.Seq != ctrl.Rank(1).LastEntered || !w.Waiting || w.End != nil) {
		t.Errorf("rank 1 waits in control %+v", w)
	}
	if w := fwd.Rank(1).Waiting; w != nil {
		t.Errorf("idle rank 1 waits in forward %+v", w)
	}
	for _, cm := range c.Comms {
		if cm.Size != 2 || cm.Closed || cm.Broken || cm.BrokenReason != "" || len(cm.Stalls) != 0 || len(cm.Ranks) != 2 {
			t.Fatalf("%s: %+v", cm.Name, cm)
		}
		for i, r := range cm.Ranks {
			if r.Rank != i || len(r.Records) == 0 || r.LastEntered == 0 || r.LastCompleted == 0 || r.WaitMS < 0 {
				t.Errorf("%s rank %d: %+v", cm.Name, i, r)
				continue
			}
			for j, rec := range r.Records {
				if j > 0 && rec.Seq <= r.Records[j-1].Seq {
					t.Errorf("%s rank %d: seq %d after %d", cm.Name, i, rec.Seq, r.Records[j-1].Seq)
				}
				if rec.Op == "" || rec.Elem == "" || rec.Start.IsZero() {
					t.Errorf("%s rank %d record %d: %+v", cm.Name, i, j, rec)
				}
			}
		}
	}
	getJSON(t, e, "/debug/v1/collectives?stall=250ms", &c)
	if c.StallThresholdMS != 250 {
		t.Errorf("stall threshold %v, want 250", c.StallThresholdMS)
	}
	if code, b := get(t, e, "/debug/v1/collectives?stall=soon"); code != 400 || !bytes.Contains(b, []byte(`"param":"stall"`)) {
		t.Errorf("bad stall: %d %s", code, b)
	}
}

// TestDebugCollectivesPerComm: at TP 2 the steps and the collectives
// report each communicator's own sequence: idle iterations advance the
// control seq (the loop still agrees on its step input) and leave the
// forward seq where the last forward pass left it.
func TestDebugCollectivesPerComm(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 8, Heartbeat: 5 * time.Millisecond}, Options{})
	e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 5, "ignore_eos": true})
	waitIdle(t, e.eng)

	// agreed reads the steps until both ranks finished the same idle
	// iteration.
	agreed := func(what string, cond func(debug.Step) bool) debug.Step {
		t.Helper()
		var s debug.StepsResponse
		waitfor.For(t, what, 20*time.Second, func() bool {
			getJSON(t, e, "/debug/v1/steps", &s)
			return s.Agree && len(s.Ranks) == 2 && s.Ranks[0].Phase == "idle" && cond(s.Ranks[0])
		})
		return s.Ranks[0]
	}
	first := agreed("the ranks agreeing idle", func(debug.Step) bool { return true })
	if first.ControlSeq == 0 || first.ForwardSeq == 0 {
		t.Fatalf("after a request: %+v", first)
	}
	later := agreed("three more idle iterations", func(s debug.Step) bool { return s.Step >= first.Step+3 })
	if later.ControlSeq <= first.ControlSeq || later.ForwardSeq != first.ForwardSeq {
		t.Errorf("idle iterations %d to %d: control seq %d to %d, forward seq %d to %d; want control to advance and forward to stay",
			first.Step, later.Step, first.ControlSeq, later.ControlSeq, first.ForwardSeq, later.ForwardSeq)
	}
	if later.Seq(debug.CommControl) != later.ControlSeq || later.Seq(debug.CommForward) != later.ForwardSeq || later.Seq("other") != 0 {
		t.Errorf("Step.Seq: %+v", later)
	}

	// The collectives answer agrees: the forward communicator's last call
	// is the step's forward seq, the control one has run past the control
	// seq of the step read before.
	var c debug.CollectivesResponse
	getJSON(t, e, "/debug/v1/collectives", &c)
	ctrl, fwd := c.Comm(debug.CommControl), c.Comm(debug.CommForward)
	if ctrl == nil || fwd == nil || c.Comm("other") != nil {
		t.Fatalf("communicators: %+v", c)
	}
	for r := range 2 {
		cr, fr := ctrl.Rank(r), fwd.Rank(r)
		if cr == nil || fr == nil {
			t.Fatalf("rank %d missing: %+v", r, c)
		}
		if fr.LastEntered != later.ForwardSeq || fr.LastCompleted != later.ForwardSeq || fr.Waiting != nil {
			t.Errorf("forward rank %d: last entered %d, completed %d, waiting %+v; want %d, none", r, fr.LastEntered, fr.LastCompleted, fr.Waiting, later.ForwardSeq)
		}
		if cr.LastCompleted < later.ControlSeq {
			t.Errorf("control rank %d: last completed %d before the step's %d", r, cr.LastCompleted, later.ControlSeq)
		}
		if n := len(fr.Records); n == 0 || fr.Records[n-1].Seq != later.ForwardSeq {
			t.Errorf("forward rank %d: flight recorder ends %+v, want seq %d", r, fr.Records, later.ForwardSeq)
		}
	}
	if ctrl.Rank(2) != nil {
		t.Error("a third rank")
	}
}

// blocker is an Observer that, once armed, blocks rank 0's loop in
// StepFinished until released: a loop stuck in the middle of its work.
type blocker struct {
	mu      sync.Mutex
	armed   bool
	stuck   chan struct{} // closed when the loop blocks
	release chan struct{}
}

func (b *blocker) TokenEmitted(uint64, int, time.Duration) {}
func (b *blocker) RequestFinished(uint64, serve.Finish)    {}
func (b *blocker) StepFinished(serve.StepRecord) {
	b.mu.Lock()
	armed := b.armed
	b.armed = false
	b.mu.Unlock()
	if armed {
		close(b.stuck)
		<-b.release
	}
}

// The debug endpoints answer while rank 0's loop is stuck and rank 1 waits
// for it in a collective, and they show the stall.
func TestDebugWhileLoopStuck(t *testing.T) {
	b := &blocker{armed: true, stuck: make(chan struct{}), release: make(chan struct{})}
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 8, Observer: b}, Options{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(b.release) }) }
	t.Cleanup(unblock) // runs before the engine is closed

	done := make(chan streamResult, 1)
	go func() { done <- e.stream(t, map[string]any{"prompt": prompt, "max_tokens": 20, "ignore_eos": true}) }()
	select {
	case <-b.stuck:
	case <-time.After(20 * time.Second):
		t.Fatal("the loop never reached the observer")
	}
	e.ts.Client().Timeout = 5 * time.Second

	// Rank 0 finished its step; rank 1 went on to the next one and waits
	// for rank 0 in its first control call, the step input's broadcast.
	var c debug.CollectivesResponse
	var ctrl *debug.Communicator
	waitfor.For(t, "rank 1 stalled in a control collective", 20*time.Second, func() bool {
		getJSON(t, e, "/debug/v1/collectives?stall=1ms", &c)
		ctrl = c.Comm(debug.CommControl)
		return ctrl != nil && ctrl.Rank(1).Waiting != nil && len(ctrl.Stalls) > 0
	})
	st := ctrl.Stalls[0]
	if st.Comm != debug.CommControl || len(st.Arrived) != 1 || st.Arrived[0] != 1 || len(st.Missing) != 1 || st.Missing[0].Rank != 0 || st.Missing[0].InCollective {
		t.Errorf("stall: %+v", st)
	}
	if w := ctrl.Rank(1).Waiting; !w.Waiting || w.End != nil || w.Outcome != "" || w.Seq != st.Seq {
		t.Errorf("rank 1 waits in %+v", w)
	}
	if fwd := c.Comm(debug.CommForward); fwd == nil || len(fwd.Stalls) != 0 || fwd.Rank(0).Waiting != nil || fwd.Rank(1).Waiting != nil {
		t.Errorf("forward while rank 1 waits in control: %+v", fwd)
	}
	var s debug.StepsResponse
	getJSON(t, e, "/debug/v1/steps", &s)
	if len(s.Ranks) != 2 || s.Spread > 1 {
		t.Errorf("steps while stuck: %+v", s)
	}
	var q debug.RequestsResponse
	getJSON(t, e, "/debug/v1/requests", &q)
	if len(q.Requests) != 1 || len(q.KV) != 2 || q.KV[0].Used == 0 {
		t.Errorf("requests while stuck: %+v", q)
	}
	if code, b := get(t, e, "/debug/v1/state"); code != 200 {
		t.Errorf("state while stuck: %d %s", code, b)
	}
	if code, b := get(t, e, "/health"); code != 200 {
		t.Errorf("health while stuck: %d %s", code, b)
	}

	unblock()
	select {
	case r := <-done:
		if r.finish != "length" {
			t.Errorf("after the stall: %+v", r)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the request did not finish after the loop was released")
	}
	waitIdle(t, e.eng)
}
