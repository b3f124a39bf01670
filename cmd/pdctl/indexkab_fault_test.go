//go:build faultrace && !race

package main

// The fault hicache-indexk-ungated is a data race between the HiCache
// loader and the forward pass, by design: this test runs only in a binary
// built without the race detector, and only when asked for:
//
//	go test -tags faultrace -run TestIndexKABFault -v ./cmd/pdctl/

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
)

// TestIndexKABFault runs the matrix with the prefill's index-K reads
// ungated (the incident's bug, switched on through the faults API) and the
// loads back from host paced to 16MiB/s, so that they take longer than a
// forward step of the tiny model: the HiCache-on cells report corrupt
// outputs, the HiCache-off cells none (nothing loads back), the exit status
// is 1 and its message names the fault; the servers end as found, the
// fault still on (indexk ab leaves faults alone). It runs on llama-dsa and
// on the DeepSeek-shaped model with a bf16 latent.
func TestIndexKABFault(t *testing.T) {
	for _, arch := range []string{model.ArchLlamaDSA, model.ArchDeepSeek2DSA} {
		t.Run(arch, func(t *testing.T) {
			cfg := abConfig
			if arch == model.ArchDeepSeek2DSA {
				cfg.KVType = kernels.BF16
			}
			indexKABFault(t, newABClusterOf(t, arch, cfg))
		})
	}
}

func indexKABFault(t *testing.T, c *cluster) {
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetFault(t.Context(), serve.FaultHiCacheIndexKUngated, true); err != nil {
		t.Fatal(err)
	}
	before := []string{serverState(t, c.prefill), serverState(t, c.decode)}

	start := time.Now()
	code, stdout, stderr := c.abPdctl(t, false, append(abArgs, "--load-bandwidth", "16MiB/s", "--json")...)
	took := time.Since(start)
	var rep abReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("exit %d: %v\nstdout:\n%s\nstderr:\n%s", code, err, stdout, stderr)
	}
	t.Logf("indexk ab took %v:\n%s", took, stderr)
	for _, cell := range rep.Cells {
		t.Logf("%s hicache %s: %d of %d corrupt (%.1f%%), %d timeouts, %d errors, %d host hits loading %d tokens, TTFT p50 %.1fms p99 %.1fms, ITL p50 %.1fms p99 %.1fms, %.1fs",
			cell.IndexK, cell.HiCache, cell.Corrupt, cell.Compared, 100*cell.CorruptShare, cell.Timeouts, cell.Errors,
			cell.HostHits, cell.HitTokens, cell.TTFTMS.P50, cell.TTFTMS.P99, cell.ITLMS.P50, cell.ITLMS.P99, cell.Seconds)
		if cell.HiCache == "off" && cell.Corrupt != 0 {
			t.Errorf("%s with hicache off: %d corrupt outputs, though nothing loads back from host", cell.IndexK, cell.Corrupt)
		}
	}
	if code != exitFindings || rep.CorruptCells == 0 {
		t.Errorf("exit %d with %d corrupt cells; want exit 1 and at least one", code, rep.CorruptCells)
	}
	last := stderr[strings.LastIndex(strings.TrimSuffix(stderr, "\n"), "\n")+1:]
	if !strings.HasPrefix(last, "pdctl: corrupt outputs in ") ||
		!strings.HasSuffix(last, "; fault hicache-indexk-ungated on (prefill PREFILL), loads back from host paced to 16MiB/s per rank\n") {
		t.Errorf("the last line of stderr does not name the cells and the switches on:\n%s", last)
	}
	if after := []string{serverState(t, c.prefill), serverState(t, c.decode)}; !slices.Equal(after, before) {
		t.Errorf("the servers end as %q, want them restored to %q", after, before)
	}
}
