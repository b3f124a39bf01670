package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/metrics"
	"github.com/pdkit/pdkit/internal/waitfor"
)

func getProbe(t *testing.T, e *env, path string) (int, ProbeResponse) {
	t.Helper()
	resp, err := http.Get(e.ts.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var p ProbeResponse
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return resp.StatusCode, p
}

// When every request fails (here: each outlives a 1ms request timeout)
// while the engine is healthy, /readyz goes 503 with the reason, /livez
// and /health stay 200; once the failures age out of the window, /readyz
// recovers.
func TestReadinessFollowsFailedRequests(t *testing.T) {
	met := metrics.New(nil)
	const window = 1500 * time.Millisecond
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 8, RequestTimeout: time.Millisecond, Observer: met},
		Options{Metrics: met, Probes: Probes{ReadyMinRequests: 3, ReadyWindow: window}})
	if code, p := getProbe(t, e, "/readyz"); code != 200 || p.Status != "ok" {
		t.Fatalf("readyz before any request: %d %+v", code, p)
	}
	start := time.Now()
	for range 4 {
		e.post(t, "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 200, "ignore_eos": true})
	}
	code, p := getProbe(t, e, "/readyz")
	if took := time.Since(start); took >= window {
		t.Skipf("the requests took %v, past the %v window: nothing left to judge", took, window)
	}
	if code != 503 || p.Status != "not_ready" || !strings.Contains(p.Reason, "4 of the last 4 requests") {
		t.Fatalf("readyz with every request failing: %d %+v", code, p)
	}
	if code, p := getProbe(t, e, "/livez"); code != 200 || p.Status != "ok" {
		t.Fatalf("livez with every request failing: %d %+v", code, p)
	}
	if code, _, _ := getStatus(t, e, "/health"); code != 200 {
		t.Fatalf("health with every request failing: %d", code)
	}
	waitfor.For(t, "readyz recovering once the failures aged out", 10*time.Second, func() bool {
		code, _ := getProbe(t, e, "/readyz")
		return code == 200
	})
}

// /livez fails when the engine has stopped for good; /readyz with it.
func TestLivenessOfAClosedEngine(t *testing.T) {
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 8}, Options{Probes: Probes{LiveAfter: 200 * time.Millisecond}})
	if code, p := getProbe(t, e, "/livez"); code != 200 {
		t.Fatalf("livez of a running engine: %d %+v", code, p)
	}
	e.eng.Close()
	waitfor.NoError(t, "livez failing after the engine closed", 10*time.Second, func() error {
		if code, p := getProbe(t, e, "/livez"); code != 503 || p.Status != "not_live" || p.Reason == "" {
			return fmt.Errorf("%d %+v", code, p)
		}
		return nil
	})
	if code, p := getProbe(t, e, "/readyz"); code != 503 {
		t.Fatalf("readyz after the engine closed: %d %+v", code, p)
	}
}

func getStatus(t *testing.T, e *env, path string) (int, string, error) {
	t.Helper()
	resp, err := http.Get(e.ts.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Status, nil
}
