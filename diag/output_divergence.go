package diag

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"unicode/utf8"
)

// Canaries are the results of diagnose's canaries, an active probe sent
// during the window (pdctl diagnose --canaries N): each canary prompt is
// sent once so that it is cached, offloaded to the host tier of every
// prefill and colocated server whose tier is on, then sent again normally
// (its prefix loads back from host) and with no_cache (computed from
// scratch, the reference). Greedy decoding is batch-invariant, so on a
// healthy cluster all its outputs are the same.
type Canaries struct {
	// Via is where the canaries were sent: the router, or a colocated
	// server named with --server.
	Via string `json:"via"`
	// Seed generated the prompts (pdctl diagnose --canary-seed repeats
	// them).
	Seed uint64 `json:"seed"`
	// MaxTokens is each output's length: greedy, end-of-sequence ignored.
	MaxTokens int `json:"max_tokens"`
	// HiCache lists the servers whose host tier was on when the probe
	// began; the canaries were offloaded on the prefill and colocated ones.
	// Empty when it was on nowhere: nothing loads back, and the canaries
	// compare a device cache hit with the reference.
	HiCache []string `json:"hicache"`
	Runs    []Canary `json:"runs"`
}

// Canary is one canary prompt and its outputs.
type Canary struct {
	Index        int `json:"index"`
	PromptTokens int `json:"prompt_tokens"`
	// Offloaded is the prompt's tokens that went to host, by server (the
	// prefill and colocated servers of Canaries.HiCache; 0 on one that did
	// not hold it).
	Offloaded map[string]int `json:"offloaded"`
	// First is the output of the first send (computed, or a cache hit),
	// LoadedBack the output of the send after the offload, Reference the
	// output with no_cache.
	First      string `json:"first"`
	LoadedBack string `json:"loaded_back"`
	Reference  string `json:"reference"`
	// Error says why the canary could not be compared (a send or an
	// offload failed); its outputs are then not judged.
	Error string `json:"error,omitempty"`
}

// Diverged says whether the canary ran and an output differs from its
// reference.
func (c Canary) Diverged() bool {
	return c.Error == "" && (c.First != c.Reference || c.LoadedBack != c.Reference)
}

// corruptingFaults are the fault switches that corrupt outputs: the
// HiCache index-K race of incident 3.
var corruptingFaults = []string{"hicache-indexk-ungated"}

func outputDivergence() Rule {
	return Rule{
		Name:     "output-divergence",
		Doc:      "A canary prompt gave other greedy tokens when its KV came from the cache (loaded back from the host tier) than computed without it: the cache serves corrupt KV, so outputs are garbled (the HiCache index-K race of incident 3).",
		Severity: Critical,
		Check:    checkOutputDivergence,
	}
}

func checkOutputDivergence(w Window) []Finding {
	out := routerCanaries(w)
	cs := w.Canaries
	if cs == nil {
		return out
	}
	var bad []Canary
	ran := 0
	for _, c := range cs.Runs {
		if c.Error == "" {
			ran++
		}
		if c.Diverged() {
			bad = append(bad, c)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	minP, maxP := bad[0].PromptTokens, bad[0].PromptTokens
	for _, c := range cs.Runs {
		if c.Error == "" {
			minP, maxP = min(minP, c.PromptTokens), max(maxP, c.PromptTokens)
		}
	}
	prompts := fmt.Sprintf("%d", minP)
	if maxP != minP {
		prompts = fmt.Sprintf("%d–%d", minP, maxP)
	}
	evidence := []Evidence{ev("canaries", "%d of %d differ (greedy, %d tokens each, prompts of %s tokens, seed %d)", len(bad), ran, cs.MaxTokens, prompts, cs.Seed)}
	for _, c := range bad {
		evidence = append(evidence, ev(fmt.Sprintf("canary %d", c.Index), "%s", canaryEvidence(c)))
	}

	// The cells: every server the canaries may have run on.
	var faults, hicache, cells []string
	for _, s := range w.Last().Servers {
		if !s.Reachable {
			continue
		}
		on := slices.Contains(cs.HiCache, s.URL)
		cell := cellOf(&s, on)
		cells = append(cells, cell)
		evidence = append(evidence, ev(s.URL, "%s", cell))
		if on {
			hicache = append(hicache, s.URL)
		}
		for _, f := range faultsOn(&s) {
			if slices.Contains(corruptingFaults, f) && !slices.Contains(faults, f) {
				faults = append(faults, f)
			}
		}
	}
	var why []string
	if len(hicache) > 0 {
		why = append(why, "hicache on")
	} else {
		why = append(why, "hicache off everywhere")
	}
	for _, p := range []string{"bf16", "fp8"} {
		if slices.ContainsFunc(cells, func(c string) bool { return strings.Contains(c, "index-K "+p) }) {
			why = append(why, "index-K "+p)
		}
	}
	for _, f := range faults {
		why = append(why, "fault "+f+" on")
	}
	summary := fmt.Sprintf("%d of %d canaries gave other greedy tokens from the cache than computed without it (%s): cached KV is corrupt, outputs are garbled",
		len(bad), ran, strings.Join(why, ", "))

	var remedy []string
	for _, f := range faults {
		remedy = append(remedy, fmt.Sprintf("switch the fault off (pdctl fault off %s): it lets the sparse indexer read index-K before it loads back from host", f))
	}
	switch {
	case len(hicache) > 0:
		remedy = append(remedy, "turn HiCache off on every server (pdctl hicache off) until the cause is fixed: outputs computed without the host tier are right")
	default:
		remedy = append(remedy, "HiCache is off, so the device prefix cache itself served other KV: serve with --no-prefix-cache until it is found, and keep a bundle (pdctl bundle -o FILE.tar.gz) for the engineers")
	}
	remedy = append(remedy, "then run pdctl diagnose --canaries again to confirm")
	return []Finding{{
		Rule: "output-divergence", Severity: Critical, Server: cs.Via, Rank: nil,
		Summary:  summary,
		Evidence: evidence,
		Remedy:   strings.Join(remedy, "; ") + ".",
	}}
}

// canaryEvidence says what a diverging canary did and which output
// differs.
func canaryEvidence(c Canary) string {
	var off []string
	total := 0
	for _, u := range slices.Sorted(maps.Keys(c.Offloaded)) {
		off = append(off, fmt.Sprintf("%d on %s", c.Offloaded[u], u))
		total += c.Offloaded[u]
	}
	where := "not offloaded (hicache off)"
	if len(off) > 0 {
		where = "offloaded " + strings.Join(off, ", ")
	}
	second := "loaded back"
	if total == 0 {
		second = "cached" // nothing went to host: a device cache hit
	}
	var diff []string
	if c.LoadedBack != c.Reference {
		diff = append(diff, fmt.Sprintf("%s %s", second, quote(c.LoadedBack)))
	}
	if c.First != c.Reference {
		diff = append(diff, fmt.Sprintf("first %s", quote(c.First)))
	}
	return fmt.Sprintf("%d prompt tokens, %s; %s, no_cache %s", c.PromptTokens, where, strings.Join(diff, ", "), quote(c.Reference))
}

// quote quotes an output, cut to its first 32 bytes (whole runes).
func quote(s string) string {
	if len(s) <= 32 {
		return fmt.Sprintf("%q", s)
	}
	n := 32
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return fmt.Sprintf("%q…", s[:n])
}

// cellOf is a server's cell: role, index-K precision, host tier, faults
// on.
func cellOf(s *ServerSample, hicache bool) string {
	ik := "index-K unknown"
	if st := s.Settings; st != nil {
		ik = "index-K " + st.IndexK
		if !st.Indexer {
			ik = "no indexer"
		}
	}
	tier := "hicache off"
	if hicache {
		tier = "hicache on"
	}
	f := "no fault on"
	if on := faultsOn(s); len(on) > 0 {
		f = "faults on: " + strings.Join(on, ", ")
	}
	return fmt.Sprintf("%s, %s, %s, %s", s.Role, ik, tier, f)
}

// faultsOn names the server's fault switches on, from its fault listing,
// else its settings.
func faultsOn(s *ServerSample) []string {
	if s.Faults != nil {
		var on []string
		for _, f := range s.Faults.Faults {
			if f.On {
				on = append(on, f.Name)
			}
		}
		return on
	}
	if s.Settings != nil {
		return s.Settings.FaultsOn
	}
	return nil
}

// routerCanaries judges the router's own canaries (--canary-interval):
// mismatches over the window are critical; older ones, since the router
// started, a warning, so that the race of incident 3 is named without
// diagnose --canaries.
func routerCanaries(w Window) []Finding {
	out := serverCanaries(w)
	first, last := w.First().Router, w.Last().Router
	if last == nil || !last.Reachable || len(last.Canaries) == 0 {
		return out
	}
	for _, prefill := range slices.Sorted(maps.Keys(last.Canaries)) {
		now := last.Canaries[prefill]
		bad := now["mismatch"]
		if bad == 0 {
			continue
		}
		var before uint64
		if first != nil && first.Reachable {
			before = min(first.Canaries[prefill]["mismatch"], bad)
		}
		judged := now["match"] + bad
		sev, when := Warning, "since the router started, none over this window"
		if bad > before {
			sev, when = Critical, fmt.Sprintf("%d over this window", bad-before)
		}
		out = append(out, Finding{
			Rule: "output-divergence", Severity: sev, Server: prefill,
			Summary: fmt.Sprintf("%d of the router's %d canaries through this prefill server gave other greedy tokens from the cache than computed without it (%s): cached KV is corrupt",
				bad, judged, when),
			Evidence: []Evidence{
				ev("router canaries", "%s", countList(now, nil)),
				ev("last mismatch", "GET %s/debug/v1/cluster (canaries.last_mismatch: both outputs)", last.URL),
			},
			Remedy: "look for a fault switch on the prefill server (pdctl fault list); turn HiCache off on every server (pdctl hicache off) until the cause is fixed: " +
				"outputs computed without the host tier are right; pdctl diagnose --canaries N then shows which cell corrupts.",
		})
	}
	return out
}

// serverCanaries judges a colocated server's own canaries (its settings'
// canaries), as routerCanaries the router's.
func serverCanaries(w Window) []Finding {
	var out []Finding
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.Settings == nil || s.Settings.Canaries == nil {
			continue
		}
		now := s.Settings.Canaries.Results
		bad := now["mismatch"]
		if bad == 0 {
			continue
		}
		var before uint64
		if f := w.First().Server(s.URL); f != nil && f.Reachable && f.Settings != nil && f.Settings.Canaries != nil {
			before = min(f.Settings.Canaries.Results["mismatch"], bad)
		}
		sev, when := Warning, "since the server started, none over this window"
		if bad > before {
			sev, when = Critical, fmt.Sprintf("%d over this window", bad-before)
		}
		evidence := []Evidence{ev("canaries", "%s", countList(now, nil))}
		if lm := s.Settings.Canaries.LastMismatch; lm != nil {
			evidence = append(evidence, ev("last mismatch", "seed %d: cached %q, computed %q", lm.Seed, clip(lm.Cached), clip(lm.Computed)))
		}
		out = append(out, Finding{
			Rule: "output-divergence", Severity: sev, Server: s.URL,
			Summary: fmt.Sprintf("%d of the server's %d canaries gave other greedy tokens from the cache than computed without it (%s): cached KV is corrupt",
				bad, now["match"]+bad, when),
			Evidence: evidence,
			Remedy: "look for a fault switch on the server (pdctl fault list); turn HiCache off (pdctl hicache off) until the cause is fixed: " +
				"outputs computed without the host tier are right.",
		})
	}
	return out
}

// clip shortens an output for an evidence line.
func clip(s string) string {
	if r := []rune(s); len(r) > 40 {
		return string(r[:40]) + "…"
	}
	return s
}
