package openai

import (
	"bytes"
	"testing"
)

// fuzzLimits are small so that the fuzzer reaches the size and token
// limits.
var fuzzLimits = Limits{MaxBodyBytes: 1024, DefaultMaxTokens: 16, MaxTokens: 256, Models: []string{"tiny"}}

var fuzzSeeds = []string{
	``, `null`, `[]`, `{}`, `{"model": "tiny",}`, `{"a": 1} x`, `"prompt"`, `{"prompt": "a"`,
	`{"max_tokens": 1e400, "temperature": -0}`,
}

var completionSeeds = []string{
	`{"model": "tiny", "prompt": "Once upon a time"}`,
	`{"prompt": ["Hello"], "max_tokens": 256, "temperature": 0, "top_p": 0.9, "seed": -7, "stop": "\n", "stream": true, "stream_options": {"include_usage": true}, "user": "u", "ignore_eos": true, "n": 1, "best_of": 1, "echo": false, "logprobs": null}`,
	`{"prompt": [1, 2, 3], "stop": ["a", "b"]}`,
	`{"prompt": [[4, 5]], "extra": {"x": [1, "y"]}}`,
	`{"prompt": ["a", "b"]}`,
	`{"prompt": "a", "n": 2}`,
	`{"prompt": "a", "logprobs": 5}`,
	`{"prompt": "a", "model": "gpt-4"}`,
	`{"prompt": "a", "temperature": "hot"}`,
	`{"prompt": "\ud800", "stop": ["\u0000"]}`,
}

var chatSeeds = []string{
	`{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}`,
	`{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "n"}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "1", "tool_call_id": "c"}], "max_tokens": 5, "max_completion_tokens": 7, "temperature": 2, "top_p": 1, "seed": 1, "stop": [], "stream": true, "stream_options": {}}`,
	`{"messages": []}`,
	`{"messages": [{"role": "bot", "content": "x"}]}`,
	`{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}`,
	`{"messages": [{"role": "user", "content": null}], "logprobs": true}`,
}

func FuzzDecodeCompletion(f *testing.F) {
	for _, s := range append(fuzzSeeds, completionSeeds...) {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, e := DecodeCompletion(bytes.NewReader(body), fuzzLimits)
		if !checkOutcome(t, req != nil, e) {
			return
		}
		if v := req.Validate(fuzzLimits); v != nil {
			t.Fatalf("decoded request fails its own validation: %v", v)
		}
		if req.MaxTokens == nil || req.Temperature == nil || req.TopP == nil {
			t.Fatalf("defaults not applied: %+v", req)
		}
		roundTripCompletion(t, req, fuzzLimits)
	})
}

func FuzzDecodeChat(f *testing.F) {
	for _, s := range append(fuzzSeeds, chatSeeds...) {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, e := DecodeChat(bytes.NewReader(body), fuzzLimits)
		if !checkOutcome(t, req != nil, e) {
			return
		}
		if v := req.Validate(fuzzLimits); v != nil {
			t.Fatalf("decoded request fails its own validation: %v", v)
		}
		if (req.MaxTokens == nil && req.MaxCompletionTokens == nil) || req.Temperature == nil || req.TopP == nil {
			t.Fatalf("defaults not applied: %+v", req)
		}
		roundTripChat(t, req, fuzzLimits)
	})
}

// checkOutcome checks that exactly one of a request and an error came back,
// the error being a complete 4xx, and reports whether it was a request.
func checkOutcome(t *testing.T, gotReq bool, e *Error) bool {
	t.Helper()
	if gotReq == (e != nil) {
		t.Fatalf("request %v and error %v", gotReq, e)
	}
	if e == nil {
		return true
	}
	if e.Status < 400 || e.Status > 499 || e.Message == "" || e.Type != TypeInvalidRequest {
		t.Fatalf("bad error: %+v", e)
	}
	return false
}
