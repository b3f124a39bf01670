package bench

import (
	"context"
	"io"
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
// time: most sessions queue far longer than the 300ms bootstrap timeout,
// and every one completes (busy is not dead), none refused or failed.
func TestRunLoadQueuesPastTheBootstrapTimeout(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	c := clustertest.New(t, clustertest.Options{Model: m, Config: serve.Config{PageSize: 4, KVTokens: 96, MaxRunning: 2,
		PD: serve.PDConfig{BootstrapTimeout: 300 * time.Millisecond, HeartbeatInterval: 50 * time.Millisecond}}})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	rep, err := RunLoad(ctx, LoadConfig{URL: c.Router.URL, Model: "tiny", Vocab: m.Config.VocabSize, Sessions: 24, PromptLen: 8, MaxTokens: 32, Timeout: time.Minute}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Completed != 24 || rep.Failed != 0 || rep.Refused != 0 {
		t.Fatalf("completed %d, failed %d (%v), refused %d; want all 24 completed", rep.Completed, rep.Failed, rep.Errors, rep.Refused)
	}
	if rep.E2EP99 < 300 {
		t.Logf("the slowest session took %.0fms: the load did not queue past the bootstrap timeout", rep.E2EP99)
	}
	if rep.TTFTP50 <= 0 || rep.TTFTP99 < rep.TTFTP50 || rep.E2EP99 < rep.TTFTP99 || rep.TokPerSec <= 0 {
		t.Errorf("figures out of order: %+v", rep)
	}
}
