package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestRedTeamSquattedRegistryDiagnosed: a registration that points a
// prefill rank elsewhere (here an endpoint nothing listens on, registered
// as a cluster member holding the secret could: a newer start, a new
// instance) fails every routed request while each process is alive and
// its /health green. The monitoring must see it: the router's /readyz
// answers 503, and diagnose names both the failing requests and the
// registry that no longer lists the rank where it listens.
func TestRedTeamSquattedRegistryDiagnosed(t *testing.T) {
	saved := testConfig
	testConfig.PD.BootstrapTimeout = 1500 * time.Millisecond
	c := newCluster(t)
	testConfig = saved

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "tcp://" + l.Addr().String()
	l.Close()
	squat := c.prefill.eng.PD().RankInfos()[0]
	squat.Endpoint, squat.InstanceID, squat.StartedAt = dead, "squatter", time.Now()
	if resp, berr := c.bootstrap.Register(squat); berr != nil || !resp.Replaced {
		t.Fatalf("the squatting registration: %+v, %v", resp, berr)
	}

	// The decode has looked nothing up yet: its first lookup finds the
	// squatted rank. The readiness window judges from 10 requests on.
	const n = 10
	var wg sync.WaitGroup
	var mu sync.Mutex
	var served int
	hc := &http.Client{Timeout: 30 * time.Second}
	for i := range n {
		wg.Go(func() {
			body, _ := json.Marshal(map[string]any{"prompt": "squatted " + itoa(i), "max_tokens": 4, "temperature": 0})
			resp, err := hc.Post(c.router+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				return
			}
			defer resp.Body.Close()
			var out struct {
				Choices []struct{ Text string } `json:"choices"`
			}
			if resp.StatusCode == http.StatusOK && json.NewDecoder(resp.Body).Decode(&out) == nil && len(out.Choices) > 0 {
				mu.Lock()
				served++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if served != 0 {
		t.Fatalf("%d of %d requests were served with the rank squatted", served, n)
	}
	waitfor.For(t, "the router not ready", 10*time.Second, func() bool {
		resp, err := http.Get(c.router + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusServiceUnavailable
	})
	for _, url := range []string{c.prefill.ts.URL, c.decode.ts.URL, c.router} {
		resp, err := http.Get(url + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("%s /health: %d; the processes are alive, only the registry lies", url, resp.StatusCode)
		}
	}

	// Requests go on failing while diagnose samples, as they would in
	// production: its rules judge what changed within the window.
	ctx, stop := context.WithCancel(t.Context())
	var more sync.WaitGroup
	for i := range 2 {
		more.Go(func() {
			for j := 0; ctx.Err() == nil; j++ {
				body, _ := json.Marshal(map[string]any{"prompt": fmt.Sprintf("squatted again %d %d", i, j), "max_tokens": 4, "temperature": 0})
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.router+"/v1/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				if resp, err := hc.Do(req); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}
	code, findings, keys := diagnoseJSON(t, c, "--window", "4s", "--interval", "500ms")
	stop()
	more.Wait()
	if code != exitFindings || !slices.Contains(keys, "registry-mismatch PREFILL 0") || !slices.Contains(keys, "requests-failing ROUTER null") ||
		slices.Contains(keys, "registry-mismatch PREFILL 1") {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
	for _, f := range findings {
		if f.Rule != "registry-mismatch" {
			continue
		}
		want := []diag.Evidence{{Key: "registered", Value: dead}, {Key: "listening", Value: "PREFILL-RANK0"}}
		if f.Severity != diag.Critical || !slices.Equal(f.Evidence, want) {
			t.Errorf("registry-mismatch: severity %v, evidence %+v, want critical and %+v", f.Severity, f.Evidence, want)
		}
	}
}
