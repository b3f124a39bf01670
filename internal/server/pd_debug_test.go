package server

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// newPDServers serves a prefill and a decode engine of configuration cfg
// on real HTTP servers (their ranks on real ZeroMQ sockets) and the
// prefill's bootstrap registry on a third, all holding cfg.PD.Secret when
// it is set; it returns both and the registry's URL.
func newPDServers(t *testing.T, cfg serve.Config) (prefill, decode *env, registry string) {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	pc, dc := cfg, cfg
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	prefill, decode = newEnvModel(t, m, pc), newEnvModel(t, m, dc)
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: prefill.eng.View().Ranks(), Secret: cfg.PD.Secret})
	for _, info := range prefill.eng.PD().RankInfos() {
		if _, err := reg.Register(info); err != nil {
			t.Fatal(err)
		}
	}
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	if err := decode.eng.AllowPrefillBootstrap(ts.URL); err != nil {
		t.Fatal(err)
	}
	return prefill, decode, ts.URL
}

// pdEmpty reports whether every rank of r has empty PD queues.
func pdEmpty(r debug.PDResponse) bool {
	for _, rk := range r.Ranks {
		if len(rk.Entries) != 0 {
			return false
		}
		for _, n := range rk.Counts {
			if n != 0 {
				return false
			}
		}
	}
	return true
}

func TestDebugPD(t *testing.T) {
	cfg := serve.Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4,
		PD: serve.PDConfig{AbortAckTimeout: 200 * time.Millisecond}}
	pe, de, registry := newPDServers(t, cfg)

	// Not on a colocated server.
	col := newEnv(t)
	if code, b := get(t, col, debug.PDPath); code != 404 || !strings.Contains(string(b), "not a PD server") || !strings.Contains(string(b), `"error"`) {
		t.Errorf("colocated: %d %s", code, b)
	}
	if code, b := get(t, de, debug.PDPath+"?queue=nope"); code != 400 || !strings.Contains(string(b), `"param":"queue"`) {
		t.Errorf("unknown queue: %d %s", code, b)
	}

	// One request through both sides, as a router sends it.
	body := map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": true,
		"bootstrap_room": 31, "bootstrap_url": registry}
	perr := make(chan error, 1)
	go func() {
		pbody := maps(body)
		delete(pbody, "bootstrap_url")
		_, err := pe.completeErr("/v1/completions", pbody)
		perr <- err
	}()
	if r, err := de.completeErr("/v1/completions", body); err != nil || r.Finish != "length" {
		t.Fatalf("decode: %+v %v", r, err)
	}
	if err := <-perr; err != nil {
		t.Fatalf("prefill: %v", err)
	}
	for _, e := range []*env{pe, de} {
		var r debug.PDResponse
		waitfor.For(t, "empty pd queues", 20*time.Second, func() bool {
			r = debug.PDResponse{}
			getJSON(t, e, debug.PDPath, &r)
			return pdEmpty(r)
		})
		if r.Role != e.eng.Config().Role || len(r.Ranks) != 2 || r.TransferBytes == 0 || r.FailedRequests != 0 {
			t.Errorf("%s: %+v", e.eng.Config().Role, r)
		}
		for i, rk := range r.Ranks {
			s := rk.Socket
			if rk.Rank != i || !s.Alive || s.ExitReason != "" || s.Endpoint == "" || s.Messages == 0 || s.Bytes == 0 ||
				s.LastMessage == nil || s.Outbox.Sent == 0 || s.HandlerErrors+s.HandlerPanics+s.Late+s.Misplaced != 0 {
				t.Errorf("%s rank %d socket: %+v", r.Role, i, s)
			}
		}
	}

	// A decode request whose prefill never gets its half waits in the
	// decode's prealloc or transfer queue.
	const room = 4242
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, _ := json.Marshal(map[string]any{"prompt": "a lonely decode", "max_tokens": 4, "bootstrap_room": room, "bootstrap_url": registry})
	req, _ := http.NewRequestWithContext(ctx, "POST", de.ts.URL+"/v1/completions", bytes.NewReader(b))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := de.ts.Client().Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	var r debug.PDResponse
	waitfor.For(t, "the decode request in its transfer queue", 20*time.Second, func() bool {
		r = debug.PDResponse{}
		getJSON(t, de, debug.PDPath+"?queue="+debug.PDQueueTransfer, &r)
		return len(r.Ranks) == 2 && len(r.Ranks[0].Entries) == 1 && len(r.Ranks[1].Entries) == 1
	})
	for _, rk := range r.Ranks {
		e := rk.Entries[0]
		if e.Room != room || e.Queue != debug.PDQueueTransfer || e.Tokens == 0 || e.Peer == "" || e.AbortSent || e.InQueueMS < 0 ||
			rk.Counts[debug.PDQueueTransfer] != 1 {
			t.Errorf("rank %d: %+v, counts %v", rk.Rank, e, rk.Counts)
		}
	}
	if r.Queue != debug.PDQueueTransfer {
		t.Errorf("queue filter echoed as %q", r.Queue)
	}
	// Rooms and request ids travel as strings, so that no JSON reader
	// rounds them.
	if _, raw := get(t, de, debug.PDPath+"?queue="+debug.PDQueueTransfer); !bytes.Contains(raw, []byte(`"room":"4242"`)) ||
		!bytes.Contains(raw, []byte(`"id":"`)) {
		t.Errorf("room or id not a string: %s", raw)
	}
	// The filter keeps the other queues out, not their counts.
	r = debug.PDResponse{}
	getJSON(t, de, debug.PDPath+"?queue="+debug.PDQueuePrealloc, &r)
	for _, rk := range r.Ranks {
		for _, e := range rk.Entries {
			if e.Queue != debug.PDQueuePrealloc {
				t.Errorf("prealloc filter listed %+v", e)
			}
		}
		if rk.Counts[debug.PDQueueTransfer] != 1 {
			t.Errorf("rank %d counts under the prealloc filter: %v", rk.Rank, rk.Counts)
		}
	}
	// The client goes: the decode aborts, holds the pages until the
	// ack deadline, and its queues drain.
	cancel()
	<-done
	waitfor.For(t, "the aborted decode request gone", 20*time.Second, func() bool {
		r = debug.PDResponse{} // a fresh one: decoding merges into maps
		getJSON(t, de, debug.PDPath, &r)
		return pdEmpty(r)
	})
	waitPoolsFree(t, de.eng)
}

// TestDebugPDFailures: a prefill request whose decode never comes fails by
// its bootstrap timeout; GET /debug/v1/pd counts it, by reason (timeout)
// and by queue (bootstrap), as pdctl diagnose reads it.
func TestDebugPDFailures(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	pe := newEnvModel(t, m, serve.Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, Role: pdproto.RolePrefill,
		PD: serve.PDConfig{BootstrapTimeout: 300 * time.Millisecond}})
	var r debug.PDResponse
	getJSON(t, pe, debug.PDPath, &r)
	if r.FailedRequests != 0 || r.FailuresByReason == nil || len(r.FailuresByReason) != 0 || r.FailuresByQueue == nil {
		t.Fatalf("before any failure: %+v", r)
	}
	if _, err := pe.completeErr("/v1/completions", map[string]any{"prompt": "nobody decodes this", "max_tokens": 4,
		"bootstrap_room": uint64(1<<63 + 1)}); err == nil {
		t.Fatal("a prefill request without a decode succeeded")
	}
	waitfor.For(t, "the failure counted", 20*time.Second, func() bool {
		r = debug.PDResponse{}
		getJSON(t, pe, debug.PDPath, &r)
		return r.FailedRequests == 1
	})
	if r.FailuresByReason[debug.PDFailTimeout] != 1 || len(r.FailuresByReason) != 1 ||
		r.FailuresByQueue[debug.PDQueueBootstrap] != 1 || len(r.FailuresByQueue) != 1 {
		t.Errorf("failures by reason %v, by queue %v; want one timeout in bootstrap", r.FailuresByReason, r.FailuresByQueue)
	}
}
