package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
)

// POST /admin/v1/hicache/offload (behind the admin token) sends a cached
// prompt's prefix to host, given as text or as token ids: the next request
// with it is a host hit on every rank and gives the same greedy text. Bad
// bodies are 400 and name the field; with the tier off it is 409, and
// without a prefix cache too.
func TestHiCacheOffload(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, HiCache: serve.HiCacheConfig{Enabled: true, Ratio: 2}},
		Options{AdminToken: "tok"})
	hits := func() (h []uint64) {
		var r debug.HiCacheResponse
		getJSON(t, e, debug.HiCachePath, &r)
		for _, rk := range r.Ranks {
			h = append(h, rk.Totals.HostHits)
		}
		return h
	}
	offload := func(body string) debug.HiCacheOffloadResponse {
		t.Helper()
		code, b := e.admin(t, debug.HiCacheOffloadPath, "tok", body)
		var r debug.HiCacheOffloadResponse
		if code != 200 || json.Unmarshal(b, &r) != nil {
			t.Fatalf("offload %s: %d %s", body, code, b)
		}
		return r
	}
	complete := func(prompt any) string {
		return e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true}).Choices[0].Text
	}

	if code, b := e.admin(t, debug.HiCacheOffloadPath, "", `{"prompt": "x"}`); code != http.StatusUnauthorized {
		t.Errorf("without the token: %d %s", code, b)
	}
	text := strings.Repeat("offload me to the host tier ", 4)
	tokens := make([]int32, 40)
	for i := range tokens {
		tokens[i] = int32(3 + 7*i%(e.m.Config.VocabSize-3))
	}
	tokJSON, _ := json.Marshal(tokens)
	for _, tc := range []struct {
		name   string
		prompt any
		body   string
	}{
		{"text", text, fmt.Sprintf(`{"prompt": %q}`, text)},
		{"tokens", tokens, `{"tokens": ` + string(tokJSON) + `}`},
	} {
		first := complete(tc.prompt)
		waitIdle(t, e.eng)
		r := offload(tc.body)
		if r.PromptTokens < 40 || r.OffloadedTokens < r.PromptTokens-4 || r.OffloadedTokens%4 != 0 {
			t.Fatalf("%s: offload %+v: want the prompt's whole pages", tc.name, r)
		}
		before := hits()
		if again := complete(tc.prompt); again != first {
			t.Errorf("%s: after the offload %q, before %q", tc.name, again, first)
		}
		waitIdle(t, e.eng)
		for rk, h := range hits() {
			if h != before[rk]+1 {
				t.Errorf("%s: rank %d host hits %d → %d, want one more", tc.name, rk, before[rk], h)
			}
		}
	}
	// A prompt nothing cached: nothing to offload.
	if r := offload(`{"prompt": "never sent before, never cached anywhere"}`); r.OffloadedTokens != 0 || r.PromptTokens == 0 {
		t.Errorf("uncached prompt: %+v", r)
	}

	for _, c := range []struct{ body, param string }{
		{"", ""}, {"[1]", ""}, {"{}", "prompt"}, {`{"prompt": ""}`, "prompt"}, {`{"tokens": []}`, "tokens"},
		{`{"prompt": "a", "tokens": [1]}`, "prompt"}, {`{"tokens": [-1]}`, "tokens"},
		{fmt.Sprintf(`{"tokens": [1, %d]}`, e.m.Config.VocabSize), "tokens"},
	} {
		code, b := e.admin(t, debug.HiCacheOffloadPath, "tok", c.body)
		var eb openai.ErrorBody
		if code != 400 || json.Unmarshal(b, &eb) != nil || c.param != "" && (eb.Error.Param == nil || *eb.Error.Param != c.param) {
			t.Errorf("body %q: %d %s, want 400 naming %q", c.body, code, b, c.param)
		}
	}

	e.hicacheSwitch(t, debug.HiCacheOffPath, "", 200)
	if code, b := e.admin(t, debug.HiCacheOffloadPath, "tok", `{"prompt": "x"}`); code != http.StatusConflict || !strings.Contains(string(b), "hicache is off") {
		t.Errorf("with the tier off: %d %s", code, b)
	}

	n := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 2, DisablePrefixCache: true}, Options{Loopback: true})
	if code, b := n.admin(t, debug.HiCacheOffloadPath, "", `{"prompt": "x"}`); code != http.StatusConflict {
		t.Errorf("without a prefix cache: %d %s", code, b)
	}
}
