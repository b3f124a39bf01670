package router

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The router's canaries, on its fake clock: each sends its prompt three
// times through a pair (cached, then loaded back, then with no_cache),
// marked a probe, with the prefill's host tier asked to take it between;
// a cached output that differs from the computed one is a mismatch,
// counted by prefill and kept with both outputs; and nothing of them is
// counted among the router's requests nor in its in-flight gauge.
func TestCanaries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemNet()
		var corrupt atomic.Bool
		var probes, offloads atomic.Int64
		p := newMemStub(t, m, pdproto.RolePrefill, func(s *stub) {
			s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
				if r.URL.Path == "/admin/v1/hicache/offload" {
					offloads.Add(1)
				}
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"id":"prefill","choices":[]}`))
			}
		})
		var rt atomic.Pointer[Router]
		var gauged, loaded atomic.Int64 // canaries the in-flight gauge counted; those the servers' load did
		d := newMemStub(t, m, pdproto.RoleDecode, func(s *stub) {
			s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
				if body["probe"] == true && body["bootstrap_room"] != nil && body["bootstrap_url"] != nil {
					probes.Add(1)
					if rt := rt.Load(); rt != nil {
						for _, u := range rt.decode {
							gauged.Add(int64(testutil.ToFloat64(rt.metrics.inFlight.WithLabelValues(u.role, u.url))))
							loaded.Add(u.inFlight.Load())
						}
					}
				}
				text := "the same tokens"
				if corrupt.Load() && body["no_cache"] != true {
					text = "garbled tokens"
				}
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"id":"cmpl-1","choices":[{"text":"` + text + `","finish_reason":"length"}]}`))
			}
		})
		c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.CanaryInterval = time.Second })
		rt.Store(c.rt)
		time.Sleep(time.Second + time.Millisecond) // the bubble's clock: the first canary is due
		synctest.Wait()
		st := c.rt.canaries.status()
		if st.Results[CanaryMatch] != 1 || probes.Load() != 3 || offloads.Load() != 1 {
			t.Fatalf("after one canary: %+v, %d probes at the decode, %d offloads", st.Results, probes.Load(), offloads.Load())
		}
		// A canary holds a place on its servers (their load counts it)
		// but is no client's request in flight.
		if gauged.Load() != 0 || loaded.Load() != 3 {
			t.Errorf("while the canary ran: the in-flight gauge counted %d, the servers' load %d of its 3 requests; want 0 and 3", gauged.Load(), loaded.Load())
		}
		corrupt.Store(true)
		time.Sleep(time.Second) // the bubble's clock: the next canary
		synctest.Wait()
		st = c.rt.canaries.status()
		if st.Results[CanaryMismatch] != 1 || st.LastMismatch == nil || st.LastMismatch.Cached != "garbled tokens" ||
			st.LastMismatch.Computed != "the same tokens" || st.LastMismatch.Prefill != p.url() {
			t.Fatalf("after a corrupt canary: %+v, last %+v", st.Results, st.LastMismatch)
		}
		text := c.metricsText(t)
		for _, want := range []string{
			`pdkit_router_canaries_total{prefill="` + p.url() + `",result="mismatch"} 1`,
			`pdkit_router_canaries_total{prefill="` + p.url() + `",result="match"} 1`,
			`pdkit_router_requests_total{outcome="ok"} 0`,
		} {
			if !strings.Contains(text, want) {
				t.Errorf("metrics lack %q:\n%s", want, grepLines(text, "canaries\\|requests_total"))
			}
		}
		if cr := c.clusterState(t); cr.Canaries == nil || cr.Canaries.Results[CanaryMismatch] != 1 {
			t.Errorf("cluster view: %+v", cr.Canaries)
		}
	})
}

// A client cannot pass its request off as a canary: the router drops a
// "probe" field before it sends the request on.
func TestClientProbeDropped(t *testing.T) {
	var marked atomic.Int64
	record := func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			if _, ok := body["probe"]; ok {
				marked.Add(1)
			}
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"id":"cmpl-1","choices":[{"text":"ok","finish_reason":"length"}]}`))
		}
	}
	c := start(t, []*stub{newStub(t, pdproto.RolePrefill, record)}, []*stub{newStub(t, pdproto.RoleDecode, record)})
	resp := c.post(t, t.Context(), "/v1/completions", `{"prompt":"x","probe":true}`)
	if body := readAll(t, resp); resp.StatusCode != 200 || marked.Load() != 0 {
		t.Fatalf("%d %s; %d halves marked a probe", resp.StatusCode, body, marked.Load())
	}
}
