package router

import (
	"encoding/json"

	"github.com/pdkit/pdkit/api/openai"
)

// A prompt that cannot fit the model's context is refused at the edge,
// before the router forwards any of it to a server that would refuse it
// after paying for its body: each server reports its prompt bound
// (pdproto.ServerInfo: its context length and the most bytes a token
// stands for) with its info, and the router holds a request to the
// loosest bound its healthy servers report (they serve one model), so it
// never refuses what a server would take. The body is read only as far as
// a prompt that fits could go.

// promptBound is the loosest prompt bound the healthy servers report; the
// zero bound (nothing refused) before any has.
func (rt *Router) promptBound() openai.PromptBound {
	var b openai.PromptBound
	for _, u := range rt.servers() {
		healthy, info := u.state()
		if !healthy || info.ContextTokens <= 0 || info.TokenBytes <= 0 {
			continue
		}
		b.ContextTokens = max(b.ContextTokens, info.ContextTokens)
		b.TokenBytes = max(b.TokenBytes, info.TokenBytes)
	}
	return b
}

// checkPrompt refuses a request whose prompt (completions' prompt, chat's
// messages, the native API's text) cannot fit under b, with the tokens it
// asks for (0 when it names none: the loosest reading).
func checkPrompt(b openai.PromptBound, fields map[string]json.RawMessage) *openai.Error {
	if b.ContextTokens <= 0 {
		return nil
	}
	maxTokens := 0
	for _, k := range []string{"max_tokens", "max_completion_tokens"} {
		var n int
		if json.Unmarshal(fields[k], &n) == nil {
			maxTokens = max(maxTokens, n)
		}
	}
	var sp struct {
		MaxNewTokens int `json:"max_new_tokens"`
	}
	if json.Unmarshal(fields["sampling_params"], &sp) == nil {
		maxTokens = max(maxTokens, sp.MaxNewTokens)
	}
	maxTokens = min(maxTokens, b.ContextTokens)
	if raw, ok := fields["prompt"]; ok {
		var text string
		if json.Unmarshal(raw, &text) == nil {
			return b.Text("prompt", len(text), maxTokens)
		}
		var ids []json.RawMessage
		if json.Unmarshal(raw, &ids) == nil && len(ids) > 0 && len(ids[0]) > 0 && ids[0][0] != '"' {
			return b.Tokens(len(ids), maxTokens)
		}
	}
	if raw, ok := fields["text"]; ok {
		var text string
		if json.Unmarshal(raw, &text) == nil {
			return b.Text("text", len(text), maxTokens)
		}
	}
	if raw, ok := fields["messages"]; ok {
		var msgs []openai.Message
		if json.Unmarshal(raw, &msgs) == nil {
			return b.Messages(msgs, maxTokens)
		}
	}
	return nil
}
