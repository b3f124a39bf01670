package server

import (
	"context"
	"testing"

	"github.com/pdkit/pdkit/internal/canary"
)

// A colocated server's canaries run on its own engine, greedy, cached
// against computed, and show in its settings; they are in none of its
// request metrics, which a client's request moves.
func TestCanariesOfAColocatedServer(t *testing.T) {
	e := newMetricsEnv(t, 1)
	srv := e.srv
	for range 2 {
		srv.canary(context.Background())
	}
	st := srv.Settings().Canaries
	if st == nil || st.Results[canary.Match] != 2 || st.Results[canary.Mismatch] != 0 || st.LastMismatch != nil {
		t.Fatalf("canaries %+v", st)
	}
	if v := scrape(t, e).must(t, "pdkit_generation_tokens_total"); v != 0 {
		t.Errorf("the canaries' tokens counted: %v", v)
	}
	e.complete(t, map[string]any{"prompt": "once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": true})
	if v := scrape(t, e).must(t, "pdkit_generation_tokens_total"); v != 3 {
		t.Errorf("a client's 3 tokens counted as %v", v)
	}
}
