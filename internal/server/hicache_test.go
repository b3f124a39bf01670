package server

import (
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// admin POSTs path with the bearer token tok (none when empty) and body,
// and returns the status and the body.
func (e *env) admin(t *testing.T, path, tok, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest("POST", e.ts.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := e.ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// hicacheSwitch POSTs an admin switch with the token and decodes its
// answer, wanting status want.
func (e *env) hicacheSwitch(t *testing.T, path, body string, want int) debug.HiCacheSwitchResponse {
	t.Helper()
	code, b := e.admin(t, path, "tok", body)
	var r debug.HiCacheSwitchResponse
	if code != want || json.Unmarshal(b, &r) != nil {
		t.Fatalf("POST %s: %d %s, want %d", path, code, b, want)
	}
	return r
}

// The host tier switched live through the admin API (behind its token):
// on, used (prefixes backed up, evicted from the device, loaded back),
// paced, then off; every step visible in GET /debug/v1/hicache, in the
// settings and in the pdkit_hicache_* metrics, which stay lint-clean.
func TestHiCacheAdmin(t *testing.T) {
	// Write-back: a prefix goes to host when the device evicts it.
	cfg := serve.Config{TP: 2, PageSize: 4, KVTokens: 128, MaxRunning: 2, HiCache: serve.HiCacheConfig{Ratio: 4, Policy: prefix.WriteBack}}
	e := newEnvWith(t, cfg, Options{AdminToken: "tok"})
	devPages := e.eng.Config().Pages()

	var h debug.HiCacheResponse
	getJSON(t, e, debug.HiCachePath, &h)
	if !h.PrefixCache || h.On || len(h.Ranks) != 2 || h.Ranks[1].Rank != 1 || h.Ranks[0].On || h.Ranks[0].HostPages != 0 ||
		h.Ranks[0].Policy != "write-back" || h.Ranks[0].PageSize != 4 || len(h.Ranks[0].WaitKVMS) == 0 || h.Ranks[0].Loads == nil {
		t.Fatalf("off at start: %+v", h)
	}
	x := scrape(t, e)
	for _, k := range []string{`pdkit_hicache_enabled{rank="0"}`, `pdkit_hicache_host_tokens_capacity{rank="1"}`,
		`pdkit_hicache_switches_total{direction="on"}`, `pdkit_prefix_unstalls_total`} {
		if v := x.must(t, k); v != 0 {
			t.Errorf("%s = %v at start", k, v)
		}
	}

	// Admin calls need the token.
	for _, p := range []string{debug.HiCacheOnPath, debug.HiCacheOffPath, debug.HiCacheBandwidthPath + "?bytes_per_second=1"} {
		if code, b := e.admin(t, p, "", ""); code != http.StatusUnauthorized {
			t.Errorf("POST %s without the token: %d %s", p, code, b)
		}
	}
	if code, _ := get(t, e, debug.HiCacheOnPath); code != http.StatusUnauthorized {
		t.Errorf("GET %s: %d", debug.HiCacheOnPath, code)
	}

	// On: every rank, the pool 4 × the device's.
	r := e.hicacheSwitch(t, debug.HiCacheOnPath, "", 200)
	if !r.Changed || r.Pending || !r.On || len(r.Ranks) != 2 {
		t.Fatalf("on: %+v", r)
	}
	for _, rk := range r.Ranks {
		if !rk.On || rk.HostPages != 4*devPages || rk.HostTokens != 4*devPages*4 {
			t.Errorf("rank %d on: %+v (device pool %d pages)", rk.Rank, rk, devPages)
		}
	}
	if r := e.hicacheSwitch(t, debug.HiCacheOnPath, "", 200); r.Changed || !r.On {
		t.Errorf("on again: %+v", r)
	}

	// Prompts that do not all fit the device pool: each evicts the oldest
	// ones' prefixes to host, and asking them again loads them back.
	var prompts []string
	for _, w := range []string{"alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"} {
		prompts = append(prompts, strings.Repeat(w+" ", 4))
	}
	for range 2 {
		for _, p := range prompts {
			e.complete(t, map[string]any{"prompt": p, "max_tokens": 2, "temperature": 0})
		}
	}
	waitIdle(t, e.eng)
	waitfor.For(t, "a prefix loaded back from host on every rank", 20*time.Second, func() bool {
		getJSON(t, e, debug.HiCachePath, &h)
		return !slices.ContainsFunc(h.Ranks, func(rk debug.HiCacheRank) bool { return rk.Totals.HostHits == 0 || len(rk.Loads) > 0 })
	})
	for _, rk := range h.Ranks {
		tt := rk.Totals
		if tt.Backups == 0 || tt.BackupBytes == 0 || tt.Loads == 0 || tt.LoadBytes == 0 || tt.HitTokens == 0 || tt.LoadFailures+tt.BackupFailures != 0 ||
			rk.HostPagesUsed == 0 || rk.HostTokensUsed != 4*rk.HostPagesUsed {
			t.Errorf("rank %d after host hits: %+v", rk.Rank, rk)
		}
	}
	x = scrape(t, e)
	for _, rank := range []string{"0", "1"} {
		rk := h.Ranks[0]
		if rank == "1" {
			rk = h.Ranks[1]
		}
		for k, want := range map[string]float64{
			"enabled": 1, "host_tokens_capacity": float64(rk.HostTokens), "host_hits_total": float64(rk.Totals.HostHits),
			"hit_tokens_total": float64(rk.Totals.HitTokens), "loads_total": float64(rk.Totals.Loads),
			"backups_total": float64(rk.Totals.Backups), "load_failures_total": 0, "backup_failures_total": 0,
		} {
			if v := x.must(t, `pdkit_hicache_`+k+`{rank="`+rank+`"}`); v != want {
				t.Errorf("rank %s: pdkit_hicache_%s = %v, want %v", rank, k, v, want)
			}
		}
		for _, k := range []string{"host_tokens_used", "backup_bytes_total", "load_bytes_total", "backup_seconds_total", "load_seconds_total",
			"dropped_tokens_total", "abandoned_loads_total"} {
			x.must(t, `pdkit_hicache_`+k+`{rank="`+rank+`"}`)
		}
		for _, part := range []string{"kv", "indexk"} {
			x.must(t, `pdkit_hicache_gate_wait_seconds_total{layer="0",part="`+part+`",rank="`+rank+`"}`)
		}
	}

	// Bandwidth: query or body, 0 unlimited; bad values refused.
	r = e.hicacheSwitch(t, debug.HiCacheBandwidthPath+"?bytes_per_second=1000000", "", 200)
	if !r.Changed || r.Pending || r.Ranks[0].LoadBandwidthBytesPerSecond != 1e6 || r.Ranks[1].LoadBandwidthBytesPerSecond != 1e6 {
		t.Errorf("bandwidth by query: %+v", r)
	}
	var st debug.Settings
	getJSON(t, e, debug.SettingsPath, &st)
	if st.HiCache == nil || st.HiCache.LoadBandwidthBytesPerSecond != 1e6 || st.HiCache.EnabledAtStart || st.HiCache.Ratio != 4 || st.HiCache.WritePolicy != "write-back" {
		t.Errorf("settings: %+v", st.HiCache)
	}
	if v := scrape(t, e).must(t, `pdkit_hicache_load_bandwidth_bytes_per_second{rank="1"}`); v != 1e6 {
		t.Errorf("bandwidth metric %v", v)
	}
	r = e.hicacheSwitch(t, debug.HiCacheBandwidthPath, `{"bytes_per_second": 0}`, 200)
	if !r.Changed || r.Ranks[0].LoadBandwidthBytesPerSecond != 0 {
		t.Errorf("bandwidth by body: %+v", r)
	}
	for _, c := range []struct{ query, body string }{{"", ""}, {"", "{}"}, {"", `{"bytes_per_second": -1}`}, {"", "fast"},
		{"?bytes_per_second=-5", ""}, {"?bytes_per_second=2GB", ""}} {
		code, b := e.admin(t, debug.HiCacheBandwidthPath+c.query, "tok", c.body)
		var eb openai.ErrorBody
		if code != 400 || json.Unmarshal(b, &eb) != nil || eb.Error.Param == nil || *eb.Error.Param != "bytes_per_second" {
			t.Errorf("bandwidth %q %q: %d %s", c.query, c.body, code, b)
		}
	}

	// Off: the pool goes, the counters stay.
	r = e.hicacheSwitch(t, debug.HiCacheOffPath, "", 200)
	if !r.Changed || r.Pending || r.On {
		t.Fatalf("off: %+v", r)
	}
	for i, rk := range r.Ranks {
		if rk.On || rk.HostPages != 0 || rk.HostTokens != 0 || rk.Totals.Backups != h.Ranks[i].Totals.Backups || rk.Totals.HostHits != h.Ranks[i].Totals.HostHits {
			t.Errorf("rank %d off: %+v", rk.Rank, rk)
		}
	}
	x = scrape(t, e)
	for k, want := range map[string]float64{
		`pdkit_hicache_switches_total{direction="on"}`: 1, `pdkit_hicache_switches_total{direction="off"}`: 1,
		`pdkit_hicache_enabled{rank="0"}`: 0, `pdkit_hicache_host_tokens_capacity{rank="1"}`: 0,
	} {
		if v := x.must(t, k); v != want {
			t.Errorf("%s = %v, want %v", k, v, want)
		}
	}
	problems, err := testutil.GatherAndLint(e.srv.opts.Metrics.Registry())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

// A switch the loops cannot take (the last rank held by stall-last-rank,
// rank 0 waiting for it in a collective) answers 202, pending; a second
// switch meanwhile is a 409; once the rank goes on, the first takes effect.
func TestHiCacheSwitchPending(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, KVTokens: 64, MaxRunning: 2, HiCache: serve.HiCacheConfig{Enabled: true}},
		Options{AdminToken: "tok"})
	if code, b := e.admin(t, "/admin/v1/faults/"+serve.FaultStallLastRank+"/on", "tok", ""); code != 200 {
		t.Fatalf("fault on: %d %s", code, b)
	}
	waitfor.For(t, "rank 0 waiting for rank 1 in a control collective", 20*time.Second, func() bool {
		var c debug.CollectivesResponse
		getJSON(t, e, "/debug/v1/collectives?stall=100ms", &c)
		ctrl := c.Comm(debug.CommControl)
		return ctrl != nil && slices.ContainsFunc(ctrl.Stalls, func(s debug.Stall) bool { return slices.Contains(s.Arrived, 0) })
	})
	r := e.hicacheSwitch(t, debug.HiCacheOffPath, "", http.StatusAccepted)
	if !r.Changed || !r.Pending || !r.Ranks[0].On || !r.Ranks[1].On {
		t.Errorf("off while stuck: %+v", r)
	}
	code, b := e.admin(t, debug.HiCacheOnPath, "tok", "")
	if code != http.StatusConflict || !strings.Contains(string(b), "pending") {
		t.Errorf("on while off is pending: %d %s", code, b)
	}
	if code, b := e.admin(t, "/admin/v1/faults/"+serve.FaultStallLastRank+"/off", "tok", ""); code != 200 {
		t.Fatalf("fault off: %d %s", code, b)
	}
	waitfor.For(t, "the tier off on every rank", 20*time.Second, func() bool {
		var h debug.HiCacheResponse
		getJSON(t, e, debug.HiCachePath, &h)
		return !h.On && !slices.ContainsFunc(h.Ranks, func(rk debug.HiCacheRank) bool { return rk.On })
	})
	if v := scrape(t, e).must(t, `pdkit_hicache_switches_total{direction="off"}`); v != 1 {
		t.Errorf("switches off %v", v)
	}
}

// Without a prefix cache there is no tier: the debug call says so, the
// switches are 409 and the settings publish none.
func TestHiCacheNoPrefixCache(t *testing.T) {
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 2, DisablePrefixCache: true}, Options{Loopback: true})
	var h debug.HiCacheResponse
	getJSON(t, e, debug.HiCachePath, &h)
	if h.PrefixCache || h.On || h.Ranks == nil || len(h.Ranks) != 0 {
		t.Errorf("no prefix cache: %+v", h)
	}
	for _, p := range []string{debug.HiCacheOnPath, debug.HiCacheOffPath, debug.HiCacheBandwidthPath + "?bytes_per_second=1"} {
		if code, b := e.admin(t, p, "", ""); code != http.StatusConflict || !strings.Contains(string(b), "prefix cache") {
			t.Errorf("POST %s: %d %s", p, code, b)
		}
	}
	var st debug.Settings
	getJSON(t, e, debug.SettingsPath, &st)
	if st.HiCache != nil {
		t.Errorf("settings: %+v", st.HiCache)
	}
	if hasPrefix(scrape(t, e), "pdkit_hicache_enabled") {
		t.Error("hicache metrics without a prefix cache")
	}
}

// A decode server keeps no host tier: the debug API says why, and the
// switch is refused with that reason.
func TestHiCacheNoneOnDecode(t *testing.T) {
	e := newEnvWith(t, serve.Config{Role: pdproto.RoleDecode, PageSize: 4, MaxRunning: 2}, Options{Loopback: true})
	var h debug.HiCacheResponse
	getJSON(t, e, debug.HiCachePath, &h)
	if !h.PrefixCache || h.On || !strings.Contains(h.NoTier, "keeps no host tier") {
		t.Errorf("a decode's tier: %+v", h)
	}
	if code, b := e.admin(t, debug.HiCacheOnPath, "", ""); code != http.StatusConflict || !strings.Contains(string(b), "keeps no host tier") {
		t.Errorf("POST %s: %d %s", debug.HiCacheOnPath, code, b)
	}
}
