package main

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
)

// TestAbortAuthenticated: on a cluster with a secret, pdctl's synthetic
// ABORT reaches the prefill rank, and its ABORT_ACK comes back, only with
// the secret; without it pdctl says that the rank wants the cluster's
// credential, and the room lives on.
func TestAbortAuthenticated(t *testing.T) {
	secret, text := clusterauth.Generate()
	saved := testConfig
	testConfig.PD.Secret = secret
	c := newCluster(t)
	testConfig = saved

	done := c.prefillOnly(t, 7)
	poll(t, "room 7 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 2
	})
	code, out, errOut := c.pdctl(t, false, "abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "2s")
	if code != exitError || !strings.Contains(out, "send failed") || !strings.Contains(out, "PD_CLUSTER_SECRET") {
		t.Fatalf("without the secret: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if pdCounts(t, c.prefill, debug.PDQueueBootstrap) != 2 {
		t.Fatal("an ABORT without the cluster's credential reached the room")
	}
	checkRun(t, c, exitOK, "7\t0\tPREFILL-RANK0\tacked\tno\t*\talive\n", "",
		"abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "5s", "--cluster-secret", text)
	if code := waitEnded(t, "room 7", done); code == http.StatusOK {
		t.Fatalf("room 7 answered %d after its ABORT", code)
	}
}
