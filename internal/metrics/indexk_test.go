package metrics

import (
	"context"
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

// The index-K precision's metrics follow a live switch: the gauge moves to
// the new precision, the counter counts it; a model without a sparse
// indexer exports neither; lint-clean either way.
func TestIndexKMetrics(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	eng, err := serve.New(m, withCPU(serve.Config{TP: 2, PageSize: 4, KVTokens: 64, MaxRunning: 2, IndexK: kernels.IndexFP8}))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	met := New(nil)
	if err := met.Watch(eng); err != nil {
		t.Fatal(err)
	}
	// The counter comes with the engine's next published snapshot, a
	// little after the switch: poll for it, then check the rest.
	check := func(when string, fp8, bf16, switches float64) {
		t.Helper()
		var v map[string]float64
		// Past the bound the checks below say what is missing.
		waitfor.Poll(10*time.Second, func() bool {
			v = values(t, met.Registry())
			return v["pdkit_indexk_switches_total"] == switches
		})
		for k, want := range map[string]float64{"pdkit_indexk_precision/fp8": fp8, "pdkit_indexk_precision/bf16": bf16,
			"pdkit_indexk_switches_total": switches} {
			if got, ok := v[k]; !ok || got != want {
				t.Errorf("%s: %s = %v (present %v), want %v", when, k, got, ok, want)
			}
		}
	}
	check("at start", 1, 0, 0)
	if _, err := eng.SetIndexK(context.Background(), kernels.IndexBF16, time.Second); err != nil {
		t.Fatal(err)
	}
	check("after a switch to bf16", 0, 1, 1)
	lint(t, met)

	plain := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	met = watched(t, plain, serve.Config{PageSize: 4, MaxRunning: 2})
	for k := range values(t, met.Registry()) {
		if strings.HasPrefix(k, "pdkit_indexk_") {
			t.Errorf("a model without an indexer exports %s", k)
		}
	}
	lint(t, met)
}
