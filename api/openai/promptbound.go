package openai

import "fmt"

// PromptBound refuses, before any of it is tokenized, a prompt that cannot
// fit a model's context: one token stands for at most TokenBytes bytes of
// text (the vocabulary's longest piece), so a prompt of more than
// (ContextTokens − max_tokens) × TokenBytes bytes has more tokens than the
// context holds, whatever its text. A server checks it with its own model;
// a router with the least bound its servers report, before it forwards
// anything. The zero PromptBound refuses nothing.
type PromptBound struct {
	ContextTokens int
	TokenBytes    int
}

// BodyBytes is the most bytes a generation request's body may take under
// b, within limit: every prompt that can fit written with every character
// escaped (JSON writes a byte of text in at most six, \u00XX), as many
// messages or token ids as the context has tokens at 64 bytes each, and
// 1 MiB for the other fields. A body past it holds no prompt that fits,
// so it is refused while it is read.
func (b PromptBound) BodyBytes(limit int64) int64 {
	if b.ContextTokens <= 0 || b.TokenBytes <= 0 {
		return limit
	}
	return min(limit, int64(6*b.ContextTokens*b.TokenBytes+64*b.ContextTokens+1<<20))
}

// Text refuses a prompt of n bytes of text that cannot fit with
// maxTokens to generate; param names the field.
func (b PromptBound) Text(param string, n, maxTokens int) *Error {
	if b.ContextTokens <= 0 || n <= (b.ContextTokens-maxTokens)*b.TokenBytes {
		return nil
	}
	return InvalidRequest(param, fmt.Sprintf(
		"the prompt has %d bytes; a token stands for at most %d of them, so with max_tokens %d it cannot fit the context length of %d tokens",
		n, b.TokenBytes, maxTokens, b.ContextTokens))
}

// Tokens refuses a prompt of n token ids that cannot fit.
func (b PromptBound) Tokens(n, maxTokens int) *Error {
	if b.ContextTokens <= 0 || n <= b.ContextTokens-maxTokens {
		return nil
	}
	return InvalidRequest("prompt", fmt.Sprintf("the prompt has %d tokens; with max_tokens %d it exceeds the context length of %d tokens",
		n, maxTokens, b.ContextTokens))
}

// Messages refuses, before the chat template runs, messages that cannot
// fit: more of them than the context has tokens (every template writes at
// least one token a message), or more text than it holds.
func (b PromptBound) Messages(msgs []Message, maxTokens int) *Error {
	if b.ContextTokens <= 0 {
		return nil
	}
	room := b.ContextTokens - maxTokens
	if len(msgs) > room {
		return InvalidRequest("messages", fmt.Sprintf("%d messages; with max_tokens %d at most %d fit the context length of %d tokens",
			len(msgs), maxTokens, max(0, room), b.ContextTokens))
	}
	n := 0
	for _, m := range msgs {
		n += len(m.Role) + len(m.Name) + len(m.Content.Text)
		for _, p := range m.Content.Parts {
			n += len(p.Text) + 1
		}
	}
	return b.Text("messages", n, maxTokens)
}
