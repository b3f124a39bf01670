//go:build faultrace && !race

package main

// The fault hicache-indexk-ungated is a data race by design (the sparse
// indexer reads index-K while the loader writes it), so its test is kept
// out of the race detector's builds and of make test:
//
//	go test -tags faultrace -run TestDiagnoseCanariesIndexKRace -v ./cmd/pdctl/

import (
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
)

// collapseCanaries folds the evidence of the canaries that differ (how
// many is up to the race) into one masked entry, in each output format.
var (
	pipedCanaries = regexp.MustCompile(`; canary [0-9]+=[^\t\n]*?; PREFILL=`)
	ttyCanaries   = regexp.MustCompile(`(  canary [0-9]+: [^\n]*\n)+`)
)

// TestDiagnoseCanariesIndexKRace: with hicache-indexk-ungated on at the
// prefill (bf16 index keys, HiCache on, the loader paced to 16MiB/s so that
// a load takes about a forward pass), diagnose's canaries see outputs
// loaded back from host differ from their no_cache reference, and the
// finding names HiCache, bf16 and the fault, with the remedy; the exact
// output, piped, on a terminal and as JSON, the race's own values masked.
// The race may spare a run's canaries: up to 3 runs of 5 are tried.
func TestDiagnoseCanariesIndexKRace(t *testing.T) {
	c := newCanaryCluster(t, nil)
	if code, stdout, stderr := c.pdctl(t, false, "fault", "on", "hicache-indexk-ungated"); code != exitOK {
		t.Fatalf("fault on: exit %d\n%s%s", code, stdout, stderr)
	}
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetHiCacheBandwidth(t.Context(), 16<<20); err != nil {
		t.Fatal(err)
	}
	faults, err := client.New(c.prefill.ts.URL, "", nil).Faults(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(faults.Faults, func(f debug.Fault) bool { return f.Name == "hicache-indexk-ungated" })
	doc := faults.Faults[i].Doc

	const (
		summary  = `* of 5 canaries gave other greedy tokens from the cache than computed without it (hicache on, index-K bf16, fault hicache-indexk-ungated on): cached KV is corrupt, outputs are garbled`
		counts   = `* of 5 differ (greedy, 16 tokens each, prompts of * tokens, seed *)`
		canary   = `* prompt tokens, offloaded * on PREFILL; loaded back "*", no_cache "*"`
		prefill  = `prefill, index-K bf16, hicache on, faults on: hicache-indexk-ungated`
		decode   = `decode, index-K bf16, hicache off, no fault on`
		remedy   = `switch the fault off (pdctl fault off hicache-indexk-ungated): it lets the sparse indexer read index-K before it loads back from host; turn HiCache off on every server (pdctl hicache off) until the cause is fixed: outputs computed without the host tier are right; then run pdctl diagnose --canaries again to confirm.`
		faultOff = `unless a drill needs it, switch it off (pdctl fault off hicache-indexk-ungated --server PREFILL); a server started with --fault keeps it across restarts until the flag is removed.`
	)
	seed := regexp.MustCompile(`seed [0-9]+`)
	mask := func(s string) string { return seed.ReplaceAllString(maskCanaries(s), "seed *") }
	args := []string{"diagnose", "--window", "1s", "--interval", "500ms", "--canaries", "5"}

	// The piped output first, run until the race shows.
	var stdout, stderr string
	var code exitCode
	for run := range 3 {
		code, stdout, stderr = c.pdctl(t, false, args...)
		if code == exitFindings && strings.Contains(stdout, "output-divergence") {
			t.Logf("run %d: %s", run+1, strings.TrimSpace(stderr))
			break
		}
		t.Logf("run %d: exit %d, no divergence: %s", run+1, code, strings.TrimSpace(stderr))
	}
	piped := "critical\toutput-divergence\tROUTER\t-\t" + summary + "\tcanaries=" + counts + "; canary *=" + canary +
		"; PREFILL=" + prefill + "; DECODE=" + decode + "; seen=*\t" + remedy + "\n" +
		"warning\tfault-switch-on\tPREFILL\t-\tthe prefill server runs with the fault switch on: hicache-indexk-ungated\t" +
		"hicache-indexk-ungated=" + doc + "; seen=*\t" + faultOff + "\n"
	got := pipedCanaries.ReplaceAllString(mask(stdout), "; canary *="+canary+"; PREFILL=")
	if code != exitFindings || got != piped {
		t.Fatalf("piped: exit %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s", code, got, piped, stderr)
	}
	wantErr := regexp.MustCompile(`5 canaries through ROUTER \(seed [0-9]+, prompts of [0-9–]+ tokens, 16 greedy tokens each\): hicache on at PREFILL; [1-5] of 5 differ\npdctl: diagnose: 2 findings \(1 critical, 1 warning\)\n$`)
	if !wantErr.MatchString(stderr) {
		t.Errorf("stderr:\n%s", stderr)
	}

	// On a terminal and as JSON: the same finding, as the race allows.
	tty := "critical output-divergence ROUTER: " + summary + "\n  canaries: " + counts + "\n  canary *: " + canary + "\n" +
		"  PREFILL: " + prefill + "\n  DECODE: " + decode + "\n  seen: *\n  remedy: " + remedy + "\n\n" +
		"warning fault-switch-on PREFILL: the prefill server runs with the fault switch on: hicache-indexk-ungated\n" +
		"  hicache-indexk-ungated: " + doc + "\n  seen: *\n  remedy: " + faultOff + "\n"
	for run := range 3 {
		code, stdout, _ = c.pdctl(t, true, args...)
		if strings.Contains(stdout, "output-divergence") || run == 2 {
			break
		}
	}
	if got := ttyCanaries.ReplaceAllString(mask(stdout), "  canary *: "+canary+"\n"); code != exitFindings || got != tty {
		t.Errorf("terminal: exit %d\nstdout:\n%s\nwant:\n%s", code, got, tty)
	}
	for run := range 3 {
		code, stdout, _ = c.pdctl(t, false, append(args, "--json")...)
		if strings.Contains(stdout, "output-divergence") || run == 2 {
			break
		}
	}
	findings := decodeFindings(t, stdout)
	if code != exitFindings || len(findings) != 2 || findings[0].Rule != "output-divergence" || findings[1].Rule != "fault-switch-on" {
		t.Fatalf("JSON: exit %d\n%s", code, stdout)
	}
	f := &findings[0]
	f.Summary = mask(f.Summary)
	var ev []diag.Evidence
	for _, e := range f.Evidence {
		e.Value = mask(e.Value)
		if strings.HasPrefix(e.Key, "canary ") {
			if slices.ContainsFunc(ev, func(e diag.Evidence) bool { return e.Key == "canary *" }) {
				continue
			}
			e.Key = "canary *"
		}
		ev = append(ev, e)
	}
	f.Evidence = ev
	want := []diag.Finding{
		{Rule: "output-divergence", Severity: diag.Critical, Server: "ROUTER", Summary: summary, Seen: "*", Remedy: remedy, Evidence: []diag.Evidence{
			{Key: "canaries", Value: counts}, {Key: "canary *", Value: canary}, {Key: "PREFILL", Value: prefill}, {Key: "DECODE", Value: decode}}},
		{Rule: "fault-switch-on", Severity: diag.Warning, Server: "PREFILL", Seen: "*", Remedy: faultOff,
			Summary:  "the prefill server runs with the fault switch on: hicache-indexk-ungated",
			Evidence: []diag.Evidence{{Key: "hicache-indexk-ungated", Value: doc}}},
	}
	var gotJSON, wantJSON strings.Builder
	writeJSON(&gotJSON, findings)
	writeJSON(&wantJSON, want)
	if gotJSON.String() != wantJSON.String() {
		t.Errorf("JSON:\n%s\nwant:\n%s", gotJSON.String(), wantJSON.String())
	}
}
