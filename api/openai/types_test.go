package openai

import (
	"encoding/json"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
)

// The golden strings below follow the shapes of OpenAI's API reference.
func TestResponseGolden(t *testing.T) {
	stop, length := FinishStop, FinishLength
	cases := []struct {
		name   string
		v      any
		golden string
	}{
		{"completion", &CompletionResponse{
			ID: "cmpl-1", Object: ObjectTextCompletion, Created: 1700000000, Model: "tiny",
			Choices: []CompletionChoice{{Text: " there", Index: 0, FinishReason: FinishLength}},
			Usage:   Usage{PromptTokens: 3, CompletionTokens: 2, TotalTokens: 5},
		}, `{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"tiny",` +
			`"choices":[{"text":" there","index":0,"logprobs":null,"finish_reason":"length"}],` +
			`"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`},
		{"chat", &ChatCompletionResponse{
			ID: "chatcmpl-1", Object: ObjectChatCompletion, Created: 1700000000, Model: "tiny",
			Choices: []ChatChoice{{Index: 0, Message: ChatMessage{Role: RoleAssistant, Content: "Hi!"}, FinishReason: FinishStop}},
			Usage:   Usage{PromptTokens: 9, CompletionTokens: 3, TotalTokens: 12},
		}, `{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"tiny",` +
			`"choices":[{"index":0,"message":{"role":"assistant","content":"Hi!"},"logprobs":null,"finish_reason":"stop"}],` +
			`"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}`},
		{"completion chunk", &CompletionChunk{
			ID: "cmpl-1", Object: ObjectTextCompletion, Created: 1700000000, Model: "tiny",
			Choices: []CompletionChunkChoice{{Text: " the", Index: 0}},
		}, `{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"tiny",` +
			`"choices":[{"text":" the","index":0,"logprobs":null,"finish_reason":null}]}`},
		{"completion last chunk", &CompletionChunk{
			ID: "cmpl-1", Object: ObjectTextCompletion, Created: 1700000000, Model: "tiny",
			Choices: []CompletionChunkChoice{{Text: "", Index: 0, FinishReason: &length}},
		}, `{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"tiny",` +
			`"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}]}`},
		{"chat first chunk", &ChatCompletionChunk{
			ID: "chatcmpl-1", Object: ObjectChatChunk, Created: 1700000000, Model: "tiny",
			Choices: []ChatChunkChoice{{Index: 0, Delta: ChatDelta{Role: RoleAssistant}}},
		}, `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"tiny",` +
			`"choices":[{"index":0,"delta":{"role":"assistant"},"logprobs":null,"finish_reason":null}]}`},
		{"chat content chunk", &ChatCompletionChunk{
			ID: "chatcmpl-1", Object: ObjectChatChunk, Created: 1700000000, Model: "tiny",
			Choices: []ChatChunkChoice{{Index: 0, Delta: ChatDelta{Content: "Hel"}}},
		}, `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"tiny",` +
			`"choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}`},
		{"chat finish chunk", &ChatCompletionChunk{
			ID: "chatcmpl-1", Object: ObjectChatChunk, Created: 1700000000, Model: "tiny",
			Choices: []ChatChunkChoice{{Index: 0, FinishReason: &stop}},
		}, `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"tiny",` +
			`"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}`},
		{"chat usage chunk", &ChatCompletionChunk{
			ID: "chatcmpl-1", Object: ObjectChatChunk, Created: 1700000000, Model: "tiny",
			Choices: []ChatChunkChoice{}, Usage: &Usage{PromptTokens: 9, CompletionTokens: 3, TotalTokens: 12},
		}, `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"tiny",` +
			`"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}`},
		{"models", &ModelList{Object: ObjectList, Data: []Model{{ID: "tiny", Object: ObjectModel, Created: 1700000000, OwnedBy: "pdkit"}}},
			`{"object":"list","data":[{"id":"tiny","object":"model","created":1700000000,"owned_by":"pdkit"}]}`},
		{"error", (&Error{Status: 404, Message: `model "x" does not exist`, Type: TypeInvalidRequest, Param: "model", Code: CodeModelNotFound}).Body(),
			`{"error":{"message":"model \"x\" does not exist","type":"invalid_request_error","param":"model","code":"model_not_found"}}`},
		{"error nulls", (&Error{Status: 400, Message: "bad", Type: TypeInvalidRequest}).Body(),
			`{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}`},
		{"completion request", &CompletionRequest{Prompt: Prompt{Tokens: []int{1, 2}}, MaxTokens: ptr(8), Temperature: ptr(0.0), Stop: []string{"x"}},
			`{"prompt":[1,2],"max_tokens":8,"temperature":0,"stop":["x"]}`},
		{"chat request", &ChatCompletionRequest{Model: "tiny", Messages: []Message{
			{Role: RoleUser, Content: Content{Text: "a"}},
			{Role: RoleUser, Content: Content{Parts: []ContentPart{{Type: "text", Text: "b"}}}}}},
			`{"model":"tiny","messages":[{"role":"user","content":"a"},{"role":"user","content":[{"type":"text","text":"b"}]}]}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, err := json.Marshal(tc.v)
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tc.golden {
				t.Fatalf("got  %s\nwant %s", b, tc.golden)
			}
			// Decoding the golden string gives the value back.
			back := reflect.New(reflect.TypeOf(tc.v)).Interface()
			if err := json.Unmarshal(b, back); err != nil {
				t.Fatal(err)
			}
			if got := reflect.ValueOf(back).Elem().Interface(); !reflect.DeepEqual(got, tc.v) {
				t.Errorf("round trip: got %#v, want %#v", got, tc.v)
			}
		})
	}
}

func TestErrorWriteJSON(t *testing.T) {
	rec := httptest.NewRecorder()
	ModelNotFound("x").WriteJSON(rec)
	if rec.Code != 404 {
		t.Errorf("status %d", rec.Code)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("content type %q", ct)
	}
	want := `{"error":{"message":"model \"x\" does not exist","type":"invalid_request_error","param":"model","code":"model_not_found"}}` + "\n"
	if rec.Body.String() != want {
		t.Errorf("body %s", rec.Body)
	}
	back := ParseError(rec.Code, rec.Body.Bytes())
	if !reflect.DeepEqual(back, ModelNotFound("x")) {
		t.Errorf("ParseError: %+v", back)
	}
	rec = httptest.NewRecorder()
	(&Error{Message: "boom", Type: TypeServer}).WriteJSON(rec)
	if rec.Code != 500 {
		t.Errorf("unset status written as %d", rec.Code)
	}
	if e := ParseError(502, []byte("bad gateway")); e.Status != 502 || e.Type != TypeServer || e.Message != "bad gateway" {
		t.Errorf("non-JSON body: %+v", e)
	}
	if got := ModelNotFound("x").Error(); got != `404 invalid_request_error (param model): model "x" does not exist` {
		t.Errorf("Error() = %s", got)
	}
	if got := ServerError("oops").Error(); got != `500 server_error: oops` {
		t.Errorf("Error() = %s", got)
	}
}

func TestSSE(t *testing.T) {
	rec := httptest.NewRecorder()
	if err := WriteEvent(rec, ChatCompletionChunk{ID: "c", Object: ObjectChatChunk, Choices: []ChatChunkChoice{{Delta: ChatDelta{Content: "a<b"}}}}); err != nil {
		t.Fatal(err)
	}
	if err := WriteDone(rec); err != nil {
		t.Fatal(err)
	}
	want := `data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"",` +
		`"choices":[{"index":0,"delta":{"content":"a\u003cb"},"logprobs":null,"finish_reason":null}]}` + "\n\n" +
		"data: [DONE]\n\n"
	if got := rec.Body.String(); got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
	if !rec.Flushed {
		t.Error("not flushed")
	}
	var sb strings.Builder
	if err := WriteEvent(&sb, func() {}); err == nil {
		t.Error("unencodable value written")
	}
	if sb.Len() != 0 {
		t.Errorf("partial event %q", sb.String())
	}
}
