package main

import (
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestAbortAuthenticated: on a cluster with a secret, pdctl's synthetic
// ABORT reaches the prefill rank, and its ABORT_ACK comes back, only with
// the secret; without it pdctl says that the rank wants the cluster's
// credential, and the room lives on.
func TestAbortAuthenticated(t *testing.T) {
	c, text := newSecretCluster(t)

	done := c.prefillOnly(t, 7)
	waitfor.For(t, "room 7 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 2
	})
	code, out, errOut := c.pdctl(t, false, "abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "2s")
	if code != exitError || !strings.Contains(out, "send failed") || !strings.Contains(out, "PD_CLUSTER_SECRET") {
		t.Fatalf("without the secret: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if pdCounts(t, c.prefill, debug.PDQueueBootstrap) != 2 {
		t.Fatal("an ABORT without the cluster's credential reached the room")
	}
	// The debug API tells the operator what was refused and why. The
	// refusal is counted from libzmq's monitor events, which the rank reads
	// on its own goroutine, so the count can trail pdctl's exit a little.
	waitfor.For(t, "rank 0's socket counting the refused pdctl", 10*time.Second, func() bool {
		pd, err := client.New(c.prefill.ts.URL, "", nil).PD(t.Context(), "")
		if err != nil {
			t.Fatal(err)
		}
		s := pd.Ranks[0].Socket
		return s.AuthDenied >= 1 && s.LastAuthDenied != ""
	})
	checkRun(t, c, exitOK, "7\t0\tPREFILL-RANK0\tacked\tno\t*\talive\n", "",
		"abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "5s", "--cluster-secret", text)
	if end := waitEnded(t, "room 7", done); end != "200 abort" {
		t.Fatalf("room 7 ended %q after its ABORT, want 200 abort", end)
	}
}

// TestRedTeamAdminNeedsTheSecret: the servers of a cluster with a secret
// (here on loopback, as pdserve launch runs them) take admin calls only
// with the token the secret derives: pdctl without the secret is refused
// and switches nothing; with --cluster-secret it switches the fault.
func TestRedTeamAdminNeedsTheSecret(t *testing.T) {
	c, text := newSecretCluster(t)

	code, out, errOut := c.pdctl(t, false, "--server", c.prefill.ts.URL, "fault", "on", "drop-transfer-info")
	if code == exitOK || !strings.Contains(out+errOut, "401") {
		t.Fatalf("without the secret: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if on := faultsOn(c.prefill); len(on) != 0 {
		t.Fatalf("a fault switched without the secret: %v", on)
	}
	if code, out, errOut := c.pdctl(t, false, "--server", c.prefill.ts.URL, "--cluster-secret", text, "fault", "on", "drop-transfer-info"); code != exitOK {
		t.Fatalf("with the secret: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if on := faultsOn(c.prefill); len(on) != 1 || on[0] != "drop-transfer-info" {
		t.Fatalf("faults on after pdctl with the secret: %v", on)
	}
}

// faultsOn names the fault switches on at n.
func faultsOn(n *node) []string {
	var on []string
	for _, f := range n.eng.View().Faults() {
		if f.On {
			on = append(on, f.Name)
		}
	}
	return on
}

// newSecretCluster is newCluster with a fresh cluster secret, which it
// returns in its text form for pdctl's --cluster-secret.
func newSecretCluster(t *testing.T) (*cluster, string) {
	t.Helper()
	secret, text := clusterauth.Generate()
	saved := testConfig
	testConfig.PD.Secret = secret
	defer func() { testConfig = saved }()
	return newCluster(t), text
}
