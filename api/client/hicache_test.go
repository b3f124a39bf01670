package client

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
)

// The host tier's calls: the debug read, and the admin switches with the
// token, the bandwidth in the query; a 202 (pending) is an answer, a 409 an
// *APIError.
func TestHiCacheCalls(t *testing.T) {
	var got []string
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/v1/hicache", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"prefix_cache":true,"on":true,"ranks":[{"rank":0,"on":true,"host_tokens":512,"host_tokens_used":40,` +
			`"loads":[{"requests":["18446744073709551615"],"pages":3}]}]}`))
	})
	mux.HandleFunc("POST /admin/v1/hicache/{verb}", func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.PathValue("verb")+"?"+r.URL.RawQuery+" "+r.Header.Get("Authorization"))
		switch r.PathValue("verb") {
		case "on":
			w.WriteHeader(http.StatusAccepted)
			w.Write([]byte(`{"changed":true,"pending":true,"prefix_cache":true,"on":false,"ranks":[]}`))
		case "off":
			w.WriteHeader(http.StatusConflict)
			w.Write([]byte(`{"error":{"message":"another hicache switch is pending"}}`))
		default:
			w.Write([]byte(`{"changed":true,"prefix_cache":true,"on":true,"ranks":[{"rank":0,"load_bandwidth_bytes_per_second":2000000000}]}`))
		}
	})
	ts := httptest.NewServer(mux)
	defer ts.Close()
	ctx := context.Background()
	c := New(ts.URL, "s3cret", nil)

	h, err := c.HiCache(ctx)
	if err != nil || !h.On || len(h.Ranks) != 1 || h.Ranks[0].HostTokensUsed != 40 || h.Ranks[0].Loads[0].Requests[0] != debug.ID(1<<64-1) {
		t.Errorf("HiCache: %+v %v", h, err)
	}
	if r, err := c.SetHiCache(ctx, true); err != nil || !r.Pending || !r.Changed || !r.PrefixCache {
		t.Errorf("SetHiCache on: %+v %v", r, err)
	}
	if _, err := c.SetHiCache(ctx, false); StatusOf(err) != http.StatusConflict {
		t.Errorf("SetHiCache off: %v", err)
	}
	if r, err := c.SetHiCacheBandwidth(ctx, 2e9); err != nil || r.Ranks[0].LoadBandwidthBytesPerSecond != 2e9 {
		t.Errorf("SetHiCacheBandwidth: %+v %v", r, err)
	}
	want := []string{"on? Bearer s3cret", "off? Bearer s3cret", "bandwidth?bytes_per_second=2000000000 Bearer s3cret"}
	if len(got) != len(want) {
		t.Fatalf("calls %q", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("call %d: %q, want %q", i, got[i], want[i])
		}
	}
}
