package client

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// The index-K switch: the precision in the path, the drain in the query,
// the token; a 202 (pending) is an answer, a 409 an *APIError. The call
// waits past the client's own timeout, up to the drain and the server's
// margin.
func TestSetIndexK(t *testing.T) {
	var got []string
	mux := http.NewServeMux()
	mux.HandleFunc("POST /admin/v1/indexk/{dtype}", func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.PathValue("dtype")+"?"+r.URL.RawQuery+" "+r.Header.Get("Authorization"))
		switch r.PathValue("dtype") {
		case debug.IndexKBF16:
			// A drain that outlasts the client's own timeout (50ms).
			select {
			case <-time.After(200 * time.Millisecond):
			case <-r.Context().Done():
				return
			}
			w.Write([]byte(`{"from":"fp8","to":"bf16","changed":true,"paused_ms":1250.5,"aborted":2,"pending":false}`))
		case debug.IndexKFP8:
			w.WriteHeader(http.StatusAccepted)
			w.Write([]byte(`{"from":"bf16","to":"fp8","changed":true,"paused_ms":40000,"pending":true}`))
		default:
			w.WriteHeader(http.StatusConflict)
			w.Write([]byte(`{"error":{"message":"an index-K switch to bf16 is under way"}}`))
		}
	})
	ts := httptest.NewServer(mux)
	defer ts.Close()
	ctx := context.Background()
	c := New(ts.URL, "s3cret", nil)
	c.Timeout = 50 * time.Millisecond

	r, err := c.SetIndexK(ctx, debug.IndexKBF16, 2*time.Second)
	if err != nil || r != (debug.IndexKSwitchResponse{From: "fp8", To: "bf16", Changed: true, PausedMS: 1250.5, Aborted: 2}) {
		t.Errorf("SetIndexK bf16: %+v %v", r, err)
	}
	if r, err := c.SetIndexK(ctx, debug.IndexKFP8, 0); err != nil || !r.Pending || r.To != "fp8" {
		t.Errorf("SetIndexK fp8: %+v %v", r, err)
	}
	if _, err := c.SetIndexK(ctx, "int4", 90*time.Second); StatusOf(err) != http.StatusConflict {
		t.Errorf("SetIndexK int4: %v", err)
	}
	want := []string{"bf16?drain=2s Bearer s3cret", "fp8?drain=0s Bearer s3cret", "int4?drain=1m30s Bearer s3cret"}
	if len(got) != len(want) {
		t.Fatalf("calls %q", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("call %d: %q, want %q", i, got[i], want[i])
		}
	}
}
