package router_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// no_cache through the router reaches both sides of a PD request: a
// prompt sent a second time reads its prefix from the prefill's cache, and
// sent with no_cache (in the completions, chat and /generate bodies) it
// reads nothing cached on either server and gives the same greedy text.
func TestClusterNoCache(t *testing.T) {
	m := tinyModel(t)
	c := newCluster(t, m, serve.Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 8})
	prompt := testmodel.Prompts(91, 1, 48, 48, m.Config.VocabSize)[0] // token ids
	text := strings.Repeat("the cache must not matter ", 6)
	sent := uint64(0) // requests sent, each one finishing on both servers
	post := func(path string, req map[string]any, out any) {
		sent++
		b, _ := json.Marshal(req)
		resp, err := c.client.Post(c.router.URL+path, "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || json.Unmarshal(body, out) != nil {
			t.Fatalf("POST %s: %d %s", path, resp.StatusCode, body)
		}
	}
	apis := []struct {
		name string
		send func(noCache bool) string
	}{
		{"completions", func(noCache bool) string {
			var r openai.CompletionResponse
			post("/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "no_cache": noCache}, &r)
			return r.Choices[0].Text
		}},
		{"chat", func(noCache bool) string {
			var r openai.ChatCompletionResponse
			post("/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": text}},
				"max_tokens": 6, "temperature": 0, "ignore_eos": true, "no_cache": noCache}, &r)
			return r.Choices[0].Message.Content
		}},
		{"generate", func(noCache bool) string {
			var r struct{ Text string }
			post("/generate", map[string]any{"text": text,
				"sampling_params": map[string]any{"max_new_tokens": 6, "temperature": 0, "ignore_eos": true, "no_cache": noCache}}, &r)
			return r.Text
		}},
	}
	// cached is each server's cached-token total once both are idle. A
	// request's cached tokens are counted when it is admitted, before it
	// finishes: a published state that counts every request sent as
	// finished counts their cached tokens too.
	cached := func() (prefill, decode uint64) {
		c.drained(t, 5*time.Second)
		var p, d uint64
		waitfor.For(t, "both servers publishing every request finished", 5*time.Second, func() bool {
			ps, ds := c.prefill.Eng.View().Snapshot().Totals, c.decode.Eng.View().Snapshot().Totals
			p, d = ps.CachedTokens, ds.CachedTokens
			return ps.Finished == sent && ds.Finished == sent
		})
		return p, d
	}
	for _, api := range apis {
		first := api.send(false)
		p0, _ := cached()
		if second := api.send(false); second != first {
			t.Fatalf("%s: the cached run gives %q, the first %q", api.name, second, first)
		}
		p1, d1 := cached()
		if p1 <= p0 {
			t.Fatalf("%s: the second run read nothing from the prefill's cache (%d → %d)", api.name, p0, p1)
		}
		if third := api.send(true); third != first {
			t.Errorf("%s: with no_cache %q, without %q", api.name, third, first)
		}
		if p2, d2 := cached(); p2 != p1 || d2 != d1 {
			t.Errorf("%s: with no_cache the cached tokens went prefill %d → %d, decode %d → %d", api.name, p1, p2, d1, d2)
		}
	}
}
