package tui

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	tea "charm.land/bubbletea/v2"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/waitfor"
)

var update = flag.Bool("update", false, "rewrite the golden frames in testdata")

// window reads a diag fixture: a window of samples from a sick or healthy
// cluster.
func window(t *testing.T, name string) []Sample {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "diag", "testdata", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var w diag.Window
	if err := json.Unmarshal(data, &w); err != nil {
		t.Fatal(err)
	}
	out := make([]Sample, len(w.Samples))
	for i, s := range w.Samples {
		out[i] = Sample{Sample: s}
	}
	return out
}

// TestFrameGolden renders the diag fixtures as plain frames, at the time of
// their last sample, against testdata/<name>.golden (go test ./tui -update
// rewrites them).
func TestFrameGolden(t *testing.T) {
	for _, name := range []string{"healthy/busy", "rank-divergence/collective_desync", "rank-divergence/control_vs_forward", "control-loop-dead/bootstrap_abort_crash", "peer-unreachable/server_down",
		"requests-failing/bootstrap_timeouts", "requests-failing/peer_lost_no_router"} {
		t.Run(name, func(t *testing.T) {
			w := window(t, name)
			got := Frame(w, FrameOptions{Source: "http://router:8000", Interval: time.Second, Config: diag.DefaultConfig(), Now: w[len(w)-1].Taken})
			golden := filepath.Join("testdata", strings.ReplaceAll(name, "/", "_")+".golden")
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
				t.Errorf("frame differs\n--- got\n%s--- want\n%s", got, want)
			}
		})
	}
}

// TestServerRowsIndexKAndHiCache: each server's line shows its index-K
// precision (a switch under way, a model without an indexer) and its host
// tier summed over its ranks (on with the tokens used/total, some ranks
// only, off, no prefix cache, not known).
func TestServerRowsIndexKAndHiCache(t *testing.T) {
	w := window(t, "healthy/busy")
	last := w[len(w)-1]
	last.Servers = slices.Clone(last.Servers)
	p, d := last.Servers[0], last.Servers[1]
	ps, ds := *p.Settings, *d.Settings
	ps.IndexK, ps.IndexKSwitch = "fp8", "bf16"
	ds.IndexK, ds.Indexer = "bf16", true
	p.Settings, d.Settings = &ps, &ds
	plainSrv := p
	plainSrv.URL = "http://plain:8000"
	plainSettings := ps
	plainSettings.Indexer, plainSettings.IndexKSwitch = false, ""
	plainSrv.Settings = &plainSettings
	unknown := d
	unknown.URL, unknown.Settings = "http://old:8000", nil
	last.Servers = []diag.ServerSample{p, d, plainSrv, unknown}
	rank := func(r int, on bool, used, total int) debug.HiCacheRank {
		return debug.HiCacheRank{Rank: r, On: on, HostTokensUsed: used, HostTokens: total}
	}
	last.HiCache = map[string]*debug.HiCacheResponse{
		p.URL:        {PrefixCache: true, On: true, Ranks: []debug.HiCacheRank{rank(0, true, 1216, 8192), rank(1, true, 960, 8192)}},
		d.URL:        {PrefixCache: true, Ranks: []debug.HiCacheRank{rank(0, true, 40, 512), rank(1, false, 0, 0)}},
		plainSrv.URL: {PrefixCache: false, Ranks: []debug.HiCacheRank{}},
	}
	servers, _ := Rows(last, diag.DefaultConfig(), last.Taken)
	var got []string
	for _, r := range servers {
		got = append(got, r[0]+" "+r[9]+" "+r[10])
	}
	want := []string{"SERVER INDEX-K HICACHE", "http://prefill-0:30000 fp8 (switching to bf16) on 2.2k/16.4k",
		"http://decode-0:30100 bf16 on 40/512 (1 of 2 ranks)", "http://plain:8000 n/a n/a", "http://old:8000 - -"}
	if !slices.Equal(got, want) {
		t.Errorf("servers:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	last.HiCache[d.URL] = &debug.HiCacheResponse{PrefixCache: true, Ranks: []debug.HiCacheRank{rank(0, false, 0, 0)}}
	if servers, _ = Rows(last, diag.DefaultConfig(), last.Taken); servers[2][10] != "off" {
		t.Errorf("a tier off on every rank: %q", servers[2][10])
	}
}

// TestFrameStyled: a styled frame marks a diverged rank's cells, failures
// that grew and the findings with ANSI styles, a plain one has none; Width
// cuts every line.
func TestFrameStyled(t *testing.T) {
	w := window(t, "rank-divergence/step_spread")
	o := FrameOptions{Config: diag.DefaultConfig(), Now: w[len(w)-1].Taken}
	if p := Frame(w, o); strings.Contains(p, "\x1b[") {
		t.Errorf("plain frame has escape sequences:\n%q", p)
	}
	o.Styled = true
	s := Frame(w, o)
	if !strings.Contains(s, "\x1b[") || !strings.Contains(s, "-10") {
		t.Errorf("styled frame:\n%q", s)
	}
	// Requests failed over the window: the FAILED cells that grew are
	// marked critical, the others not.
	rf := window(t, "requests-failing/bootstrap_timeouts")
	fs := Frame(rf, FrameOptions{Styled: true, Config: diag.DefaultConfig(), Now: rf[len(rf)-1].Taken})
	if !strings.Contains(fs, styleCritical.Render("9 (+7)")) || strings.Contains(fs, styleCritical.Render("0")) {
		t.Errorf("styled FAILED cells:\n%q", fs)
	}
	o.Styled, o.Width = false, 30
	for _, l := range strings.Split(Frame(w, o), "\n") {
		if n := len([]rune(l)); n > 30 {
			t.Errorf("line of %d cells with width 30: %q", n, l)
		}
	}
}

// run drives m with msgs the way the program would: each command's
// message (a batch's first) is fed back until none is left.
func keyPress(s string) tea.KeyPressMsg {
	switch s {
	case "space":
		return tea.KeyPressMsg{Code: tea.KeySpace, Text: " "}
	case "esc":
		return tea.KeyPressMsg{Code: tea.KeyEscape}
	}
	return tea.KeyPressMsg{Code: rune(s[0]), Text: s}
}

// TestModel: the first command samples; a sample is kept and schedules the
// next tick; a tick samples unless paused; r samples at once (once: not
// while a sample is in flight); q quits; a failed sample is shown and the
// samples kept; samples older than the window go.
func TestModel(t *testing.T) {
	start := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	calls := 0
	var fail error
	fetch := func(context.Context) (Sample, error) {
		calls++
		return Sample{Sample: diag.Sample{Taken: start.Add(time.Duration(calls) * time.Second)}}, fail
	}
	m := New(t.Context(), Options{Fetch: fetch, Interval: time.Second, Window: 3 * time.Second, Source: "src",
		Now: func() time.Time { return start }})
	cmd := m.Init()
	if cmd == nil {
		t.Fatal("Init: no command")
	}
	if m.Update(keyPress("r")); m.fetching != true || calls != 0 {
		t.Fatal("r while a sample is in flight started another")
	}
	msg := cmd()
	if _, next := m.Update(msg); next == nil || len(m.Samples()) != 1 {
		t.Fatalf("after a sample: %d kept, next %v", len(m.Samples()), next)
	}
	// Ticks sample; the window keeps the last 3s.
	for range 5 {
		_, c := m.Update(tickMsg{})
		m.Update(c())
	}
	if got := len(m.Samples()); got != 4 || !m.Samples()[0].Taken.Equal(start.Add(3*time.Second)) {
		t.Errorf("kept %d samples, the first at %v", got, m.Samples()[0].Taken)
	}
	// Paused: a tick does nothing; resuming samples.
	m.Update(keyPress("p"))
	if _, c := m.Update(tickMsg{}); c != nil {
		t.Error("a tick sampled while paused")
	}
	if !strings.Contains(m.View().Content, "PAUSED") {
		t.Error("the view does not say PAUSED")
	}
	_, c := m.Update(keyPress("space"))
	if c == nil {
		t.Fatal("resuming did not sample")
	}
	// A failed sample: shown, the samples kept.
	fail = errors.New("router down")
	m.Update(c())
	if v := m.View().Content; !strings.Contains(v, "sampling failed: router down") || len(m.Samples()) != 4 {
		t.Errorf("after a failed sample (%d kept):\n%s", len(m.Samples()), v)
	}
	if !m.View().AltScreen {
		t.Error("the view is not in the alternate screen")
	}
	for _, k := range []string{"q", "esc"} {
		_, c = m.Update(keyPress(k))
		if c == nil {
			t.Fatalf("%s: no command", k)
		}
		if _, ok := c().(tea.QuitMsg); !ok {
			t.Errorf("%s does not quit", k)
		}
	}
}

// TestRun runs the real program on a pipe: it draws the fixture's frame,
// quits on q; and it ends with the context.
func TestRun(t *testing.T) {
	w := window(t, "rank-divergence/peer_not_in_collective")
	fetch := func(context.Context) (Sample, error) { return w[len(w)-1], nil }
	opts := Options{Fetch: fetch, Interval: 10 * time.Millisecond, Source: "test", Config: diag.DefaultConfig(), Width: 200, Height: 50}

	in, keys := io.Pipe()
	defer keys.Close()
	var out syncbuf.Buffer
	done := make(chan error, 1)
	go func() { done <- Run(t.Context(), in, &out, opts) }()
	if !waitfor.Poll(10*time.Second, func() bool { return strings.Contains(out.String(), "rank-divergence") }) {
		t.Fatalf("no frame with the finding within 10s:\n%q", out.String())
	}
	if _, err := keys.Write([]byte("q")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("q did not end the program")
	}

	ctx, cancel := context.WithCancel(t.Context())
	in2, keys2 := io.Pipe()
	defer keys2.Close()
	go func() { done <- Run(ctx, in2, &syncbuf.Buffer{}, opts) }()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Run after cancel: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the context's end did not end the program")
	}
}
