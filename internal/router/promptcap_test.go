package router

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
)

// A prompt that cannot fit the servers' context is refused at the router,
// before any of it is forwarded: by its bytes of text, its token ids, its
// messages' count or text, and a body past what a prompt that fits could
// take is refused while it is read. Prompts that fit are routed as before;
// a router whose servers report no bound refuses nothing more than before.
func TestPromptBoundAtTheRouter(t *testing.T) {
	bound := openai.PromptBound{ContextTokens: 512, TokenBytes: 7}
	withBound := func(s *stub) { s.bound = bound }
	p, d := newStub(t, pdproto.RolePrefill, withBound), newStub(t, pdproto.RoleDecode, withBound)
	c := start(t, []*stub{p}, []*stub{d})
	c.waitChecked(t)
	fits := (512 - 16) * 7
	enc := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	many := make([]map[string]any, 600)
	for i := range many {
		many[i] = map[string]any{"role": "user", "content": "hi"}
	}
	cases := []struct {
		name, path, body string
		status           int
		want             string
	}{
		{"text", "/v1/completions", enc(map[string]any{"prompt": strings.Repeat("a", fits+1), "max_tokens": 16}), 400, "cannot fit the context length of 512"},
		{"token ids", "/v1/completions", enc(map[string]any{"prompt": make([]int, 500), "max_tokens": 16}), 400, "exceeds the context length of 512"},
		{"many messages", "/v1/chat/completions", enc(map[string]any{"messages": many}), 400, "600 messages"},
		{"long message", "/v1/chat/completions", enc(map[string]any{"messages": []map[string]any{{"role": "user", "content": strings.Repeat("a", 512*7)}}}), 400, "cannot fit"},
		{"native", "/generate", enc(map[string]any{"text": strings.Repeat("a", fits+1), "sampling_params": map[string]any{"max_new_tokens": 16}}), 400, "cannot fit"},
		{"4 MB", "/v1/completions", enc(map[string]any{"prompt": strings.Repeat("pdkit ", 4_000_000/6)}), 413, "exceeds"},
	}
	for _, cs := range cases {
		resp := c.post(t, context.Background(), cs.path, cs.body)
		got := readAll(t, resp)
		if resp.StatusCode != cs.status || !strings.Contains(got, cs.want) {
			t.Errorf("%s: %d %s, want %d naming %q", cs.name, resp.StatusCode, got, cs.status, cs.want)
		}
	}
	if n := p.count() + d.count(); n != 0 {
		t.Errorf("%d refused requests reached the servers", n)
	}
	resp := c.post(t, context.Background(), "/v1/completions", enc(map[string]any{"prompt": strings.Repeat("a", fits), "max_tokens": 16}))
	if got := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Errorf("a prompt that may fit: %d %s", resp.StatusCode, got)
	}
	p.waitRequests(t, 1) // the prefill's half may end after the decode's answer
	if p.count() != 1 || d.count() != 1 {
		t.Errorf("the prompt that may fit reached %d prefill and %d decode servers", p.count(), d.count())
	}
}
