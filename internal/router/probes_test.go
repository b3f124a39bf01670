package router

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// probe GETs path and decodes its body into v.
func (c *cluster) probe(t *testing.T, path string, v any) int {
	t.Helper()
	resp := c.get(t, path)
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return resp.StatusCode
}

// When every request fails upstream while the health checks pass, /readyz
// goes 503 with the reason and /livez stays 200 (restarting the router
// would mend nothing); /health is unchanged. Once requests succeed again,
// /readyz recovers.
//
// It runs in a synctest bubble over an in-memory network: the requests
// fall within the readiness window of the bubble's clock, however long
// the machine takes to send them.
func TestReadinessFollowsFailures(t *testing.T) {
	synctest.Test(t, testReadinessFollowsFailures)
}

func testReadinessFollowsFailures(t *testing.T) {
	var failing atomic.Bool
	failing.Store(true)
	m := newMemNet()
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d := newMemStub(t, m, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			if failing.Load() {
				http.Error(w, `{"error":{"message":"decode broke","type":"server_error"}}`, http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"id":"cmpl-1","choices":[{"text":"ok"}]}`))
		}
	})
	c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.ReadyMinRequests = 4 })
	var ready ReadyResponse
	if code := c.probe(t, "/readyz", &ready); code != 200 || ready.Status != "ok" {
		t.Fatalf("readyz before any request: %d %+v", code, ready)
	}
	for range 6 {
		resp := c.post(t, t.Context(), "/v1/completions", `{"prompt":"x"}`)
		if body := readAll(t, resp); resp.StatusCode < 500 {
			t.Fatalf("a request to the failing decode: %d %s", resp.StatusCode, body)
		}
	}
	if code := c.probe(t, "/readyz", &ready); code != 503 || ready.Status != "not_ready" ||
		!strings.Contains(ready.Reason, "6 of the last 6 requests") || ready.RecentFailed != 6 {
		t.Fatalf("readyz with every request failing: %d %+v", code, ready)
	}
	var live LiveResponse
	if code := c.probe(t, "/livez", &live); code != 200 || live.Status != "ok" {
		t.Fatalf("livez with every request failing: %d %+v", code, live)
	}
	var health HealthResponse
	if code := c.probe(t, "/health", &health); code != 200 {
		t.Fatalf("health with every request failing: %d %+v", code, health)
	}

	failing.Store(false)
	waitfor.NoError(t, "readyz recovering, a request to the mended decode a try", 5*time.Second, func() error {
		resp := c.post(t, t.Context(), "/v1/completions", `{"prompt":"x"}`)
		if body := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("a request to the mended decode: %d %s", resp.StatusCode, body)
		}
		if code := c.probe(t, "/readyz", &ready); code != 200 {
			return fmt.Errorf("%d %+v", code, ready)
		}
		return nil
	})
	if ready.RecentFailed != 6 || ready.RecentRequests != 12 {
		t.Errorf("recovered at %d failed of %d, want 6 of 12 (not above half)", ready.RecentFailed, ready.RecentRequests)
	}
}

// Readiness needs a healthy server of each role; liveness does not. In a
// synctest bubble over an in-memory network, the health checks that mark
// the decode down tick on the bubble's clock.
func TestReadinessNeedsServers(t *testing.T) {
	synctest.Test(t, testReadinessNeedsServers)
}

func testReadinessNeedsServers(t *testing.T) {
	m := newMemNet()
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d := newMemStub(t, m, pdproto.RoleDecode, nil)
	c := startMem(t, m, []*stub{p}, []*stub{d})
	d.healthy.Store(false)
	c.waitFor(t, "decode down", func(cr debug.ClusterResponse) bool { return cr.HealthyDecode == 0 })
	var ready ReadyResponse
	if code := c.probe(t, "/readyz", &ready); code != 503 || ready.Reason != "no healthy decode server" {
		t.Fatalf("readyz without a decode server: %d %+v", code, ready)
	}
	var live LiveResponse
	if code := c.probe(t, "/livez", &live); code != 200 {
		t.Fatalf("livez without a decode server: %d %+v", code, live)
	}
	c.rt.Close()
	if code := c.probe(t, "/livez", &live); code != 503 || !strings.Contains(live.Reason, "stopped") {
		t.Fatalf("livez of a closed router: %d %+v", code, live)
	}
}

// Aborted answers (finish_reason "abort": a client's, an operator's, a
// drain's) are no failures: however many of them come, /readyz stays 200
// and they are counted as aborted, not as upstream errors.
func TestAbortsLeaveReadinessAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemNet()
		p := newMemStub(t, m, pdproto.RolePrefill, nil)
		d := newMemStub(t, m, pdproto.RoleDecode, func(s *stub) {
			s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
				if body["stream"] == true {
					w.Header().Set("Content-Type", "text/event-stream")
					openai.WriteEvent(w, map[string]any{"id": "cmpl-1", "choices": []any{map[string]any{"text": "", "finish_reason": "abort"}}})
					openai.WriteDone(w)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"id":"cmpl-1","choices":[{"text":"","finish_reason":"abort"}]}`))
			}
		})
		c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.ReadyMinRequests = 4 })
		for i := range 16 {
			body := `{"prompt":"x"}`
			if i%2 == 0 {
				body = `{"prompt":"x","stream":true}`
			}
			resp := c.post(t, t.Context(), "/v1/completions", body)
			if b := readAll(t, resp); resp.StatusCode != 200 {
				t.Fatalf("an aborted request: %d %s", resp.StatusCode, b)
			}
		}
		var ready ReadyResponse
		if code := c.probe(t, "/readyz", &ready); code != 200 || ready.RecentFailed != 0 {
			t.Fatalf("readyz after 16 aborted requests: %d %+v", code, ready)
		}
		c.settle(t, 0)
		if mt := c.metricsText(t); !strings.Contains(mt, `pdkit_router_requests_total{outcome="aborted"} 16`) ||
			strings.Contains(mt, `outcome="upstream_error"} 1`) {
			t.Errorf("outcomes:\n%s", mt)
		}
	})
}
