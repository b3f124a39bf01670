package server

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// indexKSwitch POSTs an index-K switch with the token and decodes its
// answer, wanting status want.
func (e *env) indexKSwitch(t *testing.T, dtype, query string, want int) debug.IndexKSwitchResponse {
	t.Helper()
	code, b := e.admin(t, debug.IndexKPath(dtype)+query, "tok", "")
	var r debug.IndexKSwitchResponse
	if code != want || json.Unmarshal(b, &r) != nil {
		t.Fatalf("POST %s%s: %d %s, want %d", debug.IndexKPath(dtype), query, code, b, want)
	}
	return r
}

// The index-K precision switched live through the admin API (behind its
// token): a request running when the drain bound (0s) has passed is aborted
// and counted, the switch shows in the settings, the state's totals and the
// pdkit_indexk_* metrics, a switch to the precision in use changes nothing,
// a bad drain or an unknown precision is a 400, and the server serves on in
// the new precision.
func TestIndexKAdmin(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 2, IndexK: kernels.IndexFP8}, Options{AdminToken: "tok"})
	var st debug.Settings
	getJSON(t, e, debug.SettingsPath, &st)
	if st.IndexK != "fp8" || !st.Indexer || st.IndexKSwitch != "" {
		t.Fatalf("settings at start: index_k %q, indexer %v, switch %q", st.IndexK, st.Indexer, st.IndexKSwitch)
	}
	x := scrape(t, e)
	for k, want := range map[string]float64{`pdkit_indexk_precision{dtype="fp8"}`: 1, `pdkit_indexk_precision{dtype="bf16"}`: 0, `pdkit_indexk_switches_total`: 0} {
		if v := x.must(t, k); v != want {
			t.Errorf("%s = %v at start, want %v", k, v, want)
		}
	}

	// Admin calls need the token; a drain must be a non-negative duration.
	for _, dt := range []string{debug.IndexKFP8, debug.IndexKBF16} {
		if code, b := e.admin(t, debug.IndexKPath(dt), "", ""); code != http.StatusUnauthorized {
			t.Errorf("POST %s without the token: %d %s", debug.IndexKPath(dt), code, b)
		}
	}
	for _, q := range []string{"?drain=soon", "?drain=-1s", "?drain=30"} {
		code, b := e.admin(t, debug.IndexKPath(debug.IndexKBF16)+q, "tok", "")
		var eb openai.ErrorBody
		if code != 400 || json.Unmarshal(b, &eb) != nil || eb.Error.Param == nil || *eb.Error.Param != "drain" {
			t.Errorf("drain %q: %d %s", q, code, b)
		}
	}
	if code, b := e.admin(t, "/admin/v1/indexk/int4", "tok", ""); code != http.StatusBadRequest || !strings.Contains(string(b), `unknown index-K precision \"int4\": want fp8 or bf16`) {
		t.Errorf("an unknown precision: %d %s", code, b)
	}

	// A request running past a drain of 0s is aborted by the switch.
	_, rd, closer := openStream(t, e, map[string]any{"prompt": prompt, "max_tokens": 400, "ignore_eos": true})
	defer closer.Close()
	r := e.indexKSwitch(t, debug.IndexKBF16, "?drain=0s", 200)
	if r.From != "fp8" || r.To != "bf16" || !r.Changed || r.Pending || r.Aborted != 1 || r.PausedMS <= 0 {
		t.Errorf("switch to bf16: %+v", r)
	}
	if s := readStream(t, rd); s.finish != openai.FinishAbort || !s.done {
		t.Errorf("the request the switch cut: %+v", s)
	}
	st = debug.Settings{}
	getJSON(t, e, debug.SettingsPath, &st)
	if st.IndexK != "bf16" || st.IndexKSwitch != "" {
		t.Errorf("settings after the switch: index_k %q, switch %q", st.IndexK, st.IndexKSwitch)
	}
	// The totals come with the loop's next published snapshot.
	waitfor.For(t, "the switch counted in the state's totals", 20*time.Second, func() bool {
		var state debug.StateResponse
		getJSON(t, e, debug.StatePath, &state)
		return state.Snapshot != nil && state.Snapshot.Totals.IndexKSwitches == 1 && state.Settings.IndexK == "bf16"
	})
	x = scrape(t, e)
	for k, want := range map[string]float64{`pdkit_indexk_precision{dtype="fp8"}`: 0, `pdkit_indexk_precision{dtype="bf16"}`: 1, `pdkit_indexk_switches_total`: 1} {
		if v := x.must(t, k); v != want {
			t.Errorf("%s = %v after the switch, want %v", k, v, want)
		}
	}

	// Again: nothing to do. The default drain applies without ?drain.
	if r := e.indexKSwitch(t, debug.IndexKBF16, "", 200); r.Changed || r.From != "bf16" || r.To != "bf16" || r.Aborted != 0 {
		t.Errorf("switch to bf16 again: %+v", r)
	}
	if c := e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 4, "ignore_eos": true}); len(c.Choices) != 1 || c.Choices[0].FinishReason != openai.FinishLength {
		t.Errorf("a request after the switch: %+v", c)
	}
	// Back to fp8 with a drain: the engine is idle, nothing is cut.
	if r := e.indexKSwitch(t, debug.IndexKFP8, "?drain=5s", 200); !r.Changed || r.From != "bf16" || r.To != "fp8" || r.Aborted != 0 {
		t.Errorf("switch back to fp8: %+v", r)
	}
	waitfor.For(t, "two switches counted", 20*time.Second, func() bool { return scrape(t, e).must(t, `pdkit_indexk_switches_total`) == 2 })
}

// A switch the loops cannot take (the last rank held by stall-last-rank)
// answers 202 once the drain bound and the margin have passed: the switch
// is under way, the settings say to what, and another switch is a 409
// naming it; once the rank goes on, the switch is done.
func TestIndexKSwitchPending(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, KVTokens: 64, MaxRunning: 2}, Options{AdminToken: "tok", IndexKMargin: 50 * time.Millisecond})
	if code, b := e.admin(t, "/admin/v1/faults/"+serve.FaultStallLastRank+"/on", "tok", ""); code != 200 {
		t.Fatalf("fault on: %d %s", code, b)
	}
	waitfor.For(t, "rank 0 waiting for rank 1 in a control collective", 20*time.Second, func() bool {
		var c debug.CollectivesResponse
		getJSON(t, e, "/debug/v1/collectives?stall=100ms", &c)
		ctrl := c.Comm(debug.CommControl)
		return ctrl != nil && slices.ContainsFunc(ctrl.Stalls, func(s debug.Stall) bool { return slices.Contains(s.Arrived, 0) })
	})
	r := e.indexKSwitch(t, debug.IndexKBF16, "?drain=0s", http.StatusAccepted)
	if !r.Pending || !r.Changed || r.From != "fp8" || r.To != "bf16" || r.PausedMS < 50 {
		t.Errorf("switch while stuck: %+v", r)
	}
	var st debug.Settings
	getJSON(t, e, debug.SettingsPath, &st)
	if st.IndexK != "fp8" || st.IndexKSwitch != "bf16" {
		t.Errorf("settings while the switch is under way: index_k %q, switch %q", st.IndexK, st.IndexKSwitch)
	}
	for _, dt := range []string{debug.IndexKFP8, debug.IndexKBF16} {
		code, b := e.admin(t, debug.IndexKPath(dt), "tok", "")
		if code != http.StatusConflict || !strings.Contains(string(b), "an index-K switch to bf16 is under way") {
			t.Errorf("POST %s while a switch is under way: %d %s", debug.IndexKPath(dt), code, b)
		}
	}
	if code, b := e.admin(t, "/admin/v1/faults/"+serve.FaultStallLastRank+"/off", "tok", ""); code != 200 {
		t.Fatalf("fault off: %d %s", code, b)
	}
	waitfor.For(t, "the switch done", 20*time.Second, func() bool {
		st = debug.Settings{} // index_k_switch is left out when empty
		getJSON(t, e, debug.SettingsPath, &st)
		return st.IndexK == "bf16" && st.IndexKSwitch == ""
	})
	waitfor.For(t, "the switch counted", 20*time.Second, func() bool { return scrape(t, e).must(t, `pdkit_indexk_switches_total`) == 1 })
}

// A model without a sparse indexer has no index-K precision: the switch is
// a 400 saying so, the settings say indexer false, and no pdkit_indexk_*
// metric is exported.
func TestIndexKNoIndexer(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	eng, err := serve.New(m, withCPU(serve.Config{PageSize: 4, MaxRunning: 2}))
	if err != nil {
		t.Fatal(err)
	}
	srv := New(eng, m, Options{ModelName: "tiny", Loopback: true, Logger: slog.New(slog.DiscardHandler)})
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	e := &env{m: m, eng: eng, srv: srv, ts: ts}
	code, b := e.admin(t, debug.IndexKPath(debug.IndexKBF16), "", "")
	if code != 400 || !strings.Contains(string(b), "no sparse indexer") {
		t.Errorf("switch without an indexer: %d %s", code, b)
	}
	var st debug.Settings
	getJSON(t, e, debug.SettingsPath, &st)
	if st.Indexer {
		t.Errorf("settings: indexer %v", st.Indexer)
	}
	if hasPrefix(scrape(t, e), "pdkit_indexk_") {
		t.Error("index-K metrics without an indexer")
	}
}
