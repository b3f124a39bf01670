package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// healthOf asks h for GET /health.
func healthOf(t *testing.T, h http.Handler) (int, HealthResponse) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/health", nil))
	var r HealthResponse
	if err := json.Unmarshal(rec.Body.Bytes(), &r); err != nil {
		t.Fatalf("health body %q: %v", rec.Body, err)
	}
	return rec.Code, r
}

// TestHealthBusyIsNotDead: a server whose requests wait reports them
// queued and stays 200; past --max-queue-age it says "busy" (still 200, so
// routers keep it but send it nothing new), and once the queue moves it is
// "ok" again.
func TestHealthBusyIsNotDead(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	e := newEnvModel(t, m, serve.Config{PageSize: 4, MaxRunning: 1})
	busy := New(e.eng, m, Options{ModelName: "tiny", MaxQueueAge: time.Nanosecond})

	// One long stream runs; a second request waits behind it.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	b, _ := json.Marshal(map[string]any{"prompt": "once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", e.ts.URL+"/v1/completions", bytes.NewReader(b))
	resp, err := e.ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	second := make(chan int, 1)
	go func() {
		code, _ := e.post(t, "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2})
		second <- code
	}()
	// Both servers read the same engine; each answer is checked only when
	// both saw the request waiting, since the engine may take it any moment.
	var h, hb HealthResponse
	var code, codeb int
	waitfor.NoError(t, "the waiting request queued on both", 20*time.Second, func() error {
		code, h = healthOf(t, e.srv)
		codeb, hb = healthOf(t, busy)
		// The long stream's first line may come before its first step
		// is published: wait for it running too.
		if h.Queued < 1 || hb.Queued < 1 || h.Running < 1 {
			return fmt.Errorf("%d %+v; %d %+v", code, h, codeb, hb)
		}
		return nil
	})
	if code != 200 || h.Status != HealthOK || h.Running != 1 || h.Queued != h.Waiting+h.Pending {
		t.Errorf("plain server while a request waits: %d %+v", code, h)
	}
	if codeb != 200 || hb.Status != HealthBusy || !strings.Contains(hb.Reason, "waited") || hb.Queued < 1 {
		t.Errorf("server past its max queue age: %d %+v", codeb, hb)
	}

	cancel() // the long stream goes; the waiting one runs
	if c := <-second; c != 200 {
		t.Fatalf("the queued request: status %d", c)
	}
	waitIdle(t, e.eng)
	if code, h = healthOf(t, busy); code != 200 || h.Status != HealthOK || h.Queued != 0 {
		t.Errorf("after the queue moved: %d %+v", code, h)
	}
}

// TestGenerateRequestPD: /generate reads the PD fields a router adds, the
// room as a JSON number or a string of digits.
func TestGenerateRequestPD(t *testing.T) {
	for body, want := range map[string]uint64{
		`{"text":"x","bootstrap_room":18446744073709551615,"bootstrap_url":"http://b:1"}`: 1<<64 - 1,
		`{"text":"x","bootstrap_room":"42","bootstrap_url":"http://b:1"}`:                 42,
	} {
		var g GenerateRequest
		if err := json.Unmarshal([]byte(body), &g); err != nil {
			t.Fatal(err)
		}
		pd, oerr := g.pd()
		if oerr != nil || pd == nil || pd.Room != want || pd.BootstrapURL != "http://b:1" {
			t.Errorf("%s: %+v %v", body, pd, oerr)
		}
	}
	for _, body := range []string{`{"text":"x"}`, `{"text":"x","bootstrap_room":null}`} {
		var g GenerateRequest
		json.Unmarshal([]byte(body), &g)
		if pd, oerr := g.pd(); pd != nil || oerr != nil {
			t.Errorf("%s: %+v %v", body, pd, oerr)
		}
	}
	for _, body := range []string{`{"text":"x","bootstrap_room":-1}`, `{"text":"x","bootstrap_room":"r"}`, `{"text":"x","bootstrap_room":1.5}`} {
		var g GenerateRequest
		json.Unmarshal([]byte(body), &g)
		if _, oerr := g.pd(); oerr == nil || oerr.Param != "bootstrap_room" {
			t.Errorf("%s: accepted (%v)", body, oerr)
		}
	}
}
