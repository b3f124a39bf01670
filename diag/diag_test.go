package diag

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
)

var update = flag.Bool("update", false, "rewrite the golden findings in testdata")

// readWindow reads a fixture: a Window as JSON.
func readWindow(t *testing.T, path string) Window {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	var w Window
	if err := dec.Decode(&w); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return w
}

// render writes findings as their golden text.
func render(fs []Finding) string {
	if len(fs) == 0 {
		return "healthy\n"
	}
	var b strings.Builder
	for i, f := range fs {
		if i > 0 {
			b.WriteString("\n")
		}
		b.WriteString(f.String())
	}
	return b.String()
}

func ruleByName(t *testing.T, name string) Rule {
	t.Helper()
	for _, r := range Rules() {
		if r.Name == name {
			return r
		}
	}
	t.Fatalf("no rule %q", name)
	return Rule{}
}

// TestHealthy runs every rule on the healthy fixtures of testdata/healthy/
// (a busy cluster whose queues drain between samples, an idle one, a slow
// room passed by others): none may give a finding.
func TestHealthy(t *testing.T) {
	fixtures, _ := filepath.Glob(filepath.Join("testdata", "healthy", "*.json"))
	if len(fixtures) == 0 {
		t.Fatal("no healthy fixtures")
	}
	for _, fx := range fixtures {
		if all := Run(readWindow(t, fx)); len(all) != 0 {
			t.Errorf("%s gives findings:\n%s", fx, render(all))
		}
	}
}

// TestRulesGolden runs every rule on the fixtures of testdata/<rule>/ and
// compares its findings with the .golden file beside each fixture; -update
// rewrites them. Every rule has at least one sick fixture, and every
// finding says how recent its evidence is.
func TestRulesGolden(t *testing.T) {
	for _, rule := range Rules() {
		t.Run(rule.Name, func(t *testing.T) {
			fixtures, err := filepath.Glob(filepath.Join("testdata", rule.Name, "*.json"))
			if err != nil {
				t.Fatal(err)
			}
			if len(fixtures) == 0 {
				t.Fatalf("testdata/%s needs a sick fixture", rule.Name)
			}
			for _, fx := range fixtures {
				name := strings.TrimSuffix(filepath.Base(fx), ".json")
				t.Run(name, func(t *testing.T) {
					w := readWindow(t, fx)
					got := RunRules([]Rule{rule}, w)
					for _, f := range got {
						if f.Rule != rule.Name || f.Severity == 0 || f.Severity > rule.Severity || f.Summary == "" || f.Remedy == "" || len(f.Evidence) == 0 || f.Seen == "" {
							t.Errorf("malformed finding %+v", f)
						}
					}
					if len(got) == 0 {
						t.Errorf("sick fixture gives no finding")
					}
					golden := strings.TrimSuffix(fx, ".json") + ".golden"
					text := render(got)
					if *update {
						if err := os.WriteFile(golden, []byte(text), 0o644); err != nil {
							t.Fatal(err)
						}
						return
					}
					want, err := os.ReadFile(golden)
					if err != nil {
						t.Fatalf("%v (run go test ./diag -update)", err)
					}
					if text != string(want) {
						t.Errorf("%s: findings differ\n--- got\n%s--- want\n%s", golden, text, want)
					}
				})
			}
		})
	}
}

var kebab = regexp.MustCompile(`^[a-z0-9]+(-[a-z0-9]+)*$`)

// TestRulesRegistry checks the registry: unique kebab-case names, a doc
// sentence, a severity, a check, and one file per rule.
func TestRulesRegistry(t *testing.T) {
	seen := map[string]bool{}
	for _, r := range Rules() {
		if !kebab.MatchString(r.Name) || seen[r.Name] {
			t.Errorf("rule name %q: not kebab-case or not unique", r.Name)
		}
		seen[r.Name] = true
		if !strings.HasSuffix(r.Doc, ".") || r.Severity < Info || r.Severity > Critical || r.Check == nil {
			t.Errorf("rule %s: incomplete %+v", r.Name, r)
		}
		file := strings.ReplaceAll(r.Name, "-", "_") + ".go"
		if _, err := os.Stat(file); err != nil {
			t.Errorf("rule %s: no file %s", r.Name, file)
		}
		if !strings.Contains(docText(t), r.Name) {
			t.Errorf("rule %s is not listed in doc.go", r.Name)
		}
	}
	a, b := Rules(), Rules()
	for i := range a {
		if a[i].Name != b[i].Name {
			t.Fatal("Rules() order is not stable")
		}
	}
}

func docText(t *testing.T) string {
	data, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// TestRunSorts checks that Run orders findings by severity, rule, server,
// rank.
func TestRunSorts(t *testing.T) {
	mk := func(name string, sev Severity, server string, rank int) Rule {
		return Rule{Name: name, Severity: sev, Check: func(Window) []Finding {
			f := Finding{Rule: name, Severity: sev, Server: server}
			if rank >= 0 {
				f.Rank = AtRank(rank)
			}
			return []Finding{f}
		}}
	}
	got := RunRules([]Rule{
		mk("a", Info, "http://a", 0), mk("b", Warning, "http://b", 1), mk("c", Critical, "http://b", 0),
		mk("d", Critical, "http://a", 1), mk("e", Critical, "http://a", -1), mk("f", Warning, "http://a", 2),
		mk("c", Critical, "http://a", 3),
	}, Window{})
	var order []string
	for _, f := range got {
		order = append(order, f.Rule)
	}
	// Critical: c's two (rule c comes first, its http://a finding before
	// its http://b one), then d, then e; warning: b, then f; info: a.
	if want := "c c d e b f a"; strings.Join(order, " ") != want {
		t.Errorf("order %q, want %q", strings.Join(order, " "), want)
	}
}

// TestEmptyWindow: no samples, one sample or unreachable-free empty
// clusters give no finding and no panic.
func TestEmptyWindow(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, w := range []Window{{}, {Samples: []Sample{{Taken: now}}}, {Samples: []Sample{{Taken: now, Servers: []ServerSample{{Server: Server{URL: "http://x"}, Reachable: true}}}}}} {
		if fs := Run(w); len(fs) != 0 {
			t.Errorf("findings on %+v:\n%s", w, render(fs))
		}
	}
}

// TestFindingJSON: severities travel as their names; a finding about the
// whole server has "rank": null, one about a rank its number (0 included).
func TestFindingJSON(t *testing.T) {
	for _, tc := range []struct {
		rank *int
		want string
	}{{nil, `"rank":null`}, {AtRank(0), `"rank":0`}, {AtRank(3), `"rank":3`}} {
		f := Finding{Rule: "x", Severity: Warning, Server: "http://s", Rank: tc.rank}
		data, err := json.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(data), `"severity":"warning"`) || !strings.Contains(string(data), tc.want) {
			t.Errorf("got %s, want severity warning and %s", data, tc.want)
		}
		var back Finding
		if err := json.Unmarshal(data, &back); err != nil || back.Severity != Warning || back.Where() != f.Where() {
			t.Errorf("round trip: %+v, %v", back, err)
		}
	}
	if w := (Finding{Server: "http://s"}).Where(); w != "http://s" {
		t.Errorf("server-level Where %q", w)
	}
	if w := (Finding{Server: "http://s", Rank: AtRank(0)}).Where(); w != "http://s rank 0" {
		t.Errorf("rank 0 Where %q", w)
	}
}

// TestMassAbortWedge: on the wedge of incident 1 the whole rule set names
// the dead bootstrap loop on the right prefill rank, the fault, and the
// stuck decode transfer queue, most urgent first.
func TestMassAbortWedge(t *testing.T) {
	fs := Run(readWindow(t, filepath.Join("testdata", "pd-queue-stuck", "mass_abort_wedge.json")))
	var dead, stuck bool
	for _, f := range fs {
		switch {
		case f.Rule == "control-loop-dead" && f.Server == "http://prefill-0:30000" && f.Rank != nil && *f.Rank == 1:
			dead = strings.Contains(f.Remedy, "bootstrap-abort-crash")
		case f.Rule == "pd-queue-stuck" && f.Server == "http://decode-0:30100" && f.Severity == Critical &&
			slices.Contains(f.Evidence, Evidence{Key: "queue", Value: "transfer"}):
			stuck = true
		}
	}
	if !dead || !stuck || fs[0].Severity != Critical {
		t.Errorf("dead loop named %v, stuck transfer named %v in:\n%s", dead, stuck, render(fs))
	}
}

// TestConfig: overriding the servers' timeouts with longer ones silences
// the findings they no longer justify.
func TestConfig(t *testing.T) {
	w := readWindow(t, filepath.Join("testdata", "pd-entry-overdue", "overdue.json"))
	c := DefaultConfig()
	c.Overrides.Transfer = time.Minute
	c.Overrides.Bootstrap = time.Minute
	c.Overrides.Inflight = time.Minute
	if fs := RunRules(RulesWith(c), w); len(fs) != 0 {
		t.Errorf("findings with one-minute timeouts:\n%s", render(fs))
	}
	if fs := Run(w); len(fs) == 0 {
		t.Error("no finding with the servers' own timeouts")
	}
}

// TestGoldenHaveFixtures: no golden file outlives its fixture.
func TestGoldenHaveFixtures(t *testing.T) {
	goldens, _ := filepath.Glob(filepath.Join("testdata", "*", "*.golden"))
	for _, g := range goldens {
		if _, err := os.Stat(strings.TrimSuffix(g, ".golden") + ".json"); err != nil {
			t.Errorf("%s has no fixture", g)
		}
	}
	dirs, _ := filepath.Glob(filepath.Join("testdata", "*"))
	for _, d := range dirs {
		if filepath.Base(d) != "healthy" && !slices.ContainsFunc(Rules(), func(r Rule) bool { return r.Name == filepath.Base(d) }) {
			t.Errorf("%s names no rule", d)
		}
	}
}

// TestPublishedTimeouts: pd-entry-overdue judges each server by the PD
// timeouts it publishes. In published_timeouts.json the prefill publishes
// one-minute bootstrap and inflight timeouts (its 12.5s and 15s rooms are
// not overdue, though they would be under pdserve's defaults) and the
// decode a 20s transfer and 15s bootstrap timeout (both transfer rooms,
// 29s and 31.5s, are overdue; its 11.9s prealloc room is not). Without
// settings nothing is judged; an override replaces what a server
// publishes.
// An entry that publishes its own deadline is judged by it: a room queued
// for memory (a lease its peer renews) long past the state's timeout is not
// overdue, and one past its deadline is, whatever the timeout says.
func TestEntryDeadlines(t *testing.T) {
	w := readWindow(t, filepath.Join("testdata", "pd-entry-overdue", "published_timeouts.json"))
	rule := ruleByName(t, "pd-entry-overdue")
	last := &w.Samples[len(w.Samples)-1]
	in, past := 5000.0, -5000.0
	n := 0
	for i := range last.Servers {
		if last.Servers[i].PD == nil {
			continue
		}
		for r := range last.Servers[i].PD.Ranks {
			for e := range last.Servers[i].PD.Ranks[r].Entries {
				en := &last.Servers[i].PD.Ranks[r].Entries[e]
				en.DeadlineInMS, en.Leased = &in, true // every entry within its lease
				n++
			}
		}
	}
	if n == 0 {
		t.Fatal("the fixture has no PD entries")
	}
	if fs := rule.Check(w); len(fs) != 0 {
		t.Errorf("entries within their leases reported overdue: %v", fs)
	}
	var first *debug.PDEntry
	for _, s := range last.Servers {
		if s.PD != nil && len(s.PD.Ranks) > 0 && len(s.PD.Ranks[0].Entries) > 0 {
			first = &s.PD.Ranks[0].Entries[0]
			break
		}
	}
	first.DeadlineInMS = &past
	if fs := rule.Check(w); len(fs) != 1 {
		t.Errorf("one entry past its deadline: %d findings %v, want 1", len(fs), fs)
	}
}

func TestPublishedTimeouts(t *testing.T) {
	w := readWindow(t, filepath.Join("testdata", "pd-entry-overdue", "published_timeouts.json"))
	rule := ruleByName(t, "pd-entry-overdue")
	var got []string
	for _, f := range rule.Check(w) {
		got = append(got, fmt.Sprintf("%s %s", f.Where(), f.Summary))
	}
	want := []string{
		"http://decode-0:30100 rank 0 2 of 2 rooms in the transfer queue of decode rank 0 are past their deadline (the transfer timeout 20s, or their lease)",
		"http://decode-0:30100 rank 1 2 of 2 rooms in the transfer queue of decode rank 1 are past their deadline (the transfer timeout 20s, or their lease)",
	}
	if !slices.Equal(got, want) {
		t.Errorf("findings with the published timeouts:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// The same queues under another server's settings give another verdict.
	last := &w.Samples[len(w.Samples)-1]
	if d := last.Server("http://decode-0:30100"); d != nil {
		d.Settings.PD.TransferTimeoutMS = 30000
	}
	for _, f := range rule.Check(w) {
		if strings.Contains(f.Summary, "transfer") && f.Evidence[1].Value != "1 of 2" {
			t.Errorf("with a 30s transfer timeout: %s %+v", f.Summary, f.Evidence)
		}
	}

	// An override wins over what the server publishes.
	c := DefaultConfig()
	c.Overrides.Bootstrap = 10 * time.Second
	if fs := pdEntryOverdue(c).Check(w); !slices.ContainsFunc(fs, func(f Finding) bool {
		return f.Server == "http://prefill-0:30000" && strings.Contains(f.Summary, "(the bootstrap timeout 10s, or their lease)")
	}) {
		t.Errorf("a 10s bootstrap override does not flag the prefill's 12.5s room:\n%s", render(fs))
	}

	// A server that publishes no settings is not judged by guessed timeouts.
	for i := range last.Servers {
		last.Servers[i].Settings = nil
	}
	if fs := rule.Check(w); len(fs) != 0 {
		t.Errorf("findings without settings:\n%s", render(fs))
	}
}

// TestLimitsOf: a server's heartbeat raises the collective wait, the loop
// stall and the grace it is judged by; the overrides replace its timeouts
// field by field.
func TestLimitsOf(t *testing.T) {
	c := DefaultConfig()
	c.Overrides.AbortAck = time.Second
	s := &ServerSample{Settings: &debug.Settings{HeartbeatMS: 1500, PD: &debug.PDSettings{BootstrapTimeoutMS: 4000, TransferTimeoutMS: 8000,
		InflightTimeoutMS: 6000, AbortAckTimeoutMS: 2000}}}
	got := c.LimitsOf(s)
	want := Limits{Timeouts: Timeouts{Bootstrap: 4 * time.Second, Transfer: 8 * time.Second, Inflight: 6 * time.Second, AbortAck: time.Second},
		Grace: 3 * time.Second, CollectiveWait: 3 * time.Second, LoopStall: 3 * time.Second}
	if got != want {
		t.Errorf("limits %+v, want %+v", got, want)
	}
	if got := c.LimitsOf(&ServerSample{}); got != (Limits{Timeouts: Timeouts{AbortAck: time.Second}, Grace: c.Grace,
		CollectiveWait: c.CollectiveWait, LoopStall: c.LoopStall}) {
		t.Errorf("limits without settings %+v", got)
	}
}

// TestRegistryMismatch: a prefill rank registered at another endpoint than
// its socket's is named; the same endpoint, or a wildcard bind on the
// registered port, is not.
func TestRegistryMismatch(t *testing.T) {
	sample := func(registered, own string) Window {
		s := ServerSample{Server: Server{URL: "http://p", Role: "prefill", TPSize: 1}, Reachable: true,
			PD:       &debug.PDResponse{Role: "prefill", Ranks: []debug.PDRank{{Rank: 0, Socket: debug.PDSocket{Endpoint: own}}}},
			Registry: &pdproto.LookupResponse{Complete: true, TPSize: 1, Ranks: []pdproto.RankInfo{{Rank: 0, Endpoint: registered}}}}
		return Window{Samples: []Sample{{Servers: []ServerSample{s}}}}
	}
	fs := checkRegistryMismatch(sample("tcp://203.0.113.9:5555", "tcp://10.0.0.2:41000"))
	if len(fs) != 1 || fs[0].Rank == nil || *fs[0].Rank != 0 || !strings.Contains(fs[0].Summary, "203.0.113.9:5555") {
		t.Fatalf("hijacked registration: %+v", fs)
	}
	// The rank advertises a name while it binds an address: the registry
	// is compared with what it advertises.
	w := sample("tcp://prefill-0.pdkit-prefill:41000", "tcp://10.0.0.2:41000")
	w.Samples[0].Servers[0].PD.Ranks[0].Socket.Advertised = "tcp://prefill-0.pdkit-prefill:41000"
	if fs := checkRegistryMismatch(w); len(fs) != 0 {
		t.Errorf("an advertised name: %+v", fs)
	}
	w.Samples[0].Servers[0].PD.Ranks[0].Socket.Advertised = "tcp://prefill-1.pdkit-prefill:41000"
	if fs := checkRegistryMismatch(w); len(fs) != 1 {
		t.Errorf("registered another name than the advertised one: %+v", fs)
	}
	for _, c := range [][2]string{{"tcp://10.0.0.2:41000", "tcp://10.0.0.2:41000"}, {"tcp://10.0.0.2:41000", "tcp://0.0.0.0:41000"}} {
		if fs := checkRegistryMismatch(sample(c[0], c[1])); len(fs) != 0 {
			t.Errorf("registered %s, listening %s: %+v", c[0], c[1], fs)
		}
	}
}

// KV that reached a decode rank and waits for its loop is not in transit:
// with the window's KV pending in the rank's mailbox, pd-link-slow says
// nothing (a busy or stalled decode loop is not a slow link).
func TestPDLinkSlowCountsPendingAsLanded(t *testing.T) {
	w := readWindow(t, filepath.Join("testdata", "pd-link-slow", "slow_link.json"))
	if got := checkPDLinkSlow(w); len(got) == 0 {
		t.Fatal("the fixture gives no finding to start with")
	}
	for i := range w.Samples {
		for j := range w.Samples[i].Servers {
			if pd := w.Samples[i].Servers[j].PD; pd != nil && pd.Role == "decode" {
				for k := range pd.Ranks {
					pd.Ranks[k].PendingKVBytes = 1 << 30
				}
			}
		}
	}
	if got := checkPDLinkSlow(w); len(got) != 0 {
		t.Errorf("with the KV pending in the mailbox: %s", render(got))
	}
}
