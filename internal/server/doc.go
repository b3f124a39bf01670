// Package server is pdkit's HTTP front end over a colocated serve.Engine:
// the OpenAI-compatible API (POST /v1/completions, POST
// /v1/chat/completions, GET /v1/models), a native POST /generate, POST
// /abort_request, GET /health, GET /livez and /readyz (probes.go), GET
// /metrics (Prometheus text, see
// internal/metrics), a versioned read-only debug API (GET /debug/v1/...)
// and an admin API (POST /admin/v1/...).
//
// # Requests
//
// Bodies are decoded and validated by api/openai with the model's name
// (general.name, else the file's base name), max_tokens bounded by the
// context length and a body limit: 4 MiB, or less where no prompt that
// fits the context could need as much (openai.PromptBound). A prompt longer
// than the context less max_tokens gets 400 with param "prompt"; one whose
// bytes of text, token ids or messages cannot fit is refused before it is
// tokenized (promptcap.go). Each request is submitted
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
// Several choices ("n", up to openai.MaxChoices; sampling_params.n on
// /generate) are samples of one prompt that the engine prefills once
// (serve.Engine.SubmitN): every choice has its own sampler, seeded with the
// request's seed plus its index, and its own stop strings (a choice that
// meets one ends alone). The answer lists them by index; a stream
// interleaves their chunks as their tokens come, each choice with its own
// role delta (chat) and finish chunk, then one usage chunk that counts the
// prompt once and every choice's completion tokens. /generate answers an
// array of results, one per sample, when n is above 1. A client that goes
// aborts every choice. On a PD prefill server n is ignored: the decode
// forks the choices from the one transfer.
//
// A stream the engine cuts (an abort, a timeout, an engine failure, the
// engine closed by a shutdown's deadline) gets an error event, data:
// {"error": {...}} (an OpenAI error object), before its finish chunk and
// [DONE], so that the client knows it was cut. A PD router's
// bootstrap_room and bootstrap_url are read from /generate's body as from
// the OpenAI requests'. With Options.ClusterSecret set, a request with a
// bootstrap_room must be signed with the secret, as the router signs them,
// else it is refused with 401 before the engine sees it (pdauth.go). A
// request naming a room that a live request of the
// server holds is refused with 409 (param bootstrap_room), the live one
// untouched; on a decode, a bootstrap_url that is not one of its prefill
// registries (--prefill-bootstrap) with 403 (param bootstrap_url), before
// anything is fetched. Each generation the engine took is timed from its
// arrival to the end of its answer (pdkit_e2e_request_latency_seconds).
//
// # Chat template
//
// The server picks the chat template once, at New, from the GGUF's
// tokenizer.chat_template (model.Model.ChatTemplate; PickChatTemplate).
// The template itself is rendered (engine/chattemplate, a Jinja engine; its
// package doc says which and why) with the messages (role, content, and
// name and tool_call_id when set), add_generation_prompt true, and
// bos_token and eos_token spelled as the vocabulary spells its BOS and EOS,
// as Hugging Face's apply_chat_template renders it. The prompt is the
// rendered text tokenized with its control tokens recognised, the BOS put
// first when the vocabulary asks for it (add_bos_token) and the template
// did not write it, never twice; a control token's spelling inside a
// message stays text (it is masked while the template renders), so a
// message cannot inject control tokens. A conversation the template refuses
// with raise_exception (roles that do not alternate, a system message the
// model does not take) is a 400 with param "messages" and the template's
// reason; a template that fails otherwise on a request is a 500, logged.
// The template runs in chattemplate.Sandbox's worker processes, never in
// the server (Options.ChatSandbox): a conversation that makes it pass a
// bound of time, memory, stack or output (the model's context in text) is
// a 400 naming the bound, and its render ends when its client leaves.
//
// At New the template is compiled and rendered with four test
// conversations (chattemplate.Probes). A template that does not compile,
// fails to render one of them for another reason than its raise_exception
// (a bound passed among them), or refuses them all, is logged as a warning with the reason, and the
// server falls back to the family DetectChatTemplate recognises by the
// template's markers (anything else gets the default template); so does a
// model without a template (the built-in model has none). GET
// /debug/v1/state reports "jinja" or the family as "chat_template". The
// families' formats, for messages S (system), U1 (user), A1 (assistant), U2
// (user), each ending with the generation prompt for the assistant:
//
//	default  "<|system|>\nS\n<|user|>\nU1\n<|assistant|>\nA1\n<|user|>\nU2\n<|assistant|>\n"
//	chatml   "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
//	         "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"
//	llama3   "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
//	         "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>" ... (A1, U2 alike)
//	         "<|start_header_id|>assistant<|end_header_id|>\n\n"
//	llama2   "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nU1 [/INST] A1 </s><s>[INST] U2 [/INST]"
//	mistral  "<s>[INST] S\n\nU1 [/INST]A1</s>[INST] U2 [/INST]"
//	zephyr   "<|system|>\nS</s>\n<|user|>\nU1</s>\n<|assistant|>\nA1</s>\n<|user|>\nU2</s>\n<|assistant|>\n"
//	gemma    "<bos><start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
//	         "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n"
//
// The default template takes the roles system, user, assistant and tool (as
// "<|tool|>"); the families take system, user and assistant, and any other
// role is a 400 with param "messages". llama2, llama3 and gemma trim
// spaces around each message's content; the others keep it as it is. llama2, mistral and gemma have no system turn: the
// system messages (several joined by a blank line) are folded into the next
// user message as shown; when no user message follows they form a user turn
// of their own. For llama2 and mistral the generation prompt is the
// " [/INST]" that closes the last user turn, so a conversation that ends
// with an assistant message ends with its "</s>".
//
// BOS (of the families): llama3, llama2 (once per user turn), mistral and gemma write it
// themselves and are encoded without the tokenizer's own BOS; default,
// chatml and zephyr write none and are encoded with it (Encode(text, true):
// only when the vocabulary's add_bos_token asks for it). Either way the BOS
// is the tokenizer's BOS id, whatever spelling the template shows, and is
// never doubled. The markers the template writes ("<|im_start|>", "</s>",
// "<start_of_turn>", ...) become their control tokens when the vocabulary
// has them, so the prompt is what tokenizing the rendered text with its
// control tokens recognised gives (as llama.cpp does); but message content
// is always encoded as plain text, so a message cannot inject control
// tokens. DetectChatTemplate lists the markers each family is recognised by. With the default template the role markers
// are plain text too, and the prompt is exactly Encode(text, true) of the
// text above.
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
// has iterated within Options.StallAfter, has not failed and no
// communicator of its TP group is broken; else 503 with the reason. A
// stalled loop's reason says where its ranks are, read from the flight
// recorders: the collective (communicator, seq, op) ranks wait in and each
// peer elsewhere (in another call, or in none, with its last seq), so a
// hung group whose ranks are all alive is not green; a broken communicator
// (a collective mismatch, a rank that left a call) is unhealthy at once,
// until the group is rebuilt. The same as data: ranks (step, phase, the
// calls each waits in), stalls (as /debug/v1/collectives lists them) and
// broken (communicator, reason). Busy is not dead: requests that wait do
// not make a server unhealthy. The answer carries the work the server holds: queued (the
// scheduler's waiting and pending requests and, on a PD server, its PD wait
// queue: bootstrap on a prefill, prealloc on a decode), running and every
// PD queue's length (pd_queues), which a router admits new requests by;
// while a request has waited longer than Options.MaxQueueAge (when set) the
// status is "busy", still 200, and routers send the server no new request.
// GET /debug/v1/stacks is the
// goroutine profile in pprof's debug=1 text; with ?rank=N only the
// goroutine groups whose pprof labels carry rank=N are kept.
//
// The other debug calls answer JSON with snake_case fields; their types
// are in api/debug, which pdctl reads. Like /health and stacks they
// read only the engine's lock-free accessors (atomics the loops publish,
// the pools' counters, the rank group's flight recorders), never a lock a
// loop holds, so they answer while a loop is stuck. Times are RFC 3339 with
// nanoseconds, durations float milliseconds (fields ending in _ms), and
// the 64-bit identifiers (bootstrap rooms, request ids) strings of decimal
// digits, so that no JSON reader rounds them (api/debug's package doc).
//
//	GET /debug/v1/settings     the effective settings (debug.Settings): the
//	                           engine's config after its defaults (role, TP
//	                           size, page size, max running, prefix cache,
//	                           index-K precision now (index_k_switch: the one
//	                           a live switch under way goes to), loop
//	                           heartbeat, collective watchdog, scheduler
//	                           timeouts, and on a PD server
//	                           its PD timeouts, heartbeat and reserved decode
//	                           tokens), the fault switches on now and the
//	                           server's /health thresholds. pdctl diagnose
//	                           judges each server by the timeouts it publishes.
//	GET /debug/v1/state        model, context_tokens (the model's context
//	                           length), chat_template, settings, rank 0's
//	                           last_step and the engine's last published
//	                           snapshot (step, queue counts and requests,
//	                           totals, error).
//	GET /debug/v1/steps        every rank's last step record: rank, step, phase,
//	                           batch_size, batch_tokens, retracted, finished,
//	                           digest (16 hex digits), control_seq and
//	                           forward_seq (the last call on each communicator),
//	                           start, end, duration_ms; "agree" when all ranks
//	                           have the same step, digest, control_seq and
//	                           forward_seq, and "spread", the largest step less
//	                           the smallest (ranks read mid-iteration may be one
//	                           step apart).
//	GET /debug/v1/collectives  stall_threshold_ms and "comms", one entry per
//	                           communicator of the TP group, control then
//	                           forward: name, size, closed, broken
//	                           (broken_reason), and per rank: last_entered,
//	                           last_completed, waiting (the call it waits in on
//	                           that communicator, or null), wait_ms, and
//	                           the flight recorder's records (seq, op, elem,
//	                           bytes, start, end, waiting, outcome,
//	                           duration_ms); "stalls": the communicator's calls
//	                           waiting longer than ?stall=D (a Go duration;
//	                           default Options.StallAfter), each with its comm,
//	                           the ranks arrived and where the missing ones are.
//	                           Seqs count per communicator: a seq names a call
//	                           only with its communicator's name.
//	GET /debug/v1/requests     the last snapshot's requests, queue by queue (or
//	                           only ?queue=waiting|prefilling|running|aborting;
//	                           another name is a 400): id, queue, age_ms,
//	                           in_state_ms (both as of the answer), prompt_tokens,
//	                           max_tokens, generated, fed (tokens with KV),
//	                           in_flight, cached (prefix-cache tokens), pages,
//	                           retractions; with counts per queue, pending
//	                           (submitted, not yet taken by the loop) and kv:
//	                           each rank's used, cached and total pages.
//	GET /debug/v1/pd           a prefill or decode server's PD state (a colocated
//	                           server answers 404 "not a PD server"): role,
//	                           failed_requests, failures_by_reason (by kind:
//	                           timeout, peer-lost, ...), failures_by_queue,
//	                           transfer_bytes (rank 0's share),
//	                           and per rank: the socket (endpoint, alive,
//	                           exit_reason, messages, bytes, handler_errors
//	                           (malformed messages), handler_panics, recv_errors,
//	                           last_message (null before the first), late (for an
//	                           unknown room), misplaced (a type the role never
//	                           receives), and the outbox's alive, peers, queued,
//	                           backlog, sent, bytes, send_errors, dropped), counts
//	                           per queue, and every PD queue entry as the rank last
//	                           published it: id, room, queue, in_queue_ms (as of
//	                           the rank's last iteration), peer (the peer rank's
//	                           endpoint), tokens, chunks, bytes, abort_sent,
//	                           error. Queues: bootstrap, active, inflight
//	                           (prefill); prealloc, transfer, aborting (decode).
//	                           ?queue=NAME lists only that queue's entries (the
//	                           counts stay whole); another name is a 400.
//	GET /debug/v1/hicache      the host tier (HiCache) of every rank, as each
//	                           last published it (debug.HiCacheResponse):
//	                           prefix_cache (false: no tier possible, ranks
//	                           empty), on (every rank's), and per rank: on,
//	                           policy, load_bandwidth_bytes_per_second,
//	                           page_size, host pages and tokens (size, used,
//	                           host-only), totals (backups, loads, their bytes,
//	                           failures and _ms, host_hits, hit_tokens,
//	                           abandoned_loads, dropped_tokens), the loads not
//	                           yet settled (requests, pages, layers landed) and
//	                           per layer the forward pass's waits at the KV and
//	                           index-K gates (wait_kv_ms, wait_index_k_ms).
//
// The ranks talk over two communicators: "control" carries the loop's own
// agreements (the step input and output broadcasts, the poll, free-page
// and prefix-match MINs, the plan digest's MAX) and "forward" the model's
// collectives inside a forward pass. An idle iteration advances the control
// seq and leaves the forward one alone. An idle engine has rank 0 waiting
// for work outside any collective while the other ranks wait in the
// control broadcast of its next step input (for a heartbeat at most): a
// rank > 0 "waiting" in a control Broadcast is normal.
//
// # Admin
//
// POST /abort_request ({"rid": "cmpl-N"}) is under the admin rule below
// too: the engine's ids are sequential, so without it anyone who reaches
// the port could cancel anyone's stream. Clients abort their own streams
// through the router, whose ids are unguessable.
//
// POST /admin/v1/requests/{id}/abort aborts one request, by the engine's
// id N or the response's cmpl-N / chatcmpl-N: 200 {"aborted": "N"}, 404 when
// the id is in no queue of the engine's latest snapshot. A request
// submitted but not yet taken by the loop is in no snapshot, so the call
// waits up to 250ms for the pending requests to be taken; best effort: a
// loop stuck that long makes such an id a 404. POST /admin/v1/abort_all
// aborts every request in the latest snapshot's waiting, prefilling and
// running queues and answers their ids, {"aborted": ["N", ...]}; requests still
// pending are not among them.
//
// POST /admin/v1/model/verify rehashes the whole model file against its
// baseline (model.VerifyFile): debug.ModelVerifyResponse; 409 while
// another runs.
//
// POST /admin/v1/hicache/on and /off switch every rank's host tier live
// (serve.Engine.SetHiCache: the ranks switch in the same iteration; on
// sizes the pool by the server's --hicache-size or --hicache-ratio, checked
// against the memory available now; off lets loads in flight finish and
// frees the pool). The call waits up to 2s for every rank to show the
// switch and answers debug.HiCacheSwitchResponse: 200 with the new state
// (changed false when every rank already was so), 202 with pending true
// when a loop has not taken it yet; 409 when another switch is pending,
// the host memory does not suffice, or the server has no prefix cache or
// is a decode (which keeps no host tier).
// POST /admin/v1/hicache/bandwidth paces every rank's loads back from host
// to bytes_per_second (the query's, else the JSON body's; 0: unlimited;
// 400 when missing or negative). Each switch counts in
// pdkit_hicache_switches_total{direction}.
//
// POST /admin/v1/indexk/fp8 and /bf16 switch the index-K precision live
// (serve.Engine.SetIndexK; 400 for a model without a sparse indexer): the
// engine stops admitting (new requests wait, queued), lets the requests in
// flight finish for at most ?drain= (a Go duration, default 30s; 400 when
// bad or negative), aborts what is left (but PD rooms still in the
// handshake, which span the switch), and switches every rank. The call
// waits for it, up to the drain and Options.IndexKMargin past it (10s,
// debug.IndexKSwitchMargin), and answers debug.IndexKSwitchResponse: 200
// with from, to, changed (false when the server already ran it), paused_ms
// and aborted; 202 with pending true when it is not done by then (it goes
// on, as it does when the caller goes, and GET /debug/v1/settings says
// index_k_switch until it is); 409 while a switch is under way; 400 for
// another precision than those two. The engine
// logs each switch done, and pdkit_indexk_switches_total counts it. On a
// PD pair the prefill switches first, then the decode (pdctl indexk set).
//
// Every /admin/v1/ call, an unknown path included, is checked first: with
// Options.AdminToken set it must carry "Authorization: Bearer <token>"
// (compared in constant time), else 401; without one, a server with
// Options.ClusterSecret takes the token the secret derives the same way;
// without either, admin calls are allowed only when Options.Loopback says
// the server listens on loopback only, else 403 "admin API disabled: set
// --admin-token". Each call is
// logged at info level with the caller's address, the call, the status and
// what it did.
//
// GET /metrics serves Options.Metrics' registry. The engine's gauges and
// counters are read at scrape time; the token counters and the latency
// histograms need the same Metrics set as the engine's
// serve.Config.Observer. A prefill or decode server adds its PD queue
// gauges, transfer, failure and message counters and its receive loops'
// liveness, per rank; a server with a prefix cache its host tier's
// pdkit_hicache_* gauges and counters, per rank; a model with a sparse
// indexer pdkit_indexk_precision{dtype} and pdkit_indexk_switches_total
// (see internal/metrics).
//
// Not yet here: a flag to choose the chat template, tool calls, best_of,
// admin calls to drain or pause, and the
// ids of requests still pending in the debug API.
package server
