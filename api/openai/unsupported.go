package openai

import (
	"encoding/json"
	"fmt"
	"strconv"
)

// The OpenAI request parameters pdkit does not implement. Each is refused
// with a 400 naming it (code unsupported_parameter) unless its value asks
// for nothing beyond what pdkit does anyway, in which case it is accepted
// and has no effect; a value of the wrong JSON type is a 400 too. The
// harmless values, by parameter (both APIs unless marked):
//
//	frequency_penalty, presence_penalty  0
//	logit_bias                           {}
//	suffix (completions)                 ""
//	tools (chat)                         []
//	tool_choice (chat)                   "none"; "auto" when no tools are given
//	functions (chat, deprecated)         []
//	function_call (chat, deprecated)     "none"; "auto" when no functions are given
//	parallel_tool_calls (chat)           any boolean (it only shapes tool calls)
//	response_format (chat)               {"type": "text"}
//	modalities (chat)                    ["text"]
//	verbosity (chat)                     "medium"
//	store (chat)                         false
//
// audio, reasoning_effort and web_search_options (chat) are refused with any
// value. Accepted and ignored whatever their value, because they do not
// change what is generated: metadata, service_tier, prompt_cache_key,
// safety_identifier and prediction (chat; a latency hint whose absence
// leaves the output the same). In a message, tool_calls and function_call
// are refused unless empty, since the conversation would otherwise reach
// the model without them.
//
// A JSON null is an absent field, as everywhere in this package.

// unsupportedCommon checks the parameters that completions and chat share.
func (f *fieldReader) unsupportedCommon() {
	f.penalty("frequency_penalty")
	f.penalty("presence_penalty")
	if raw, ok := f.get("logit_bias"); ok && f.err == nil {
		obj, ok := object(raw)
		switch {
		case !ok:
			f.fail(invalidf("logit_bias", `"logit_bias" must be an object mapping token ids to biases`))
		case len(obj) > 0:
			f.fail(unsupportedf("logit_bias", `"logit_bias" is not supported; only an empty object is accepted`))
		}
	}
}

// unsupportedCompletion checks the parameters only completions have.
func (f *fieldReader) unsupportedCompletion() {
	if s := f.str("suffix"); s != "" {
		f.fail(unsupportedf("suffix", `"suffix" is not supported (no insertion); only an empty string is accepted`))
	}
}

// unsupportedChat checks the parameters only chat has.
func (f *fieldReader) unsupportedChat() {
	tools := f.emptyArray("tools", `"tools" is not supported: pdkit does not call tools yet; send the request without tools ("tools": [] and "tool_choice": "none" are accepted)`)
	f.choice("tool_choice", tools, `"tool_choice" %s is not supported: pdkit does not call tools yet; only "none" (and "auto" without tools) is accepted`)
	functions := f.emptyArray("functions", `"functions" is not supported: pdkit does not call functions; send the request without functions`)
	f.choice("function_call", functions, `"function_call" %s is not supported: pdkit does not call functions; only "none" (and "auto" without functions) is accepted`)
	f.boolean("parallel_tool_calls")
	f.responseFormat()
	if raw, ok := f.get("modalities"); ok && f.err == nil {
		var ms []string
		if raw[0] != '[' || json.Unmarshal(raw, &ms) != nil {
			f.fail(invalidf("modalities", `"modalities" must be an array of strings`))
		} else {
			for _, m := range ms {
				if m != "text" {
					f.fail(unsupportedf("modalities", `"modalities" %q is not supported; only ["text"] is accepted`, m))
					break
				}
			}
		}
	}
	if _, ok := f.get("verbosity"); ok {
		if v := f.str("verbosity"); f.err == nil && v != "medium" {
			f.fail(unsupportedf("verbosity", `"verbosity" %q is not supported; only "medium" (the default) is accepted`, v))
		}
	}
	if f.boolean("store") {
		f.fail(unsupportedf("store", `"store" is not supported: pdkit does not store completions; only false is accepted`))
	}
	for _, name := range []string{"audio", "reasoning_effort", "web_search_options"} {
		if _, ok := f.get(name); ok {
			f.fail(unsupportedf(name, "%q is not supported; send the request without it", name))
		}
	}
	// Accepted and ignored; only their types are checked.
	f.str("service_tier")
	f.str("prompt_cache_key")
	f.str("safety_identifier")
	for _, name := range []string{"metadata", "prediction"} {
		if raw, ok := f.get(name); ok && f.err == nil {
			if _, ok := object(raw); !ok {
				f.fail(invalidf(name, "%q must be an object", name))
			}
		}
	}
}

// unsupportedMessage checks the fields of message i that pdkit cannot pass
// on to the model.
func (f *fieldReader) unsupportedMessage(i int) {
	name := fmt.Sprintf("messages[%d].tool_calls", i)
	f.emptyArrayAs("tool_calls", name, fmt.Sprintf(`%q is not supported: pdkit does not call tools yet, so a conversation cannot carry tool calls`, name))
	if _, ok := f.get("function_call"); ok {
		name := fmt.Sprintf("messages[%d].function_call", i)
		f.fail(unsupportedf(name, `%q is not supported: pdkit does not call functions`, name))
	}
}

// penalty reads a penalty: a number between -2 and 2, of which only 0 is
// accepted.
func (f *fieldReader) penalty(name string) {
	v := f.floatp(name)
	switch {
	case v == nil:
	case !(*v >= -2 && *v <= 2):
		f.fail(invalidf(name, `%q must be between -2 and 2, got %s`, name, fmtFloat(*v)))
	case *v != 0:
		f.fail(unsupportedf(name, `%q is not supported; only 0 (the default) is accepted, got %s`, name, fmtFloat(*v)))
	}
}

// emptyArray reads an array that must be empty; it reports whether the
// field was absent or empty.
func (f *fieldReader) emptyArray(name, unsupported string) bool {
	return f.emptyArrayAs(name, name, unsupported)
}

// emptyArrayAs is emptyArray for a field whose param is param.
func (f *fieldReader) emptyArrayAs(name, param, unsupported string) bool {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return true
	}
	var items []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &items) != nil {
		f.fail(invalidf(param, "%q must be an array", param))
		return false
	}
	if len(items) > 0 {
		f.fail(unsupportedf(param, "%s", unsupported))
		return false
	}
	return true
}

// choice reads tool_choice or function_call: "none", or "auto" when the
// list of tools (functions) is empty, are accepted; "required" and objects
// (a forced call) are not. unsupported has a %s for the value.
func (f *fieldReader) choice(name string, noList bool, unsupported string) {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return
	}
	if raw[0] == '{' {
		if _, ok := object(raw); ok {
			f.fail(unsupportedf(name, unsupported, "naming a tool"))
			return
		}
	}
	s, e := parseString(raw, name)
	if e != nil {
		f.fail(invalidf(name, `%q must be "none", "auto", "required" or an object`, name))
		return
	}
	switch s {
	case "none":
	case "auto":
		if !noList {
			f.fail(unsupportedf(name, unsupported, strconv.Quote(s)))
		}
	case "required":
		f.fail(unsupportedf(name, unsupported, strconv.Quote(s)))
	default:
		f.fail(invalidf(name, `%q must be "none", "auto", "required" or an object, got %q`, name, s))
	}
}

// responseFormat reads response_format: {"type": "text"} is accepted,
// "json_object" and "json_schema" are refused.
func (f *fieldReader) responseFormat() {
	raw, ok := f.get("response_format")
	if !ok || f.err != nil {
		return
	}
	obj, ok := object(raw)
	if !ok {
		f.fail(invalidf("response_format", `"response_format" must be an object such as {"type": "text"}`))
		return
	}
	sub := fieldReader{fields: obj}
	typ := sub.str("type")
	switch {
	case sub.err != nil || typ == "":
		f.fail(invalidf("response_format.type", `"response_format.type" must be "text", "json_object" or "json_schema"`))
	case typ == "text":
	case typ == "json_object" || typ == "json_schema":
		f.fail(unsupportedf("response_format", `"response_format" of type %q is not supported: pdkit does not constrain output to JSON yet; only {"type": "text"} is accepted`, typ))
	default:
		f.fail(invalidf("response_format.type", `"response_format.type" must be "text", "json_object" or "json_schema", got %q`, typ))
	}
}

// object parses a JSON object.
func object(raw json.RawMessage) (map[string]json.RawMessage, bool) {
	var obj map[string]json.RawMessage
	if len(raw) == 0 || raw[0] != '{' || json.Unmarshal(raw, &obj) != nil {
		return nil, false
	}
	return obj, true
}
