package openai

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"
)

var testLimits = Limits{MaxBodyBytes: 2048, DefaultMaxTokens: 64, MaxTokens: 4096, Models: []string{"tiny"}}

// errCase is a body that must be refused with exactly this status, param and
// message.
type errCase struct {
	name    string
	body    string
	status  int
	param   string
	message string
}

func checkErr(t *testing.T, tc errCase, e *Error) {
	t.Helper()
	if e == nil {
		t.Fatalf("body %s: no error, want %d %q", tc.body, tc.status, tc.message)
	}
	if e.Status != tc.status || e.Param != tc.param || e.Message != tc.message {
		t.Errorf("body %s:\n got %d param=%q %q\nwant %d param=%q %q",
			tc.body, e.Status, e.Param, e.Message, tc.status, tc.param, tc.message)
	}
	if e.Type != TypeInvalidRequest {
		t.Errorf("type = %q, want %q", e.Type, TypeInvalidRequest)
	}
}

// Errors both endpoints share, checked through either decoder. The body
// prefix makes each a valid request apart from the field under test.
var commonErrs = []errCase{
	{"not an object", `[1]`, 400, "", "request body must be a JSON object"},
	{"null body", `null`, 400, "", "request body must be a JSON object"},
	{"empty body", ` `, 400, "", "request body is empty; expected a JSON object"},
	{"syntax", `{"model": "tiny",}`, 400, "", `invalid JSON at line 1, column 18 (byte 17): invalid character '}' looking for beginning of object key string`},
	{"syntax line 2", "{\n  \"model\" \"tiny\"}", 400, "", `invalid JSON at line 2, column 11 (byte 12): invalid character '"' after object key`},
	{"truncated", `{"model": "tiny"`, 400, "", `invalid JSON at line 1, column 17 (byte 16): unexpected end of JSON input`},
	{"trailing data", `{"model": "tiny"} {}`, 400, "", `invalid JSON at line 1, column 19 (byte 18): unexpected data after the top-level value`},
	{"too large", `{"user": "` + strings.Repeat("x", 2048) + `"}`, 413, "", "request body is larger than 2048 bytes"},
	{"model type", `{"model": 7}`, 400, "model", `"model" must be a string`},
	{"temperature type", `{"temperature": "0.5"}`, 400, "temperature", `"temperature" must be a number`},
	{"temperature high", `{"temperature": 2.5}`, 400, "temperature", `"temperature" must be between 0 and 2, got 2.5`},
	{"temperature low", `{"temperature": -0.1}`, 400, "temperature", `"temperature" must be between 0 and 2, got -0.1`},
	{"temperature overflow", `{"temperature": 1e400}`, 400, "temperature", `"temperature" is out of range`},
	{"top_p zero", `{"top_p": 0}`, 400, "top_p", `"top_p" must be greater than 0 and at most 1, got 0`},
	{"top_p high", `{"top_p": 1.5}`, 400, "top_p", `"top_p" must be greater than 0 and at most 1, got 1.5`},
	{"top_p type", `{"top_p": true}`, 400, "top_p", `"top_p" must be a number`},
	{"max_tokens zero", `{"max_tokens": 0}`, 400, "max_tokens", `"max_tokens" must be at least 1, got 0`},
	{"max_tokens over", `{"max_tokens": 5000}`, 400, "max_tokens", `"max_tokens" must be at most 4096, got 5000`},
	{"max_tokens fraction", `{"max_tokens": 1.5}`, 400, "max_tokens", `"max_tokens" must be an integer`},
	{"max_tokens string", `{"max_tokens": "10"}`, 400, "max_tokens", `"max_tokens" must be an integer`},
	{"max_tokens huge", `{"max_tokens": 123456789012345678901234567890}`, 400, "max_tokens", `"max_tokens" is out of range`},
	{"seed type", `{"seed": "1"}`, 400, "seed", `"seed" must be an integer`},
	{"stream type", `{"stream": "true"}`, 400, "stream", `"stream" must be a boolean`},
	{"stop type", `{"stop": 3}`, 400, "stop", `"stop" must be a string or an array of strings`},
	{"stop element type", `{"stop": ["a", 1]}`, 400, "stop", `"stop" must be a string or an array of strings`},
	{"stop too many", `{"stop": ["a","b","c","d","e"]}`, 400, "stop", `"stop" may hold at most 4 strings, got 5`},
	{"stop too long", `{"stop": ["a", "` + strings.Repeat("s", 257) + `"]}`, 400, "stop", `"stop[1]" must be at most 256 bytes, got 257`},
	{"stop empty string", `{"stop": ""}`, 400, "stop", `"stop[0]" must not be empty`},
	{"stream_options without stream", `{"stream_options": {"include_usage": true}}`, 400, "stream_options", `"stream_options" is only allowed when "stream" is true`},
	{"stream_options type", `{"stream": true, "stream_options": true}`, 400, "stream_options", `"stream_options" must be an object`},
	{"include_usage type", `{"stream": true, "stream_options": {"include_usage": 1}}`, 400, "stream_options.include_usage", `"stream_options.include_usage" must be a boolean`},
	{"ignore_eos type", `{"ignore_eos": 1}`, 400, "ignore_eos", `"ignore_eos" must be a boolean`},
	{"no_cache type", `{"no_cache": "yes"}`, 400, "no_cache", `"no_cache" must be a boolean`},
	{"user type", `{"user": 1}`, 400, "user", `"user" must be a string`},
	{"n over", `{"n": 17}`, 400, "n", `"n" must be at most 16, got 17`},
	{"n type", `{"n": "2"}`, 400, "n", `"n" must be an integer`},
	{"n zero", `{"n": 0}`, 400, "n", `"n" must be at least 1, got 0`},
	{"unknown model", `{"model": "gpt-4"}`, 404, "model", `model "gpt-4" does not exist`},
}

// withFields returns cases with the fields of each valid-JSON body added to
// valid, so that only the field under test is wrong; malformed bodies stay
// as written.
func withFields(valid string, cases []errCase) []errCase {
	out := make([]errCase, len(cases))
	for i, tc := range cases {
		if strings.HasPrefix(tc.body, "{") && json.Valid([]byte(tc.body)) {
			tc.body = strings.TrimSuffix(valid, "}") + ", " + tc.body[1:]
		}
		out[i] = tc
	}
	return out
}

func TestDecodeCompletionErrors(t *testing.T) {
	cases := append([]errCase{
		{"prompt missing", `{"model": "tiny"}`, 400, "prompt", `"prompt" is required`},
		{"prompt null", `{"prompt": null}`, 400, "prompt", `"prompt" is required`},
		{"prompt empty", `{"prompt": ""}`, 400, "prompt", `"prompt" must not be empty`},
		{"prompt empty array", `{"prompt": []}`, 400, "prompt", `"prompt" must not be empty`},
		{"prompt number", `{"prompt": 5}`, 400, "prompt", `"prompt" must be a string, an array of one string or an array of token ids`},
		{"prompt batch", `{"prompt": ["a", "b"]}`, 400, "prompt", `"prompt" holds 2 prompts; batched prompts are not supported, send one per request`},
		{"prompt mixed", `{"prompt": [1, "a"]}`, 400, "prompt", `"prompt[1]" must be a token id, got "a"`},
		{"prompt negative token", `{"prompt": [1, -2]}`, 400, "prompt", `"prompt[1]" must be a token id (at least 0), got -2`},
		{"prompt token fraction", `{"prompt": [1.5]}`, 400, "prompt", `"prompt[0]" must be a token id, got 1.5`},
		{"prompt array of object", `{"prompt": [{}]}`, 400, "prompt", `"prompt" must be a string, an array of one string or an array of token ids`},
		{"best_of", `{"prompt": "a", "best_of": 3}`, 400, "best_of", `"best_of" must be 1: one candidate per request is supported, got 3; "n" gives up to 16 choices`},
		{"echo", `{"prompt": "a", "echo": true}`, 400, "echo", `"echo" is not supported`},
		{"logprobs", `{"prompt": "a", "logprobs": 1}`, 400, "logprobs", `"logprobs" is not supported`},
		{"logprobs zero", `{"prompt": "a", "logprobs": 0}`, 400, "logprobs", `"logprobs" is not supported`},
	}, withFields(`{"model": "tiny", "prompt": "Once upon a time"}`, commonErrs)...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, e := DecodeCompletion(strings.NewReader(tc.body), testLimits)
			checkErr(t, tc, e)
			if req != nil {
				t.Errorf("request %+v returned with an error", req)
			}
		})
	}
}

func TestDecodeChatErrors(t *testing.T) {
	cases := append([]errCase{
		{"messages missing", `{"model": "tiny"}`, 400, "messages", `"messages" is required`},
		{"messages empty", `{"messages": []}`, 400, "messages", `"messages" must not be empty`},
		{"messages object", `{"messages": {"role": "user"}}`, 400, "messages", `"messages" must be an array`},
		{"message not object", `{"messages": ["hi"]}`, 400, "messages[0]", `"messages[0]" must be an object`},
		{"role missing", `{"messages": [{"content": "hi"}]}`, 400, "messages[0].role", `"messages[0].role" is required`},
		{"role unknown", `{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "hi"}]}`, 400, "messages[1].role", `"messages[1].role" must be one of system, user, assistant, tool, got "bot"`},
		{"role type", `{"messages": [{"role": 1, "content": "hi"}]}`, 400, "messages[0].role", `"messages[0].role" must be a string`},
		{"name type", `{"messages": [{"role": "user", "name": 2, "content": "hi"}]}`, 400, "messages[0].name", `"messages[0].name" must be a string`},
		{"content missing", `{"messages": [{"role": "user"}]}`, 400, "messages[0].content", `"messages[0].content" is required`},
		{"content number", `{"messages": [{"role": "user", "content": 5}]}`, 400, "messages[0].content", `"messages[0].content" must be a string or an array of text parts`},
		{"content empty array", `{"messages": [{"role": "user", "content": []}]}`, 400, "messages[0].content", `"messages[0].content" must not be an empty array`},
		{"content part not object", `{"messages": [{"role": "user", "content": ["hi"]}]}`, 400, "messages[0].content[0]", `"messages[0].content[0]" must be an object`},
		{"content part image", `{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]}`, 400, "messages[0].content[1].type", `content part type "image_url" is not supported, only "text"`},
		{"content part no type", `{"messages": [{"role": "user", "content": [{"text": "a"}]}]}`, 400, "messages[0].content[0].type", `"messages[0].content[0].type" is required`},
		{"content part text type", `{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}`, 400, "messages[0].content[0].text", `"messages[0].content[0].text" must be a string`},
		{"content part text missing", `{"messages": [{"role": "user", "content": [{"type": "text"}]}]}`, 400, "messages[0].content[0].text", `"messages[0].content[0].text" is required`},
		{"max_completion_tokens over", `{"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 4097}`, 400, "max_completion_tokens", `"max_completion_tokens" must be at most 4096, got 4097`},
		{"logprobs", `{"messages": [{"role": "user", "content": "a"}], "logprobs": true}`, 400, "logprobs", `"logprobs" is not supported`},
		{"logprobs type", `{"messages": [{"role": "user", "content": "a"}], "logprobs": 1}`, 400, "logprobs", `"logprobs" must be a boolean`},
	}, withFields(`{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}`, commonErrs)...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, e := DecodeChat(strings.NewReader(tc.body), testLimits)
			checkErr(t, tc, e)
			if req != nil {
				t.Errorf("request %+v returned with an error", req)
			}
		})
	}
}

func TestDecodeCompletionValid(t *testing.T) {
	cases := []struct {
		name string
		body string
		want CompletionRequest
	}{
		{"defaults", `{"model": "tiny", "prompt": "Hello"}`, CompletionRequest{
			Model: "tiny", Prompt: Prompt{Text: "Hello"}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0)}},
		{"no model", `{"prompt": "Hello"}`, CompletionRequest{
			Prompt: Prompt{Text: "Hello"}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0)}},
		{"nulls are absent", `{"prompt": "Hello", "max_tokens": null, "temperature": null, "top_p": null, "seed": null, "stop": null, "stream_options": null, "n": null, "logprobs": null, "echo": null}`, CompletionRequest{
			Prompt: Prompt{Text: "Hello"}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0)}},
		{"everything", `{"model": "tiny", "prompt": ["Hello"], "max_tokens": 4096, "temperature": 0, "top_p": 0.9, "seed": -7,
			"stop": "\n", "stream": true, "stream_options": {"include_usage": true}, "user": "u1", "ignore_eos": true,
			"no_cache": true, "n": 1, "best_of": 1, "echo": false, "frequency_penalty": 0, "suffix": null, "extra": {"x": [1]}}`, CompletionRequest{
			Model: "tiny", Prompt: Prompt{Text: "Hello"}, MaxTokens: ptr(4096), Temperature: ptr(0.0), TopP: ptr(0.9),
			Seed: ptr(int64(-7)), Stop: []string{"\n"}, Stream: true, StreamOptions: &StreamOptions{IncludeUsage: true},
			User: "u1", IgnoreEOS: true, NoCache: true}},
		{"n", `{"prompt": "x", "n": 16}`, CompletionRequest{
			Prompt: Prompt{Text: "x"}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0), N: ptr(16)}},
		{"token ids", `{"prompt": [1, 2, 0]}`, CompletionRequest{
			Prompt: Prompt{Tokens: []int{1, 2, 0}}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0)}},
		{"nested token ids", `{"prompt": [[5]], "stop": ["a", "b", "c", "d"]}`, CompletionRequest{
			Prompt: Prompt{Tokens: []int{5}}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0), Stop: []string{"a", "b", "c", "d"}}},
		{"empty stop array", `{"prompt": "x", "stop": []}`, CompletionRequest{
			Prompt: Prompt{Text: "x"}, MaxTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, e := DecodeCompletion(strings.NewReader(tc.body), testLimits)
			if e != nil {
				t.Fatal(e)
			}
			if !reflect.DeepEqual(*got, tc.want) {
				t.Errorf("got  %s\nwant %s", mustJSON(t, got), mustJSON(t, tc.want))
			}
			roundTripCompletion(t, got, testLimits)
		})
	}
}

func TestDecodeChatValid(t *testing.T) {
	cases := []struct {
		name string
		body string
		want ChatCompletionRequest
	}{
		{"defaults", `{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}`, ChatCompletionRequest{
			Model: "tiny", Messages: []Message{{Role: "user", Content: Content{Text: "Hi"}}},
			MaxCompletionTokens: ptr(64), Temperature: ptr(1.0), TopP: ptr(1.0)}},
		{"max_tokens only", `{"messages": [{"role": "user", "content": ""}], "max_tokens": 10}`, ChatCompletionRequest{
			Messages: []Message{{Role: "user"}}, MaxTokens: ptr(10), Temperature: ptr(1.0), TopP: ptr(1.0)}},
		{"all roles and parts", `{"messages": [
			{"role": "system", "content": "Be brief."},
			{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
			{"role": "assistant", "content": "ok", "refusal": null},
			{"role": "tool", "content": "42", "tool_call_id": "call_1"}],
			"max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.7, "top_p": 0.5, "seed": 3,
			"stop": ["\n\n"], "stream": true, "stream_options": {}, "presence_penalty": 0, "tools": [], "n": 3}`, ChatCompletionRequest{
			Messages: []Message{
				{Role: "system", Content: Content{Text: "Be brief."}},
				{Role: "user", Content: Content{Parts: []ContentPart{{"text", "a"}, {"text", "b"}}}, Name: "ann"},
				{Role: "assistant", Content: Content{Text: "ok"}},
				{Role: "tool", Content: Content{Text: "42"}, ToolCallID: "call_1"},
			},
			MaxTokens: ptr(5), MaxCompletionTokens: ptr(7), Temperature: ptr(0.7), TopP: ptr(0.5), Seed: ptr(int64(3)),
			Stop: []string{"\n\n"}, Stream: true, StreamOptions: &StreamOptions{}, N: ptr(3)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, e := DecodeChat(strings.NewReader(tc.body), testLimits)
			if e != nil {
				t.Fatal(e)
			}
			if !reflect.DeepEqual(*got, tc.want) {
				t.Errorf("got  %s\nwant %s", mustJSON(t, got), mustJSON(t, tc.want))
			}
			roundTripChat(t, got, testLimits)
		})
	}
}

func TestDecodeReadErrors(t *testing.T) {
	req := httptest.NewRequest("POST", "/v1/completions", strings.NewReader(`{"prompt": "`+strings.Repeat("a", 100)+`"}`))
	body := http.MaxBytesReader(httptest.NewRecorder(), req.Body, 50)
	_, e := DecodeCompletion(body, Limits{})
	checkErr(t, errCase{body: "max bytes reader", status: 413, message: "request body is larger than 50 bytes"}, e)
	if e.Code != CodeRequestTooLarge {
		t.Errorf("code %q", e.Code)
	}
	_, e = DecodeChat(iotest.ErrReader(errors.New("connection reset")), Limits{})
	checkErr(t, errCase{body: "failing reader", status: 400, message: "reading the request body: connection reset"}, e)
}

// TestValidateBuilt checks requests a client builds rather than decodes.
func TestValidateBuilt(t *testing.T) {
	cases := []struct {
		name    string
		v       interface{ Validate(Limits) *Error }
		param   string
		message string
	}{
		{"ok", &CompletionRequest{Prompt: Prompt{Text: "a"}}, "", ""},
		{"empty tokens", &CompletionRequest{Prompt: Prompt{Tokens: []int{}}}, "prompt", `"prompt" must not be empty`},
		{"negative token", &CompletionRequest{Prompt: Prompt{Tokens: []int{-1}}}, "prompt", `"prompt[0]" must be a token id (at least 0), got -1`},
		{"chat ok", &ChatCompletionRequest{Messages: []Message{{Role: RoleUser}}}, "", ""},
		{"no messages", &ChatCompletionRequest{}, "messages", `"messages" must not be empty`},
		{"empty parts", &ChatCompletionRequest{Messages: []Message{{Role: RoleUser, Content: Content{Parts: []ContentPart{}}}}},
			"messages[0].content", `"messages[0].content" must not be an empty array`},
		{"image part", &ChatCompletionRequest{Messages: []Message{{Role: RoleUser, Content: Content{Parts: []ContentPart{{Type: "image_url"}}}}}},
			"messages[0].content[0].type", `content part type "image_url" is not supported, only "text"`},
		{"max_tokens", &ChatCompletionRequest{Messages: []Message{{Role: RoleUser}}, MaxTokens: ptr(0)},
			"max_tokens", `"max_tokens" must be at least 1, got 0`},
	}
	for _, tc := range cases {
		e := tc.v.Validate(testLimits)
		if tc.message == "" {
			if e != nil {
				t.Errorf("%s: %v", tc.name, e)
			}
			continue
		}
		if e == nil || e.Status != 400 || e.Param != tc.param || e.Message != tc.message {
			t.Errorf("%s: got %v, want param %q %q", tc.name, e, tc.param, tc.message)
		}
	}
}

func TestParams(t *testing.T) {
	l := Limits{DefaultMaxTokens: 100, MaxTokens: 50}
	if got := (&CompletionRequest{}).Params(l); !reflect.DeepEqual(got, Params{MaxTokens: 50, Temperature: 1, TopP: 1}) {
		t.Errorf("empty completion: %+v", got)
	}
	chat := &ChatCompletionRequest{MaxTokens: ptr(5), MaxCompletionTokens: ptr(7), Temperature: ptr(0.0), Seed: ptr(int64(9)), Stop: []string{"x"}, IgnoreEOS: true, NoCache: true}
	want := Params{MaxTokens: 7, Temperature: 0, TopP: 1, Seed: 9, HasSeed: true, Stop: []string{"x"}, IgnoreEOS: true, NoCache: true}
	if got := chat.Params(l); !reflect.DeepEqual(got, want) {
		t.Errorf("chat: %+v, want %+v", got, want)
	}
	if got := (Limits{}).defaultMaxTokens(); got != DefaultMaxTokens {
		t.Errorf("zero limits default max tokens = %d", got)
	}
}

func TestContentString(t *testing.T) {
	if got := (Content{Text: "x"}).String(); got != "x" {
		t.Errorf("%q", got)
	}
	if got := (Content{Parts: []ContentPart{{"text", "a"}, {"text", "b"}}}).String(); got != "a\nb" {
		t.Errorf("%q", got)
	}
}

// TestUnmarshalJSON checks that the request types also decode with
// encoding/json, through the same parsers.
func TestUnmarshalJSON(t *testing.T) {
	var req CompletionRequest
	if err := json.Unmarshal([]byte(`{"prompt": [[1, 2]]}`), &req); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(req.Prompt, Prompt{Tokens: []int{1, 2}}) {
		t.Errorf("prompt %+v", req.Prompt)
	}
	var m Message
	if err := json.Unmarshal([]byte(`{"role": "user", "content": [{"type": "text", "text": "a"}]}`), &m); err != nil {
		t.Fatal(err)
	}
	if m.Content.String() != "a" {
		t.Errorf("content %+v", m.Content)
	}
	err := json.Unmarshal([]byte(`{"prompt": ["a", "b"]}`), &req)
	var e *Error
	if !errors.As(err, &e) || e.Param != "prompt" {
		t.Errorf("batched prompt: %v", err)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// roundTripCompletion checks that a decoded request encodes to JSON that
// decodes to the same request.
func roundTripCompletion(t testing.TB, req *CompletionRequest, l Limits) {
	t.Helper()
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	l.MaxBodyBytes = 0
	again, e := DecodeCompletion(strings.NewReader(string(b)), l)
	if e != nil {
		t.Fatalf("re-decoding %s: %v", b, e)
	}
	if !reflect.DeepEqual(again, req) {
		b2, _ := json.Marshal(again)
		t.Fatalf("round trip changed the request:\n%s\n%s", b, b2)
	}
}

func roundTripChat(t testing.TB, req *ChatCompletionRequest, l Limits) {
	t.Helper()
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	l.MaxBodyBytes = 0
	again, e := DecodeChat(strings.NewReader(string(b)), l)
	if e != nil {
		t.Fatalf("re-decoding %s: %v", b, e)
	}
	if !reflect.DeepEqual(again, req) {
		b2, _ := json.Marshal(again)
		t.Fatalf("round trip changed the request:\n%s\n%s", b, b2)
	}
}

func TestDecodePDFields(t *testing.T) {
	req, e := DecodeCompletion(strings.NewReader(`{"prompt":"x","bootstrap_room":18446744073709551615,"bootstrap_url":"http://127.0.0.1:8998"}`), Limits{})
	if e != nil || req.PD.BootstrapRoom == nil || *req.PD.BootstrapRoom != 1<<64-1 || req.PD.BootstrapURL != "http://127.0.0.1:8998" {
		t.Fatalf("%+v %v", req, e)
	}
	chat, e := DecodeChat(strings.NewReader(`{"messages":[{"role":"user","content":"x"}],"bootstrap_room":7}`), Limits{})
	if e != nil || chat.PD.BootstrapRoom == nil || *chat.PD.BootstrapRoom != 7 {
		t.Fatalf("%+v %v", chat, e)
	}
	for body, want := range map[string]uint64{`{"prompt":"x","bootstrap_room":"7"}`: 7, `{"prompt":"x","bootstrap_room":"18446744073709551615"}`: 1<<64 - 1} {
		req, e := DecodeCompletion(strings.NewReader(body), Limits{})
		if e != nil || req.PD.BootstrapRoom == nil || *req.PD.BootstrapRoom != want {
			t.Errorf("%s: %+v %v", body, req.PD, e)
		}
	}
	for _, body := range []string{`{"prompt":"x","bootstrap_room":-1}`, `{"prompt":"x","bootstrap_room":"x"}`, `{"prompt":"x","bootstrap_room":"-1"}`, `{"prompt":"x","bootstrap_room":"7 "}`,
		`{"prompt":"x","bootstrap_room":1.5}`, `{"prompt":"x","bootstrap_url":7}`} {
		if _, e := DecodeCompletion(strings.NewReader(body), Limits{}); e == nil || e.Status != 400 {
			t.Errorf("%s: %v", body, e)
		}
	}
}
