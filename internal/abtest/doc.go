// Package abtest is the workload and the comparison behind `pdctl indexk
// ab`, the A/B test of production incident 3 (the HiCache index-K race)
// against a live cluster: the same multi-turn workload at the same
// concurrency in every cell (index-K precision × HiCache on or off), every
// output compared with the output of the same prompt computed alone.
//
// Greedy decoding in pdkit is batch-invariant: a prompt gives the same
// tokens whatever else runs beside it and wherever its KV came from. So an
// output that differs from its reference is corruption, not noise.
//
// The package talks to the cluster through its OpenAI API only (POST
// /v1/completions, streamed, with the pdkit extensions ignore_eos and
// no_cache); switching the servers is the caller's. It has three parts:
//
//   - Script: the prompts. A built-in script (Generate) is sized from the
//     pools the servers report (Size) so that the sessions' histories do
//     not fit the device KV pool, leave it between a session's turns and
//     come back from the host tier; each turn's prompt is the previous one
//     plus a scripted reply and a user message, never the model's own
//     output, so every prompt is known up front. ReadPrompts reads a
//     user's own.
//   - Client and Run: one streamed greedy request per turn, sessions
//     running their conversations concurrently, each request bounded by
//     the client's timeout; time to first token and the gaps between
//     streamed chunks are measured on the way.
//   - Compare: a cell's outcomes against their references: corrupt,
//     timeouts, errors, latency percentiles.
package abtest
