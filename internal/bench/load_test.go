package bench

import (
	"context"
	"io"
	"math"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// TestRunLoadQueuesPastTheBootstrapTimeout runs the load benchmark through
// a real router, prefill and decode whose decode holds two sessions at a
// time: most sessions queue longer than the 300ms bootstrap timeout, and
// every one completes (busy is not dead), none refused or failed. The
// timeout is short, but not so short that a first request's registry
// lookup and connection on a loaded 2-core machine miss it (100ms did).
func TestRunLoadQueuesPastTheBootstrapTimeout(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	c := clustertest.New(t, clustertest.Options{Model: m, Config: serve.Config{PageSize: 4, KVTokens: 208, MaxRunning: 1,
		PD: serve.PDConfig{BootstrapTimeout: 300 * time.Millisecond, HeartbeatInterval: 20 * time.Millisecond}}})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	servers := []LoadServer{{"prefill", c.Prefill.TS.URL}, {"decode", c.Decode.TS.URL}}
	rep, err := RunLoad(ctx, LoadConfig{URL: c.Router.URL, Model: "tiny", Vocab: m.Config.VocabSize, Sessions: 24, PromptLen: 8, MaxTokens: 96,
		Timeout: time.Minute, Servers: servers}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Completed != 24 || rep.Failed != 0 || rep.Refused != 0 {
		t.Fatalf("completed %d, failed %d (%v), refused %d; want all 24 completed", rep.Completed, rep.Failed, rep.Errors, rep.Refused)
	}
	if rep.E2EP99 < 300 {
		t.Logf("the slowest session took %.0fms: the load did not queue past the bootstrap timeout", rep.E2EP99)
	}
	if len(rep.Queue) != 2 || rep.Queue[0].Requests != 24 || rep.Queue[1].Requests != 24 || rep.Queue[1].P99 < rep.Queue[1].P50 {
		t.Errorf("queue times %+v, want 24 requests on each server", rep.Queue)
	}
	if rep.TTFTP50 <= 0 || rep.TTFTP99 < rep.TTFTP50 || rep.E2EP99 < rep.TTFTP99 || rep.TokPerSec <= 0 {
		t.Errorf("figures out of order: %+v", rep)
	}
}

// The quantile of a histogram between two scrapes interpolates within the
// bucket it falls in, as histogram_quantile does.
func TestQuantile(t *testing.T) {
	inf := math.Inf(1)
	before := buckets{0.1: 5, 1: 5, 10: 5, inf: 5}
	after := buckets{0.1: 5, 1: 15, 10: 25, inf: 25} // 10 in (0.1,1], 10 in (1,10]
	for _, tc := range []struct{ q, want float64 }{{0.5, 1}, {0.25, 0.55}, {0.75, 5.5}, {1, 10}} {
		if got := quantile(before, after, tc.q); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("q%.2f = %v, want %v", tc.q, got, tc.want)
		}
	}
	if got := quantile(after, after, 0.5); !math.IsNaN(got) {
		t.Errorf("nothing observed: %v, want NaN", got)
	}
}
