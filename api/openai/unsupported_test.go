package openai

import (
	"strings"
	"testing"
)

const chatBody = `{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}`

// The parameters pdkit does not implement are refused, naming the
// parameter, with code unsupported_parameter; a wrong type is a plain
// invalid request (no code).
func TestUnsupportedParamsRefused(t *testing.T) {
	type refusal struct {
		name, body, param, message string
		unsupported                bool // code unsupported_parameter
	}
	common := []refusal{
		{"frequency_penalty", `{"frequency_penalty": 0.5}`, "frequency_penalty", `"frequency_penalty" is not supported; only 0 (the default) is accepted, got 0.5`, true},
		{"presence_penalty", `{"presence_penalty": -1}`, "presence_penalty", `"presence_penalty" is not supported; only 0 (the default) is accepted, got -1`, true},
		{"penalty out of range", `{"presence_penalty": 2.5}`, "presence_penalty", `"presence_penalty" must be between -2 and 2, got 2.5`, false},
		{"penalty type", `{"frequency_penalty": "0"}`, "frequency_penalty", `"frequency_penalty" must be a number`, false},
		{"logit_bias", `{"logit_bias": {"50256": -100}}`, "logit_bias", `"logit_bias" is not supported; only an empty object is accepted`, true},
		{"logit_bias type", `{"logit_bias": [1]}`, "logit_bias", `"logit_bias" must be an object mapping token ids to biases`, false},
		{"n", `{"n": 17}`, "n", `"n" must be at most 16, got 17`, false},
	}
	completion := append([]refusal{
		{"suffix", `{"suffix": "end"}`, "suffix", `"suffix" is not supported (no insertion); only an empty string is accepted`, true},
		{"suffix type", `{"suffix": 1}`, "suffix", `"suffix" must be a string`, false},
		{"best_of", `{"best_of": 2}`, "best_of", `"best_of" must be 1: one candidate per request is supported, got 2; "n" gives up to 16 choices`, true},
	}, common...)
	const noTools = `"tools" is not supported: pdkit does not call tools yet; send the request without tools ("tools": [] and "tool_choice": "none" are accepted)`
	chat := append([]refusal{
		{"tools", `{"tools": [{"type": "function", "function": {"name": "f"}}]}`, "tools", noTools, true},
		{"tools with tool_choice none", `{"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}`, "tools", noTools, true},
		{"tools type", `{"tools": {"type": "function"}}`, "tools", `"tools" must be an array`, false},
		{"tool_choice required", `{"tool_choice": "required"}`, "tool_choice", `"tool_choice" "required" is not supported: pdkit does not call tools yet; only "none" (and "auto" without tools) is accepted`, true},
		{"tool_choice named", `{"tool_choice": {"type": "function", "function": {"name": "f"}}}`, "tool_choice", `"tool_choice" naming a tool is not supported: pdkit does not call tools yet; only "none" (and "auto" without tools) is accepted`, true},
		{"tool_choice unknown", `{"tool_choice": "always"}`, "tool_choice", `"tool_choice" must be "none", "auto", "required" or an object, got "always"`, false},
		{"tool_choice type", `{"tool_choice": 1}`, "tool_choice", `"tool_choice" must be "none", "auto", "required" or an object`, false},
		{"parallel_tool_calls type", `{"parallel_tool_calls": "yes"}`, "parallel_tool_calls", `"parallel_tool_calls" must be a boolean`, false},
		{"functions", `{"functions": [{"name": "f"}]}`, "functions", `"functions" is not supported: pdkit does not call functions; send the request without functions`, true},
		{"function_call named", `{"function_call": {"name": "f"}}`, "function_call", `"function_call" naming a tool is not supported: pdkit does not call functions; only "none" (and "auto" without functions) is accepted`, true},
		{"response_format json_object", `{"response_format": {"type": "json_object"}}`, "response_format", `"response_format" of type "json_object" is not supported: pdkit does not constrain output to JSON yet; only {"type": "text"} is accepted`, true},
		{"response_format json_schema", `{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}`, "response_format", `"response_format" of type "json_schema" is not supported: pdkit does not constrain output to JSON yet; only {"type": "text"} is accepted`, true},
		{"response_format string", `{"response_format": "json"}`, "response_format", `"response_format" must be an object such as {"type": "text"}`, false},
		{"response_format no type", `{"response_format": {}}`, "response_format.type", `"response_format.type" must be "text", "json_object" or "json_schema"`, false},
		{"response_format unknown type", `{"response_format": {"type": "yaml"}}`, "response_format.type", `"response_format.type" must be "text", "json_object" or "json_schema", got "yaml"`, false},
		{"modalities audio", `{"modalities": ["text", "audio"]}`, "modalities", `"modalities" "audio" is not supported; only ["text"] is accepted`, true},
		{"modalities type", `{"modalities": "text"}`, "modalities", `"modalities" must be an array of strings`, false},
		{"audio", `{"audio": {"voice": "alloy", "format": "wav"}}`, "audio", `"audio" is not supported; send the request without it`, true},
		{"reasoning_effort", `{"reasoning_effort": "low"}`, "reasoning_effort", `"reasoning_effort" is not supported; send the request without it`, true},
		{"web_search_options", `{"web_search_options": {}}`, "web_search_options", `"web_search_options" is not supported; send the request without it`, true},
		{"verbosity", `{"verbosity": "low"}`, "verbosity", `"verbosity" "low" is not supported; only "medium" (the default) is accepted`, true},
		{"store", `{"store": true}`, "store", `"store" is not supported: pdkit does not store completions; only false is accepted`, true},
		{"metadata type", `{"metadata": "x"}`, "metadata", `"metadata" must be an object`, false},
		{"prediction type", `{"prediction": "x"}`, "prediction", `"prediction" must be an object`, false},
		{"service_tier type", `{"service_tier": 1}`, "service_tier", `"service_tier" must be a string`, false},
		{"message tool_calls", `{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}`,
			"messages[1].tool_calls", `"messages[1].tool_calls" is not supported: pdkit does not call tools yet, so a conversation cannot carry tool calls`, true},
		{"message tool_calls type", `{"messages": [{"role": "assistant", "content": "x", "tool_calls": {}}]}`, "messages[0].tool_calls", `"messages[0].tool_calls" must be an array`, false},
		{"message function_call", `{"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]}`,
			"messages[0].function_call", `"messages[0].function_call" is not supported: pdkit does not call functions`, true},
	}, common...)

	run := func(t *testing.T, rs []refusal, valid string, decode func(string) (any, *Error)) {
		for _, r := range rs {
			t.Run(r.name, func(t *testing.T) {
				body := strings.TrimSuffix(valid, "}") + ", " + r.body[1:]
				if strings.HasPrefix(r.body, `{"messages"`) {
					body = r.body // replaces the messages
				}
				req, e := decode(body)
				checkErr(t, errCase{body: body, status: 400, param: r.param, message: r.message}, e)
				if req != nil && e == nil {
					t.Errorf("request returned with an error")
				}
				wantCode := ""
				if r.unsupported {
					wantCode = CodeUnsupported
				}
				if e != nil && e.Code != wantCode {
					t.Errorf("code = %q, want %q", e.Code, wantCode)
				}
			})
		}
	}
	t.Run("completion", func(t *testing.T) {
		run(t, completion, `{"model": "tiny", "prompt": "Once"}`, func(b string) (any, *Error) {
			r, e := DecodeCompletion(strings.NewReader(b), testLimits)
			return r, e
		})
	})
	t.Run("chat", func(t *testing.T) {
		run(t, chat, chatBody, func(b string) (any, *Error) {
			r, e := DecodeChat(strings.NewReader(b), testLimits)
			return r, e
		})
	})
}

// The harmless values of those parameters, which ask for nothing beyond
// what pdkit does, are accepted and leave the request as it would be
// without them.
func TestUnsupportedParamsHarmlessDefaults(t *testing.T) {
	plainChat, e := DecodeChat(strings.NewReader(chatBody), testLimits)
	if e != nil {
		t.Fatal(e)
	}
	for _, fields := range []string{
		`"tools": []`,
		`"tool_choice": "none"`,
		`"tool_choice": "auto"`,
		`"tools": [], "tool_choice": "auto"`,
		`"functions": [], "function_call": "none"`,
		`"function_call": "auto"`,
		`"parallel_tool_calls": false`,
		`"response_format": {"type": "text"}`,
		`"modalities": ["text"]`,
		`"verbosity": "medium"`,
		`"store": false`,
		`"metadata": {"k": "v"}`,
		`"service_tier": "auto"`,
		`"prompt_cache_key": "k"`,
		`"safety_identifier": "u"`,
		`"prediction": {"type": "content", "content": "Hi"}`,
		`"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}`,
		`"audio": null, "reasoning_effort": null, "web_search_options": null, "tools": null, "response_format": null`,
	} {
		body := strings.TrimSuffix(chatBody, "}") + ", " + fields + "}"
		got, e := DecodeChat(strings.NewReader(body), testLimits)
		if e != nil {
			t.Errorf("%s: %v", fields, e)
			continue
		}
		if mustJSON(t, got) != mustJSON(t, plainChat) {
			t.Errorf("%s: got %s, want %s", fields, mustJSON(t, got), mustJSON(t, plainChat))
		}
	}
	// A message's empty tool_calls is no tool call.
	body := `{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": []}, {"role": "user", "content": "Hi"}]}`
	if _, e := DecodeChat(strings.NewReader(body), testLimits); e != nil {
		t.Errorf("empty tool_calls: %v", e)
	}

	const completionBody = `{"model": "tiny", "prompt": "Once"}`
	plain, e := DecodeCompletion(strings.NewReader(completionBody), testLimits)
	if e != nil {
		t.Fatal(e)
	}
	for _, fields := range []string{`"suffix": ""`, `"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}`, `"best_of": 1, "n": 1`} {
		body := strings.TrimSuffix(completionBody, "}") + ", " + fields + "}"
		got, e := DecodeCompletion(strings.NewReader(body), testLimits)
		if e != nil {
			t.Errorf("%s: %v", fields, e)
			continue
		}
		if mustJSON(t, got) != mustJSON(t, plain) {
			t.Errorf("%s: got %s, want %s", fields, mustJSON(t, got), mustJSON(t, plain))
		}
	}
}
