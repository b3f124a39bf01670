package tui

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	tea "charm.land/bubbletea/v2"
	"github.com/charmbracelet/x/ansi"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
)

// stallAt is the sample from which the diverged cluster's decode holds its
// last rank (stall-last-rank at TP 2).
const stallAt = 14

// cluster builds 21 samples, one a second, of a router, a prefill and a
// decode server at TP 2 (the healthy/busy fixture's servers) with steps
// that advance at a varying rate. diverged: from sample stallAt on, the
// decode's fault stall-last-rank holds rank 1 before its next collective:
// neither rank finishes a step again, rank 0 waits in the control
// communicator's step-input Broadcast, rank 1 in no collective.
func cluster(t *testing.T, diverged bool) []Sample {
	t.Helper()
	tmpl, err := json.Marshal(window(t, "healthy/busy")[2])
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	steps := map[string]uint64{"http://prefill-0:30000": 4200, "http://decode-0:30100": 5100}
	var out []Sample
	for i := range 21 {
		var s Sample
		if err := json.Unmarshal(tmpl, &s); err != nil {
			t.Fatal(err)
		}
		s.Taken = t0.Add(time.Duration(i) * time.Second)
		s.HiCache = map[string]*debug.HiCacheResponse{}
		s.Router = &diag.RouterSample{URL: "http://router:8000", Reachable: true, Outcomes: map[string]uint64{"ok": uint64(300 + 20*i)}}
		for j := range s.Servers {
			sv := &s.Servers[j]
			// The PD queues move: no room stays long in one.
			for k := range sv.PD.Ranks {
				sv.PD.Ranks[k].Counts, sv.PD.Ranks[k].Entries = map[string]int{}, nil
			}
			s.HiCache[sv.URL] = &debug.HiCacheResponse{PrefixCache: true, On: true, Ranks: []debug.HiCacheRank{
				{Rank: 0, On: true, HostTokens: 8192, HostTokensUsed: 1000 + 40*i}, {Rank: 1, On: true, HostTokens: 8192, HostTokensUsed: 1000 + 40*i}}}
			held := diverged && sv.Role == "decode" && i >= stallAt
			if i > 0 && !held {
				steps[sv.URL] += uint64(20 + 10*j + (i*7)%11)
			}
			step, end := steps[sv.URL], s.Taken.Add(-4*time.Millisecond)
			if held {
				end = t0.Add(stallAt*time.Second - time.Second + 3*time.Millisecond)
			}
			for k := range sv.Steps.Ranks {
				r := &sv.Steps.Ranks[k]
				r.Loop, r.Step, r.ControlSeq, r.ForwardSeq = "lockstep", step, 3*step, 4*step
				r.Start, r.End = end.Add(-8*time.Millisecond), end
			}
			sv.Steps.Agree, sv.Steps.Spread = true, 0
			for c := range sv.Collectives.Comms {
				cm := &sv.Collectives.Comms[c]
				for k := range cm.Ranks {
					cr := &cm.Ranks[k]
					cr.Waiting = nil
					cr.LastEntered = step * uint64(3+c)
					cr.LastCompleted = cr.LastEntered
					switch {
					case held && cm.Name == debug.CommControl && cr.Rank == 0:
						cr.LastEntered++
						cr.Waiting = &debug.Collective{Seq: cr.LastEntered, Op: "Broadcast", Elem: "uint8", Bytes: 96, Start: end, Waiting: true,
							DurationMS: float64(s.Taken.Sub(end).Milliseconds())}
					case !held && cm.Name == debug.CommForward && cr.Rank == 1 && sv.Role == "decode":
						cr.LastEntered++
						cr.Waiting = &debug.Collective{Seq: cr.LastEntered, Op: "AllReduceSum", Elem: "float32", Bytes: 4096,
							Start: s.Taken.Add(-2 * time.Millisecond), Waiting: true, DurationMS: 2}
					}
				}
			}
			if held {
				sv.Faults = &debug.FaultsResponse{Faults: []debug.Fault{{Name: "stall-last-rank", Roles: []string{"colocated", "prefill", "decode"},
					Doc: "the highest TP rank stops before its next collective", On: true}}}
				st := *sv.Settings
				st.FaultsOn = []string{"stall-last-rank"}
				sv.Settings = &st
			}
		}
		out = append(out, s)
	}
	return out
}

// modelOf is the model after it has taken every sample of w, on a screen
// of the size given, at the time of the last sample.
func modelOf(t *testing.T, w []Sample, width, height int) *Model {
	t.Helper()
	m := New(t.Context(), Options{Interval: time.Second, Source: "http://router:8000", Config: diag.DefaultConfig(),
		Now: func() time.Time { return w[len(w)-1].Taken }})
	m.Update(tea.WindowSizeMsg{Width: width, Height: height})
	for _, s := range w {
		m.Update(sampleMsg{sample: s})
	}
	return m
}

// TestTopGolden renders the whole screen of a healthy and a diverged
// (stall-last-rank at TP 2) cluster after 21 samples, at 80×24 and
// 200×50, against testdata/top_<cluster>_<size>.golden (go test ./tui
// -update rewrites them). Every frame fits its screen; in the diverged
// ones the held rank and the waiting one are marked and named, with their
// rank, step, Δ and the call waited in, however narrow the screen.
func TestTopGolden(t *testing.T) {
	for _, tc := range []struct {
		name     string
		diverged bool
	}{{"healthy", false}, {"diverged", true}} {
		for _, size := range [][2]int{{80, 24}, {200, 50}} {
			name := fmt.Sprintf("%s_%dx%d", tc.name, size[0], size[1])
			t.Run(name, func(t *testing.T) {
				m := modelOf(t, cluster(t, tc.diverged), size[0], size[1])
				got := m.screen(false)
				golden := filepath.Join("testdata", "top_"+name+".golden")
				if *update {
					if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				want, err := os.ReadFile(golden)
				if err != nil {
					t.Fatalf("%v (go test ./tui -update)", err)
				}
				if got != string(want) {
					t.Errorf("screen differs\n--- got\n%s--- want\n%s", got, want)
				}
				lines := strings.Split(strings.TrimSuffix(got, "\n"), "\n")
				if len(lines) > size[1] {
					t.Errorf("%d lines on a screen of %d", len(lines), size[1])
				}
				for _, l := range lines {
					if w := ansi.StringWidth(l); w > size[0] {
						t.Errorf("a line of %d cells on a screen of %d: %q", w, size[0], l)
					}
					if strings.HasSuffix(l, "…") && strings.HasPrefix(strings.TrimSpace(l), "!") {
						t.Errorf("a marked rank's line is cut: %q", l)
					}
				}
				if !strings.HasSuffix(got, "\n"+DefaultKeyMap.HelpLine()+"\n") {
					t.Errorf("no help line from the keymap at the bottom:\n%s", got)
				}
				if !tc.diverged {
					if strings.Contains(got, "DIVERGED") || strings.Contains(got, "\n!") {
						t.Errorf("a healthy cluster marked diverged:\n%s", got)
					}
					return
				}
				for _, want := range []string{
					"DIVERGED: rank 1 not in control seq 16666", // the held rank first

					"critical rank-divergence http://decode-0:30100 rank 0",
				} {
					if !strings.Contains(got, want) {
						t.Errorf("no %q:\n%s", want, got)
					}
				}
				// Each rank's line keeps its rank, step, Δ, the call and the wait.
				for _, re := range []string{`\n! +0 .*5555 +0 +control seq 16666 Broadcast +7s`, `\n! +1 .*5555 +0 +not in control seq 16666 +-`} {
					if !matches(re, got) {
						t.Errorf("no line %s:\n%s", re, got)
					}
				}
			})
		}
	}
}

func matches(re, s string) bool { return regexp.MustCompile(re).MatchString(s) }

// TestKeyMap: the keys the model acts on are the keymap's, and the help
// line names each binding.
func TestKeyMap(t *testing.T) {
	for _, b := range DefaultKeyMap.Bindings() {
		if !strings.Contains(DefaultKeyMap.HelpLine(), b.Help+" "+b.Desc) {
			t.Errorf("the help line %q lacks %q", DefaultKeyMap.HelpLine(), b.Help+" "+b.Desc)
		}
		for _, k := range b.Keys {
			if k == "ctrl+c" {
				continue
			}
			if !b.Matches(keyPress(k)) {
				t.Errorf("%s does not match its key %q", b.Desc, k)
			}
		}
	}
	if DefaultKeyMap.Quit.Matches(keyPress("r")) || !DefaultKeyMap.Refresh.Matches(keyPress("r")) {
		t.Error("r matches the wrong binding")
	}
}

// TestHistory: rates are steps per second between two samples, the last n
// kept; a server not read keeps its history; a lower step (a restart)
// starts it again. The sparkline scales to the top rate, a stop reads "·".
func TestHistory(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	h := NewHistory(3)
	sample := func(i int, step uint64, reachable bool) diag.Sample {
		return diag.Sample{Taken: t0.Add(time.Duration(i) * 500 * time.Millisecond), Servers: []diag.ServerSample{{Server: diag.Server{URL: "s"},
			Reachable: reachable, Steps: &debug.StepsResponse{Ranks: []debug.Step{{Rank: 0, Step: step}}}}}}
	}
	for i, st := range []uint64{10, 20, 20, 25, 45} {
		h.Add(sample(i, st, true))
	}
	h.Add(sample(5, 0, false))
	if got := fmt.Sprint(h.Rates("s", 0)); got != "[0 10 40]" {
		t.Errorf("rates %s", got)
	}
	if got := sparkline(h.Rates("s", 0), 5, 40); got != "  ·▃█" {
		t.Errorf("sparkline %q", got)
	}
	h.Add(sample(6, 3, true))
	if got := h.Rates("s", 0); got != nil {
		t.Errorf("after a restart: %v", got)
	}
}

// TestRanksPanelNarrow: however narrow the screen, a stalled rank's line
// keeps its mark, rank, step, Δ, the call and the wait; the sparkline and
// the lesser columns go first.
func TestRanksPanelNarrow(t *testing.T) {
	w := cluster(t, true)
	for _, width := range []int{60, 70, 80, 100, 120} {
		o := FrameOptions{Width: width, Config: diag.DefaultConfig(), Now: w[len(w)-1].Taken}
		f := Frame(w[len(w)-6:], o)
		for _, re := range []string{`\n! +0 +(- +|lockstep +)?(decode +)?5555 +0 +control seq 16666 Broadcast +7s`, `\n! +1 +(- +|lockstep +)?(decode +)?5555 +0 +not in control seq 16666 +-`} {
			if !matches(re, f) {
				t.Errorf("width %d: no line %s:\n%s", width, re, f)
			}
		}
		if width < 80 && strings.Contains(f, "KV USED") {
			t.Errorf("width %d keeps the KV column:\n%s", width, f)
		}
	}
}
