package server

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/openai"
)

// no_cache on each generation API (completions, chat, /generate's
// sampling_params): a prompt sent once is cached, sent again it reads its
// prefix from the cache, and sent with no_cache it reads nothing cached
// (the engine's cached-token total does not move) and gives the same
// greedy text.
func TestNoCache(t *testing.T) {
	e := newEnv(t)
	prompt := strings.Repeat("the cache must not matter ", 6)
	apis := []struct {
		name string
		send func(noCache bool) string
	}{
		{"completions", func(noCache bool) string {
			r := e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true, "no_cache": noCache})
			return r.Choices[0].Text
		}},
		{"chat", func(noCache bool) string {
			code, b := e.post(t, "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": prompt}},
				"max_tokens": 8, "temperature": 0, "ignore_eos": true, "no_cache": noCache})
			var r openai.ChatCompletionResponse
			if code != 200 || json.Unmarshal(b, &r) != nil {
				t.Fatalf("chat: %d %s", code, b)
			}
			return r.Choices[0].Message.Content
		}},
		{"generate", func(noCache bool) string {
			code, b := e.post(t, "/generate", map[string]any{"text": prompt,
				"sampling_params": map[string]any{"max_new_tokens": 8, "temperature": 0, "ignore_eos": true, "no_cache": noCache}})
			var r GenerateResponse
			if code != 200 || json.Unmarshal(b, &r) != nil {
				t.Fatalf("generate: %d %s", code, b)
			}
			return r.Text
		}},
	}
	cached := func() uint64 {
		waitIdle(t, e.eng)
		return e.eng.View().Snapshot().Totals.CachedTokens
	}
	for _, api := range apis {
		first := api.send(false)
		before := cached()
		if second := api.send(false); second != first {
			t.Fatalf("%s: the cached run gives %q, the first %q", api.name, second, first)
		}
		hit := cached()
		if hit <= before {
			t.Fatalf("%s: the second run read nothing cached (cached tokens %d → %d)", api.name, before, hit)
		}
		if third := api.send(true); third != first {
			t.Errorf("%s: with no_cache %q, without %q", api.name, third, first)
		}
		if got := cached(); got != hit {
			t.Errorf("%s: with no_cache the cached tokens went %d → %d", api.name, hit, got)
		}
	}
	code, b := e.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"no_cache": 1}})
	if code != 400 {
		t.Errorf("no_cache 1 in sampling_params: %d %s", code, b)
	}
}
