package openai

import (
	"encoding/json"
	"strings"
)

// Object names carried in the "object" field of responses.
const (
	ObjectTextCompletion = "text_completion" // completions and their stream chunks
	ObjectChatCompletion = "chat.completion"
	ObjectChatChunk      = "chat.completion.chunk"
	ObjectModel          = "model"
	ObjectList           = "list"
)

// Finish reasons.
const (
	FinishStop   = "stop"   // an end-of-sequence token or a stop string
	FinishLength = "length" // max_tokens or the context was reached
	FinishAbort  = "abort"  // the request was aborted (pdkit extension)
)

// Chat roles accepted in requests.
const (
	RoleSystem    = "system"
	RoleUser      = "user"
	RoleAssistant = "assistant"
	RoleTool      = "tool"
)

// MaxStop is the most stop strings a request may carry, and MaxStopBytes
// the longest one.
const (
	MaxStop      = 4
	MaxStopBytes = 256
)

// StreamOptions are the options of a streamed request.
type StreamOptions struct {
	// IncludeUsage asks for a last chunk, before [DONE], whose choices are
	// empty and whose usage counts the whole request.
	IncludeUsage bool `json:"include_usage"`
}

// Prompt is the prompt of a completion request: text, or token ids when
// Tokens is not nil. On the wire it is a string, a one-element array of
// strings, an array of token ids or a one-element array of such arrays;
// it is written back as a string or an array of token ids.
type Prompt struct {
	Text   string
	Tokens []int
}

// MarshalJSON writes p as a string, or as an array of token ids.
func (p Prompt) MarshalJSON() ([]byte, error) {
	if p.Tokens != nil {
		return json.Marshal(p.Tokens)
	}
	return json.Marshal(p.Text)
}

// UnmarshalJSON reads any of the accepted forms of a prompt.
func (p *Prompt) UnmarshalJSON(b []byte) error {
	q, e := parsePrompt(b)
	if e != nil {
		return e
	}
	*p = q
	return nil
}

// CompletionRequest is the body of POST /v1/completions.
//
// Optional sampling fields are pointers so that a client can leave them
// out; DecodeCompletion fills MaxTokens, Temperature and TopP with their
// defaults.
type CompletionRequest struct {
	Model         string         `json:"model,omitempty"`
	Prompt        Prompt         `json:"prompt"`
	MaxTokens     *int           `json:"max_tokens,omitempty"`
	Temperature   *float64       `json:"temperature,omitempty"`
	TopP          *float64       `json:"top_p,omitempty"`
	Seed          *int64         `json:"seed,omitempty"`
	Stop          []string       `json:"stop,omitempty"`
	Stream        bool           `json:"stream,omitempty"`
	StreamOptions *StreamOptions `json:"stream_options,omitempty"`
	User          string         `json:"user,omitempty"`
	// N is the number of choices, 1 to MaxChoices (nil: one): samples of
	// one prompt, which the server prefills once.
	N *int `json:"n,omitempty"`
	// IgnoreEOS keeps generating past end-of-sequence tokens until
	// max_tokens or a stop string (an extension, for benchmarks).
	IgnoreEOS bool `json:"ignore_eos,omitempty"`
	// NoCache computes the whole prompt, reading nothing from the prefix
	// cache or its host tier (a pdkit extension): a reference output, or a
	// canary, that no cached KV can have corrupted. Greedy outputs with and
	// without it are the same on a healthy server.
	NoCache bool `json:"no_cache,omitempty"`
	PD
}

// PD holds the fields a PD router adds to a request it forwards (a pdkit
// extension): the room that pairs the prefill and the decode side of one
// request, and, for the decode side, the prefill server's bootstrap
// registry. A colocated server refuses them.
type PD struct {
	BootstrapRoom *uint64 `json:"bootstrap_room,omitempty"`
	BootstrapURL  string  `json:"bootstrap_url,omitempty"`
	// Probe marks the router's own canary (a correctness probe), which a
	// server leaves out of its metrics and readiness; taken only with
	// bootstrap_room (a PD request, signed by the router).
	Probe bool `json:"probe,omitempty"`
}

// ContentPart is one part of a chat message's content. Only "text" parts
// are accepted.
type ContentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// Content is a chat message's content: a string, or an array of parts when
// Parts is not nil.
type Content struct {
	Text  string
	Parts []ContentPart
}

// String returns the content as text; the text of several parts is joined
// with newlines.
func (c Content) String() string {
	if c.Parts == nil {
		return c.Text
	}
	texts := make([]string, len(c.Parts))
	for i, p := range c.Parts {
		texts[i] = p.Text
	}
	return strings.Join(texts, "\n")
}

// MarshalJSON writes c as a string, or as an array of parts.
func (c Content) MarshalJSON() ([]byte, error) {
	if c.Parts != nil {
		return json.Marshal(c.Parts)
	}
	return json.Marshal(c.Text)
}

// UnmarshalJSON reads a string or an array of text parts.
func (c *Content) UnmarshalJSON(b []byte) error {
	d, e := parseContent(b, "content")
	if e != nil {
		return e
	}
	*c = d
	return nil
}

// Message is one message of a chat request.
type Message struct {
	Role       string  `json:"role"`
	Content    Content `json:"content"`
	Name       string  `json:"name,omitempty"`
	ToolCallID string  `json:"tool_call_id,omitempty"`
}

// ChatCompletionRequest is the body of POST /v1/chat/completions.
//
// MaxCompletionTokens is the current name of the output limit and wins
// when both are set; max_tokens is still accepted. DecodeChat fills
// MaxCompletionTokens (when neither is given), Temperature and TopP with
// their defaults.
type ChatCompletionRequest struct {
	Model               string         `json:"model,omitempty"`
	Messages            []Message      `json:"messages"`
	MaxTokens           *int           `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int           `json:"max_completion_tokens,omitempty"`
	Temperature         *float64       `json:"temperature,omitempty"`
	TopP                *float64       `json:"top_p,omitempty"`
	Seed                *int64         `json:"seed,omitempty"`
	Stop                []string       `json:"stop,omitempty"`
	Stream              bool           `json:"stream,omitempty"`
	StreamOptions       *StreamOptions `json:"stream_options,omitempty"`
	User                string         `json:"user,omitempty"`
	// N is as in CompletionRequest.
	N *int `json:"n,omitempty"`
	// IgnoreEOS is as in CompletionRequest (an extension).
	IgnoreEOS bool `json:"ignore_eos,omitempty"`
	// NoCache is as in CompletionRequest (an extension).
	NoCache bool `json:"no_cache,omitempty"`
	PD
}

// Choices is the number of choices the request asks for (N, 1 when
// absent).
func (r *CompletionRequest) Choices() int { return choices(r.N) }

// Choices is as CompletionRequest's.
func (r *ChatCompletionRequest) Choices() int { return choices(r.N) }

func choices(n *int) int {
	if n == nil {
		return 1
	}
	return *n
}

// Usage counts the tokens of a request.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// CompletionChoice is one choice of a CompletionResponse. Logprobs is
// always null.
type CompletionChoice struct {
	Text         string `json:"text"`
	Index        int    `json:"index"`
	Logprobs     any    `json:"logprobs"`
	FinishReason string `json:"finish_reason"`
}

// CompletionResponse is the answer to a non-streamed completion request.
type CompletionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"` // ObjectTextCompletion
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []CompletionChoice `json:"choices"`
	Usage   Usage              `json:"usage"`
}

// ChatMessage is the message of a ChatChoice.
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ChatChoice is one choice of a ChatCompletionResponse. Logprobs is always
// null.
type ChatChoice struct {
	Index        int         `json:"index"`
	Message      ChatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
}

// ChatCompletionResponse is the answer to a non-streamed chat request.
type ChatCompletionResponse struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"` // ObjectChatCompletion
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []ChatChoice `json:"choices"`
	Usage   Usage        `json:"usage"`
}

// CompletionChunkChoice is one choice of a CompletionChunk. FinishReason
// is null until the choice's last chunk.
type CompletionChunkChoice struct {
	Text         string  `json:"text"`
	Index        int     `json:"index"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
}

// CompletionChunk is one event of a streamed completion. Usage is set only
// on the last chunk of a request that asked for it (with empty, not nil,
// Choices).
type CompletionChunk struct {
	ID      string                  `json:"id"`
	Object  string                  `json:"object"` // ObjectTextCompletion
	Created int64                   `json:"created"`
	Model   string                  `json:"model"`
	Choices []CompletionChunkChoice `json:"choices"`
	Usage   *Usage                  `json:"usage,omitempty"`
}

// ChatDelta is the increment of a ChatChunkChoice: the role on the first
// chunk, then content.
type ChatDelta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
}

// ChatChunkChoice is one choice of a ChatCompletionChunk. FinishReason is
// null until the choice's last chunk.
type ChatChunkChoice struct {
	Index        int       `json:"index"`
	Delta        ChatDelta `json:"delta"`
	Logprobs     any       `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

// ChatCompletionChunk is one event of a streamed chat completion. Usage is
// as in CompletionChunk.
type ChatCompletionChunk struct {
	ID      string            `json:"id"`
	Object  string            `json:"object"` // ObjectChatChunk
	Created int64             `json:"created"`
	Model   string            `json:"model"`
	Choices []ChatChunkChoice `json:"choices"`
	Usage   *Usage            `json:"usage,omitempty"`
}

// Model describes one served model in a ModelList.
type Model struct {
	ID      string `json:"id"`
	Object  string `json:"object"` // ObjectModel
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// ModelList is the answer to GET /v1/models.
type ModelList struct {
	Object string  `json:"object"` // ObjectList
	Data   []Model `json:"data"`
}

// Params are a request's sampling settings as plain values, defaults
// applied.
type Params struct {
	MaxTokens   int
	Temperature float64
	TopP        float64
	Seed        int64
	HasSeed     bool
	Stop        []string
	IgnoreEOS   bool
	NoCache     bool // computes the whole prompt, no cached KV read
}
