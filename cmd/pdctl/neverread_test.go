package main

import (
	"bytes"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// Clients that open streams and never read them (their answers sit in the
// sockets' buffers): busy, not sick; diagnose says healthy.
func TestDiagnoseClientsThatNeverRead(t *testing.T) {
	c := newCluster(t)
	addr := strings.TrimPrefix(c.router, "http://")
	for i := range 8 {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		b, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("never read ", 1+i%3), "max_tokens": 60, "stream": true, "ignore_eos": true})
		req, _ := http.NewRequest(http.MethodPost, c.router+"/v1/completions", bytes.NewReader(b))
		req.Header.Set("Content-Type", "application/json")
		if err := req.Write(conn); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "the decode serving the unread streams", 20*time.Second, func() bool {
		snap := c.decode.eng.View().Snapshot()
		return snap != nil && snap.Totals.Finished+uint64(len(snap.Queue.Running)) >= 8
	})
	if code, stdout, stderr := c.pdctl(t, false, "diagnose", "--window", "2s", "--interval", "500ms"); code != exitOK || stdout != "healthy\n" {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
}

// A router at its admission bound sheds the excess at the edge (429):
// busy, not sick. diagnose prints the shedding as a note and exits 0.
func TestDiagnoseQueueAtTheRoutersBound(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	c := newClusterWith(t, m, clustertest.Options{Router: router.Options{MaxQueued: 2}})
	served, stop := load(t, c.router, 24)
	defer stop()
	waitfor.For(t, "the load served", 20*time.Second, func() bool { return served() >= 10 })
	code, stdout, stderr := c.pdctl(t, false, "diagnose", "--window", "2s", "--interval", "500ms")
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	for _, l := range strings.Split(strings.TrimSpace(stdout), "\n") {
		if l != "healthy" && !strings.HasPrefix(l, "info\t") {
			t.Errorf("a finding above info: %q", l)
		}
	}
	t.Logf("%s%s", stdout, stderr)
}
