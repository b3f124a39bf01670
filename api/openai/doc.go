// Package openai holds the OpenAI-compatible wire types of pdkit's server
// (POST /v1/completions, POST /v1/chat/completions, GET /v1/models), the
// decoding and validation of requests, and the error body.
//
// Decoding is strict about what it understands and lenient about the rest:
// unknown fields are accepted and ignored, because OpenAI clients send many
// that pdkit has no use for, but every known field must have the right JSON
// type and a value in range, and a failure names the field (its param) in an
// *Error carrying the HTTP status to answer with. JSON null for an optional
// field means the field is absent. Features pdkit does not implement are
// refused with 400 rather than ignored, so that a client never receives an
// answer to a question it did not ask: best_of other than 1, echo,
// logprobs, and every OpenAI parameter whose
// value would change the answer: tools and tool_choice, response_format,
// penalties, logit_bias, suffix and the others listed in unsupported.go.
// The error names the parameter (param) and has code
// "unsupported_parameter"; a value that asks for nothing beyond what pdkit
// does anyway ("tool_choice": "none", "response_format": {"type": "text"},
// a penalty of 0, "tools": []) is accepted.
//
// "n", the number of choices, is 1 to MaxChoices (16); N is nil for one.
//
// Two pdkit extensions, booleans in both requests: "ignore_eos" generates
// past end-of-sequence tokens (for benchmarks), and "no_cache" computes the
// whole prompt without reading the prefix cache or its host tier (for
// reference outputs and canaries: a healthy server gives the same greedy
// tokens with and without it).
//
// After DecodeCompletion or DecodeChat succeeds, MaxTokens (for chat:
// MaxCompletionTokens when max_tokens was absent), Temperature and TopP are
// set; Params turns a request into plain sampling values.
package openai
