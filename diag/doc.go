// Package diag holds the rules behind "pdctl diagnose". pdctl samples every
// server of a cluster (through the router's /debug/v1/cluster or the
// servers named on its command line) several times over a window; each
// Sample holds, per server, whether it answered and its decoded debug API
// answers (package api/debug: steps, collectives, requests, pd, faults,
// settings), and, when pdctl found the servers through a router, the
// router's request outcome counters from its /metrics (RouterSample). The
// rules judge the resulting Window and report Findings: the rule's name, a
// severity, the server (or router) and the rank (null for a finding about
// the whole server), a one-line summary, the evidence (key/value lines with
// the numbers that prove it) and the remedy an operator should apply. Run
// runs every rule and sorts the findings by severity, then rule (in the
// order below), then server, then rank (the whole server first); no
// finding means healthy.
//
// The package reads only api/ and the standard library (internal/lint
// enforces it), so pdctl stays free of the engine and of cgo.
//
// # Rules
//
// A Rule is shaped like a go/analysis analyzer: a kebab-case Name, a Doc
// sentence saying what it detects and why it matters, the most urgent
// Severity it reports (critical, warning, info) and a Check over a Window.
// Rules must not fire on a healthy cluster: ranks may be caught one step
// apart mid-iteration, idle ranks above 0 wait in the control
// communicator's step-input broadcast for up to a loop heartbeat, and
// queues drain between samples, so rules about progress compare the first
// and the last sample and name a fault only when nothing moved in between.
//
// Each server is judged by the settings it publishes (GET
// /debug/v1/settings), which pdctl puts in its ServerSample: its PD
// timeouts, and its loop heartbeat, which raises the grace, the
// collective-wait threshold and the loop-stall window to twice the
// heartbeat where that is longer (Config.LimitsOf). A Config holds the rest
// (the grace for timeouts judged once per iteration, the collective-wait
// threshold, the loop-stall window) and Overrides of the servers' timeouts;
// a server that publishes no settings is judged by no timeout.
//
// The rules, in the order Rules returns them (causes before symptoms):
//
//   - fault-switch-on (warning): a server runs with fault switches on,
//     named with what each does, and how to switch them off.
//   - control-loop-dead (critical): a PD rank's socket receive loop is not
//     alive; gives its exit reason, the fault switch the reason names (the
//     bootstrap-abort-crash of incident 1, the mass-abort wedge), and the
//     rooms of other servers that wait on the rank.
//   - peer-unreachable (critical): a server that did not answer in the last
//     sample, or a decode rank whose PD entries say their prefill peer went
//     silent past the heartbeat timeout. When that prefill answers HTTP,
//     its rank's receive loop is alive and its registry lists the same
//     instance over the window, it is a partition of the PD link, not a
//     restart: the finding says so, and which way is cut where the
//     prefill's own socket shows it (messages still arriving from the
//     decode: its answers are lost). The rooms are gone from the queues
//     once they fail, so the decode ranks' peer tables (GET /debug/v1/pd
//     peers: each prefill rank's boot as last heard, its last word, the
//     rooms lost to its silence and when) name the loss for LostRecent
//     (2 minutes) from state, traffic in the window or not: the same boot
//     on a prefill that answers HTTP is a partition (mended, a warning,
//     once the decode has heard the prefill since), a new boot or an
//     endpoint no prefill advertises any more a restart, and KV still
//     arriving while the heartbeats timed out a link too slow or lossy.
//   - pd-link-slow (warning): the KV of a room has left its prefill (the
//     prefill's entry is inflight, with more bytes sent than the decode's
//     entry has landed) for SlowLinkAfter (1 s) or more, over the window,
//     while the decode rank still receives: a slow or lossy link, not a
//     cut one. The evidence gives the bytes in transit and the rate the
//     decode received at over the window.
//   - router-unreachable (critical): the router did not answer in the last
//     sample (frozen, gone, its port unreachable). When pdctl could not
//     discover the servers through it, it samples them as it last did
//     (kept under $PDKIT_HOME), and the evidence says how old that is.
//   - registry-mismatch (critical): a prefill server's bootstrap registry
//     lists a rank at an endpoint the rank does not listen on (a
//     registration by someone else, or a stale one).
//   - config-mismatch (critical; info during a live index-K switch): a
//     prefill and a decode server disagree on what their PD handshake
//     compares (pdproto.Differences, the handshake's own comparison, over
//     the Handshake each publishes in its settings, and the PD protocol
//     version), so every request routed to the pair fails, traffic in the
//     window or not. The evidence gives both values of each field and how
//     old each side's settings are; the remedy names the flags. A
//     precision that differs while either server switches, or while the
//     router is paused (pdctl indexk set), is the switch under way: info.
//   - model-identity (critical; warning for servers of different
//     weights): a server's model file changed under it (its settings'
//     model_file: the same file, size, modification time and sampled hash
//     as at load), or the servers' fingerprints (the handshake's model,
//     name@fingerprint) differ across the cluster, or servers of one
//     fingerprint publish different full hashes of their files (model_file
//     sha256: taken at load up to 1 GiB, or by a full rehash, which pdctl
//     diagnose --rehash asks for; a rehash that differs from the baseline
//     marks the file changed).
//   - engine-stalled (critical): no rank of a server finished a step
//     between the first and the last sample, over a window of at least
//     LoopStall (a loop iterates every heartbeat even idle): each rank's
//     step, phase, the age of its last step and the collective it waits in,
//     with its communicator.
//   - rank-divergence (critical): ranks of one server more than one step
//     apart, or at the same step with different sequence numbers on the
//     control or the forward communicator while neither is in a collective;
//     or a rank waiting in a collective longer than the threshold while a
//     peer is in no collective, in another seq of that communicator or in a
//     call of the other one, naming both ranks and each call as
//     "communicator seq N op" (incident 2, the overlap-schedule desync).
//     The evidence gives every rank's loop (lockstep, the engine's only
//     loop), step, phase and the call it waits in or where it stopped, and
//     each fault switch on; the remedy switches stall-last-rank off when it
//     holds the last rank on purpose (the ranks meet again), and otherwise
//     keeps a bundle, switches off the faults on and restarts the server.
//   - engine-restarts (critical for a restart loop, warning otherwise): a
//     server rebuilt its rank group (GET /debug/v1/collectives' restarts
//     and last_failure) during the window, or within RecentRestart (2 m)
//     before its last sample, so a window that opens after the storm still
//     names it. The evidence is the failed group's last error and where
//     each of its ranks was on each communicator when it gave up (the
//     desync of incident 2 by name, after the rebuild), and the fault
//     switches on; RestartLoop (3) rebuilds in the window, or 2 within a
//     minute, are a loop. The remedy switches off the faults on, else
//     tells a slow group (a longer --collective-timeout) from ranks that
//     branch apart.
//   - pd-queue-stuck (critical for bootstrap and transfer, warning for
//     inflight and prealloc): a PD queue non-empty in the first and the last
//     sample with no room leaving it between any two samples.
//   - pd-entry-overdue (warning): PD entries older than their state's
//     timeout, as their server publishes it, plus the grace (bootstrap and
//     prealloc: bootstrap timeout, transfer, inflight).
//   - kv-leak (critical): a rank holds KV pages (used less prefix-cached)
//     while its server has no live request in any scheduler or PD queue, in
//     both the first and the last sample; (warning) pages kept for aborted
//     rooms past the abort-ack timeout plus the grace.
//   - requests-failing (critical; warning when the router shows failures
//     under 10% of the requests it finished over the window): requests
//     failed between the first and the last sample. On the router, every
//     outcome of pdkit_router_requests_total that FailedOutcome calls a
//     failure (all but ok, invalid, aborted and the client's own,
//     client_error and client_gone: upstream_error, no_server, overloaded,
//     starting, shutdown), with the share of the requests finished and the
//     upstream errors by server; on each PD server, the growth of its
//     failure counters (GET /debug/v1/pd: by reason, such as timeout or
//     peer-lost, and by queue), less the peer-aborted rooms of a prefill,
//     which its decode aborted (a client that left, or a failure the decode
//     counts itself). The remedy follows the reasons. Counters that went
//     down (a restarted process) count from zero.
//   - server-slow (warning): a server's steps (GET /debug/v1/steps' rates:
//     rank 0's recent and baseline step times by phase and power-of-two
//     batch size) are SlowFactor (3) times slower than its own baseline or
//     than its fastest peer of the same role, at the same phase and batch
//     size, so load, which grows the batch, is not slowness. The evidence
//     gives the CPU the process got over the window and its cgroup's quota
//     throttling; the remedy follows it. A throttled process spends the
//     held time between its steps, not in them, so the rule also reads the
//     cycles (one decoding step's end to the next's while a batch runs
//     on) against their own baseline: SlowFactor times slower with the
//     cgroup throttling it over the window, CycleStarved (10) times and
//     10 ms without (cycles that grow a little are other work on the
//     cores: load).
//   - output-divergence (critical): a canary gave other greedy tokens from
//     the cache than computed without it (no_cache). The router's own
//     canaries (one a minute by default, pdkit_router_canaries_total by
//     prefill and result) are read every window: a mismatch over it is
//     critical, one since the router started a warning, so that the race
//     of incident 3 is named without --canaries; so are a colocated
//     server's own canaries (its settings' canaries). Canaries are an active
//     probe that pdctl sends only when asked (diagnose --canaries N) and
//     puts in the Window (Canaries): each prompt sent once, offloaded to the
//     host tier of every prefill and colocated server whose tier is on, then
//     sent normally (it loads back from host) and with no_cache. Greedy
//     decoding is batch-invariant, so any difference is corrupt KV (the
//     HiCache index-K race of incident 3). The finding names each server's
//     cell (role, index-K precision, host tier on or off, faults on), the
//     canaries that differ and their outputs, and the remedy: the fault
//     switch off, HiCache off. A canary that could not run is not judged.
//
// A server's TP ranks talk over two communicators, each with its own
// sequence numbers (api/debug's CommControl and CommForward): "control"
// for the loop's agreements, "forward" for the model's collectives. A seq
// names a call only together with its communicator; the rules never
// compare seqs across communicators.
//
// # Adding a rule
//
// Write one file named after the rule (kebab-case name, underscores in the
// file name) with a constructor returning the Rule, add it to RulesWith and
// to the list above, and add testdata/<name>/ with at least one sick
// fixture (each fixture is a Window as JSON); the shared healthy fixtures in
// testdata/healthy/, which no rule may fire on, check it against a healthy
// cluster. Run "go test ./diag -update" to write the .golden
// findings beside them, and read them before committing.
package diag
