package diag

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
)

// TestRequestsFailing: on the scenario (a busy decode, the
// prefill's rooms timing out in its bootstrap queue) the cluster is not
// healthy, whatever else the rules say; the router's share of failures
// sets the severity of every finding of the rule; one sample shows no
// change and gives nothing; a router that restarted counts from zero.
func TestRequestsFailing(t *testing.T) {
	w := readWindow(t, filepath.Join("testdata", "requests-failing", "bootstrap_timeouts.json"))
	all := Run(w)
	if len(all) == 0 {
		t.Fatal("a cluster failing 7 of 31 requests is healthy")
	}
	for _, f := range all {
		if f.Rule == "requests-failing" && (f.Severity != Critical || f.Rank != nil) {
			t.Errorf("finding %s: severity %v, rank %v; want critical, the whole server", f.Where(), f.Severity, f.Rank)
		}
	}

	// Few failures among many requests: a warning, for the servers too.
	last := &w.Samples[len(w.Samples)-1]
	last.Router.Outcomes["ok"] = 100 + 1000
	for _, f := range requestsFailing().Check(w) {
		if f.Severity != Warning {
			t.Errorf("7 failures among 1000 ok: %s is %v", f.Where(), f.Severity)
		}
	}

	// Without the router (servers named on the command line) the share is
	// unknown: critical.
	for i := range w.Samples {
		w.Samples[i].Router = nil
	}
	fs := requestsFailing().Check(w)
	if len(fs) != 1 || fs[0].Server != "http://prefill-0:30000" || fs[0].Severity != Critical {
		t.Errorf("without the router:\n%s", render(fs))
	}

	// One sample: no change to judge.
	if fs := requestsFailing().Check(Window{Samples: w.Samples[2:]}); len(fs) != 0 {
		t.Errorf("one sample:\n%s", render(fs))
	}

	// The router restarted between the samples: its counters start over.
	w = readWindow(t, filepath.Join("testdata", "requests-failing", "bootstrap_timeouts.json"))
	r := w.Samples[len(w.Samples)-1].Router
	r.Outcomes, r.UpstreamErrors = map[string]uint64{"ok": 3, "upstream_error": 1}, map[string]uint64{"http://prefill-0:30000": 1}
	fs = requestsFailing().Check(w)
	if len(fs) == 0 || fs[0].Server != r.URL || !strings.Contains(fs[0].Summary, "1 of 4 requests") ||
		!slices.Contains(fs[0].Evidence, Evidence{Key: "upstream errors", Value: "http://prefill-0:30000=1"}) {
		t.Errorf("after a router restart:\n%s", render(fs))
	}
}

// TestFailureCounting: which router outcomes are failures, and a prefill's
// peer-aborted rooms are not.
func TestFailureCounting(t *testing.T) {
	for o, want := range map[string]bool{"ok": false, "invalid": false, "aborted": false, "client_gone": false, "client_error": false,
		"upstream_error": true, "no_server": true, "overloaded": true, "starting": true, "shutdown": true, "something_new": true} {
		if FailedOutcome(o) != want {
			t.Errorf("FailedOutcome(%q) = %v", o, !want)
		}
	}
	if n := RouterFailures(map[string]uint64{"ok": 5, "no_server": 2, "upstream_error": 1, "client_gone": 9}); n != 3 {
		t.Errorf("RouterFailures = %d, want 3", n)
	}
	p := &debug.PDResponse{FailedRequests: 10, FailuresByReason: map[string]uint64{debug.PDFailPeerAborted: 4, debug.PDFailTimeout: 6}}
	if n := ServerFailures(p); n != 6 {
		t.Errorf("ServerFailures = %d, want 6", n)
	}
	if n := ServerFailures(nil); n != 0 {
		t.Errorf("ServerFailures(nil) = %d", n)
	}
}
