package main

// examples are the Examples sections of pdctl's help (cobra's Example
// field), by command path less "pdctl" ("" is the root): a comment saying
// what each command line does, then the line, as an operator would type it.
// They live together so that they read as one set; cliexamples.Set puts each
// on its command (a command may set its Example itself instead).
// help_test.go checks that every command has an Example, that every entry
// here names a command, and that every pdctl line in them parses: its
// command exists and its flags and arguments are the command's.
var examples = map[string]string{
	"": `
# Every server and rank of the cluster behind the router on :8000
$ pdctl status

# Is anything wrong? (exit 0 healthy, 1 a warning or worse)
$ pdctl diagnose

# A cluster whose router is elsewhere, or one server without a router
$ pdctl status --router http://10.0.0.5:8000
$ pdctl status --server http://127.0.0.1:30000

# Watch it live
$ pdctl top
`,
	"version": `
# The version, and the Go version and platform it was built with
$ pdctl version

# As JSON, for scripts
$ pdctl version --json
`,
	"status": `
# Servers and ranks as a table
$ pdctl status

# Two servers directly, as JSON
$ pdctl status --server http://127.0.0.1:30000 --server http://127.0.0.1:30001 --json
`,
	"fault": `
# The switches on now, on any server
$ pdctl fault list --on

# Hold the highest TP rank of every server before its next collective, then let it go
$ pdctl fault on stall-last-rank
$ pdctl fault off stall-last-rank
`,
	"fault list": `
# Every switch of every server
$ pdctl fault list

# Only those on
$ pdctl fault list --on

# Two switches, as JSON
$ pdctl fault list drop-kv-chunk delay-heartbeat --json
`,
	"fault on": `
# The mass-abort wedge: prefill control loops die on ABORT
$ pdctl fault on bootstrap-abort-crash

# Drop every KV_CHUNK the decode servers receive
$ pdctl fault on drop-kv-chunk

# On servers that require an admin token
$ pdctl fault on delay-heartbeat --token "$TOKEN"
`,
	"fault off": `
# End the mass-abort drill (a control loop it already ended stays dead until its server restarts)
$ pdctl fault off bootstrap-abort-crash

# Through one server only
$ pdctl fault off stall-last-rank --server http://127.0.0.1:30000
`,
	"hicache": `
# Every server's host tier, rank by rank
$ pdctl hicache status

# Switch it on everywhere, then off
$ pdctl hicache on
$ pdctl hicache off
`,
	"hicache status": `
# Every rank of every server: on or off, host tokens used/total, hits, loads
$ pdctl hicache status

# One server, as JSON
$ pdctl hicache status --server http://127.0.0.1:30000 --json
`,
	"hicache on": `
# Every server with a prefix cache (each sizes its pool by its --hicache-size or --hicache-ratio)
$ pdctl hicache on

# On servers that require an admin token
$ pdctl hicache on --token "$TOKEN"
`,
	"hicache off": `
# Every server: loads in flight finish, the host pools are freed
$ pdctl hicache off

# Through one server only
$ pdctl hicache off --server http://127.0.0.1:30000
`,
	"indexk": `
# Every server's index-K precision
$ pdctl indexk status

# Switch the whole cluster to bf16, the router paused meanwhile
$ pdctl indexk set bf16
`,
	"indexk status": `
# Every server: precision, whether its model has a sparse indexer, switches done
$ pdctl indexk status

# As JSON
$ pdctl indexk status --json
`,
	"indexk set": `
# The cluster behind the router to fp8; each server drains for at most 30s
$ pdctl indexk set fp8

# A shorter drain: requests still in flight after 5s are aborted
$ pdctl indexk set bf16 --drain 5s

# Two servers named directly, on servers that require an admin token, as JSON
$ pdctl indexk set bf16 --server http://127.0.0.1:30000 --server http://127.0.0.1:30001 --token "$TOKEN" --json
`,
	"queues": `
# Every PD queue entry of every rank, then the rooms joined across prefill and decode
$ pdctl queues dump
`,
	"queues dump": `
# Every entry, then one line per room
$ pdctl queues dump

# Only rank 0's decode transfer queue, redrawn every second
$ pdctl queues dump --rank 0 --queue transfer --watch

# As JSON
$ pdctl queues dump --json
`,
	"abort": `
# Send ABORT for room 12345 to every rank of a prefill server and wait 2s for the ABORT_ACKs
$ pdctl abort --prefill http://127.0.0.1:30000 --room 12345

# Abort every room that rank 0 holds in its bootstrap queue
$ pdctl abort --prefill http://127.0.0.1:30000 --rank 0 --rooms-from-queue bootstrap

# The mass-abort drill through the router: 100 streaming sessions cancelled at once
$ pdctl abort --sessions 100

# The same, cancelled after 500ms, with up to 30s for the queues to drain, as JSON
$ pdctl abort --sessions 100 --after 500ms --drain-timeout 30s --json
`,
	"diagnose": `
# Sample the cluster for 5s and run the rules
$ pdctl diagnose

# A longer window, sampled every 2s
$ pdctl diagnose --window 30s --interval 2s

# The findings as JSON
$ pdctl diagnose --json

# Judge decode transfers by a 5s timeout, whatever the servers publish
$ pdctl diagnose --transfer-timeout 5s

# Also send 3 canaries: from the cache (loaded back from host) and without it, the same outputs?
$ pdctl diagnose --canaries 3
`,
	"top": `
# The live view (q quits, p pauses, r samples)
$ pdctl top

# One sample as tables, or as JSON
$ pdctl top --once
$ pdctl top --once --json

# Sample every 500ms, judge the last 10s
$ pdctl top --interval 500ms --window 10s
`,
	"bundle": `
# Everything about the cluster behind the router, in one file
$ pdctl bundle -o cluster.tar.gz

# A longer diagnose window, from a router elsewhere
$ pdctl bundle -o wedge.tar.gz --window 10s --router http://10.0.0.5:8000

# What it holds
$ tar -tzf cluster.tar.gz
`,
}
