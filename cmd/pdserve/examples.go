package main

// examples are the Examples sections of pdserve's help (cobra's Example
// field), by command path less "pdserve" ("" is the root): a comment saying
// what each command line does, then the line, as a user would type it.
// They live together so that they read as one set; cliexamples.Set puts each
// on its command (a command may set its Example itself instead).
// help_test.go checks that every command has an Example, that every entry
// here names a command, and that every pdserve line in them parses: its
// command exists and its flags and arguments are the command's.
var examples = map[string]string{
	"": `
# Run a PD cluster on loopback: a router on :8000, a prefill and a decode
# server, with the built-in model (random weights: its text is gibberish)
$ pdserve launch

# Ask the cluster for a completion (from another terminal)
$ curl -s localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 32}'

# Complete a prompt in this process, with a llama-family GGUF of your own
$ pdserve generate --model path/to/model.gguf --prompt "The capital of France is"

# Every setting of serve, with its PD_* variable and where its value comes from
$ pdserve config
`,
	"model": `
# Write the tiny built-in llama model (it loads in llama.cpp too)
$ pdserve model init --arch llama --size tiny -o tiny.gguf

# Print its shape and tokenizer
$ pdserve model info tiny.gguf
`,
	"model init": `
# The default model's shape (small llama-dsa) from another seed, Q8_0 weights
$ pdserve model init --seed 7 --type q8_0 -o small-q8.gguf

# A tiny llama model, for tests
$ pdserve model init --arch llama --size tiny -o tiny.gguf
`,
	"model info": `
# The architecture, shape, weight type and indexer of a GGUF file
$ pdserve model info path/to/model.gguf
`,
	"generate": `
# Greedy (temperature 0, reproducible) with the built-in model
$ pdserve generate --prompt "Once upon a time" --max-tokens 32

# Sample from a llama-family GGUF with its own tokenizer
$ pdserve generate --model path/to/model.gguf --prompt "The capital of France is" --temperature 0.8 --top-p 0.95 --seed 42

# On the plain-Go reference kernels (slow; what the fast ones are tested against)
$ pdserve generate --backend ref --prompt "Hello" --max-tokens 8
`,
	"bench": `
# Prefill and decode speed: F32 and Q8_0 weights, 1 and 2 threads
$ pdserve bench

# Q8_0 only, on 4 threads, with a shorter prompt
$ pdserve bench --types q8_0 --threads 4 --prompt 128

# The built-in medium model (stories110M's shape), one run per figure
$ pdserve bench --size medium --repeats 1

# A GGUF file of your own, decode at a context of 1024 tokens
$ pdserve bench --model path/to/model.gguf --depth 1024 --batch 4
`,
	"bench serve": `
# Streamed completions at concurrency 1, 8, 32 and 64
$ pdserve bench serve

# Two levels, longer outputs, Q8_0 weights
$ pdserve bench serve --concurrency 1,16 --max-tokens 128 --type q8_0
`,
	"bench pd": `
# PD against colocated TTFT at prompts of 128 and 1024 tokens, then the KV transport
$ pdserve bench pd

# Two TP ranks per engine, one prompt length, fewer requests
$ pdserve bench pd --tp 2 --prompts 512 --requests 4
`,
	"config": `
# serve's settings, each with its PD_* variable, value and source
$ pdserve config

# A decode server's, with two flags given, as JSON
$ pdserve config decode --tp 2 --transfer-timeout 30s --json

# What an environment variable changes
$ PD_INDEX_K=bf16 pdserve config prefill

# A decode whose KV cache stores bf16 (its prefills must run --kv-dtype bf16 too)
$ PD_KV_DTYPE=bf16 pdserve config decode
`,
	"serve": `
# Serve the built-in model on :8000, then ask for a completion
$ pdserve serve --port 8000 &
$ curl -s localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 32}'

# A llama-family GGUF on two TP ranks, beyond loopback, admin calls behind a token
$ pdserve serve --model path/to/model.gguf --tp 2 --host 0.0.0.0 --admin-token "$TOKEN"

# Without the prefix cache, waiting at most 30s for admission
$ pdserve serve --no-prefix-cache --waiting-timeout 30s

# A host-memory tier under the prefix cache (HiCache): 4 GiB per rank, prefixes backed up when evicted
$ pdserve serve --hicache --hicache-size 4GiB --hicache-write-policy write-back
`,
	"prefill": `
# A prefill server on :30000, its bootstrap registry on :8998
$ pdserve prefill --port 30000 --bootstrap-port 8998

# The same with the bootstrap-abort-crash fault on (the mass-abort wedge, for drills)
$ pdserve prefill --port 30000 --bootstrap-port 8998 --fault bootstrap-abort-crash

# On a host of its own: bound to every address, advertising the one its peers reach (docs/deploy.md)
$ PD_CLUSTER_SECRET_FILE=/etc/pdkit/cluster-secret pdserve prefill --host 0.0.0.0 --pd-host 0.0.0.0 --advertise-host 10.0.0.11 --port 30000 --bootstrap-port 8998
`,
	"decode": `
# A decode server on :30001
$ pdserve decode --port 30001

# More patience with a slow network: longer KV transfer and heartbeat timeouts
$ pdserve decode --port 30001 --transfer-timeout 60s --heartbeat-timeout 10s

# On a host of its own, taking requests for one prefill server's registry (docs/deploy.md)
$ PD_CLUSTER_SECRET_FILE=/etc/pdkit/cluster-secret pdserve decode --host 0.0.0.0 --pd-host 0.0.0.0 --advertise-host 10.0.0.12 --port 30001 --prefill-bootstrap http://10.0.0.11:8998
`,
	"router": `
# The router on :8000 in front of the prefill and decode servers above
$ pdserve router --port 8000 --prefill http://127.0.0.1:30000 --decode http://127.0.0.1:30001

# Two of each, health-checked every 500ms
$ pdserve router --prefill http://10.0.0.1:30000,http://10.0.0.2:30000 --decode http://10.0.0.3:30001,http://10.0.0.4:30001 --health-interval 500ms

# On a host of its own: bound to every address, logging the one clients reach
$ pdserve router --host 0.0.0.0 --advertise-host 10.0.0.10 --prefill http://10.0.0.11:30000 --decode http://10.0.0.12:30001
`,
	"launch": `
# What make run starts: a router on :8000, one prefill, one decode, the built-in model
$ pdserve launch

# Two prefill and two decode servers of two TP ranks each, on a llama-family GGUF
$ pdserve launch --model path/to/model.gguf --prefill 2 --decode 2 --tp 2

# The router on another port
$ pdserve launch --port 8080

# The prefill with the bootstrap-abort-crash fault on, to rehearse the mass-abort wedge
$ pdserve launch --fault bootstrap-abort-crash

# A PD_* variable reaches every server
$ PD_BOOTSTRAP_TIMEOUT=60s pdserve launch

# Every prefill and decode server with a host-memory tier (HiCache), its loads paced at 2GB/s per rank
$ pdserve launch --hicache --hicache-load-bandwidth 2GB/s
`,
}
