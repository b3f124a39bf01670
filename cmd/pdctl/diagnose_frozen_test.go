package main

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/internal/memnet"
)

// A frozen server (it takes connections and never answers) is named
// within the window and one sample's bound, not a bound per sample later:
// the samples start on time and read the servers in parallel. Run in a
// synctest bubble over an in-memory network, so the figures are the
// bubble's clock, whatever the machine.
func TestDiagnoseFrozenServerWithinTheWindow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := memnet.New()
		healthy := http.NewServeMux()
		for _, path := range []string{"/debug/v1/steps", "/debug/v1/collectives", "/debug/v1/requests", "/debug/v1/faults", "/debug/v1/settings"} {
			healthy.HandleFunc(path, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{}`))
			})
		}
		healthy.HandleFunc("/pd/v1/info", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"role":"colocated","tp_size":1}`))
		})
		frozen := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
		hc := m.Client(t)
		var targets []*target
		for _, s := range []struct {
			name string
			h    http.Handler
		}{{"up", healthy}, {"frozen", frozen}} {
			srv := m.Serve(t, s.name, s.h)
			t.Cleanup(srv.Close)
			targets = append(targets, &target{URL: srv.URL, Role: "colocated", c: client.New(srv.URL, "", hc)})
		}
		start := time.Now()
		findings, w, err := diagnose(context.Background(), probe{targets: targets}, 5*time.Second, time.Second, diag.DefaultConfig(), nil)
		took := time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		if want := 5*time.Second + sampleBound(time.Second); took > want || len(w.Samples) != 6 {
			t.Fatalf("diagnose took %v for %d samples, want at most %v for 6", took, len(w.Samples), want)
		}
		var keys []string
		for _, f := range findings {
			keys = append(keys, f.Rule+" "+f.Server)
		}
		if !slices.Contains(keys, "peer-unreachable "+targets[1].URL) || slices.Contains(keys, "peer-unreachable "+targets[0].URL) {
			t.Fatalf("findings %q", keys)
		}
		t.Logf("a frozen server named in %v (bubble clock), window 5s, interval 1s", took)
	})
}

// Notes (info findings: load shed at the edge, a live switch under way)
// leave the cluster healthy, exit 0, and stderr counts them; a warning or
// worse is exit 1.
func TestFindingsResult(t *testing.T) {
	var errOut strings.Builder
	f := &factory{ErrOut: &errOut}
	note := diag.Finding{Rule: "requests-failing", Severity: diag.Info}
	if err := findingsResult(f, "diagnose", []diag.Finding{note}); err != nil || errOut.String() != "pdctl: diagnose: healthy, with 1 note (info)\n" {
		t.Fatalf("a note: %v, stderr %q", err, errOut.String())
	}
	var fe *findingsError
	if err := findingsResult(f, "diagnose", []diag.Finding{note, {Rule: "server-slow", Severity: diag.Warning}}); !errors.As(err, &fe) {
		t.Fatalf("a warning: %v", err)
	}
	if err := findingsResult(f, "diagnose", nil); err != nil {
		t.Fatal(err)
	}
}
