// Package server is pdkit's HTTP front end over a colocated serve.Engine:
// the OpenAI-compatible API (POST /v1/completions, POST
// /v1/chat/completions, GET /v1/models), a native POST /generate, POST
// /abort_request, GET /health, GET /metrics (Prometheus text, see
// internal/metrics) and a versioned debug API (GET /debug/v1/state, GET
// /debug/v1/stacks?rank=N).
//
// # Requests
//
// Bodies are decoded and validated by api/openai with the model's name
// (general.name, else the file's base name), max_tokens bounded by the
// context length and a 4 MiB body limit. A prompt longer than the context
// less max_tokens gets 400 with param "prompt". Each request is submitted
// with its HTTP request's context, so a client that disconnects aborts its
// request at once. Generated tokens are turned into text by a
// tokenizer.StreamDecoder, so UTF-8 characters are never split across
// stream chunks; end-of-generation tokens produce no text.
//
// Stop strings are applied to the text: the output is cut before the first
// occurrence of any of them, the finish reason becomes "stop" and the rest
// of the generation is aborted. While streaming, text that could still be
// the start of a stop string is held back until it is decided, so that the
// concatenated chunks of a streamed request always equal the text of the
// same request unstreamed. Usage counts every token the engine produced up
// to the stop, the one that completed the stop string included.
//
// # Chat template
//
// GGUF chat templates (tokenizer.chat_template, Jinja) are not interpreted
// yet. Every model uses the default template: the BOS token, then for each
// message "<|role|>\n" + content + "\n", then "<|assistant|>\n". The text
// is encoded with Encode(text, true) (which adds the BOS), so the role
// markers are plain text and a message cannot inject control tokens.
//
// # Errors
//
// Every error, unknown paths and wrong methods included, is answered with an
// OpenAI-style JSON error body and a 4xx status (5xx for server faults). A
// handler that panics is recovered by a middleware, logged with log/slog and
// answered with a 500 JSON error.
//
// # Health and debug
//
// GET /health answers 200 with the engine's Health as JSON while the loop
// has iterated within Options.StallAfter, has not failed and (when
// Options.MaxQueueAge is set) no request has waited longer than that for
// admission; else 503 with the reason. GET /debug/v1/state is the engine's last published Snapshot
// and step record. GET /debug/v1/stacks is the goroutine profile in pprof's
// debug=1 text; with ?rank=N only the goroutine groups whose pprof labels
// carry rank=N are kept.
//
// GET /metrics serves Options.Metrics' registry. The engine's gauges and
// counters are read at scrape time; the token counters and the latency
// histograms need the same Metrics set as the engine's
// serve.Config.Observer.
//
// Not yet here: prefix-cache and collective-wait metrics, the /admin/v1 calls
// and their token, per-rank flight recorders in the debug API, GGUF chat
// templates, several choices per request, and a requests-per-queue view
// beyond what the engine snapshot carries.
package server
