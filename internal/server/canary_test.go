package server

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/metrics"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// A colocated server's canaries run on its own engine, greedy, cached
// against computed, and show in its settings; they are in none of its
// request metrics, which a client's request moves.
func TestCanariesOfAColocatedServer(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	met := metrics.New(nil)
	eng, err := serve.New(m, withCPU(serve.Config{PageSize: 4, MaxRunning: 8, Observer: met}))
	if err != nil {
		t.Fatal(err)
	}
	srv := New(eng, m, Options{ModelName: "tiny", Metrics: met})
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	e := &env{m: m, eng: eng, srv: srv, ts: ts}
	for range 2 {
		srv.canary(context.Background())
	}
	st := srv.Settings().Canaries
	if st == nil || st.Results[canaryMatch] != 2 || st.Results[canaryMismatch] != 0 || st.LastMismatch != nil {
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
