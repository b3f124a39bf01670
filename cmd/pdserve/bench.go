package main

import (
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/internal/bench"
	"github.com/pdkit/pdkit/internal/config"
	"github.com/pdkit/pdkit/kernels"
)

func newBenchCmd() *cobra.Command {
	cfg := bench.Config{Arch: model.ArchLlama, Types: []kernels.DType{kernels.F32, kernels.Q8_0}, Threads: []int{1, 2}}
	var mf modelFlags
	var types []string
	var dramMiB int
	var kvDType string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure prefill and decode speed of a built-in model or a GGUF file against the memory-bandwidth bound",
		Long: `bench measures, for each weight type and thread count: prefill tokens/s on a prompt of --prompt
tokens, decode tokens/s of one sequence and of --batch sequences at once, each decoding
--decode tokens after a prompt of --depth tokens (prefilled first, not timed), against the
memory-bandwidth bound measured in the same run. Each figure is the median of --repeats runs.
The decode runs prefill all their prompts in one step, so that every sequence decodes from
the depth on; that step holds --batch × --depth tokens, and its memory grows with both.

The model is a built-in one (--arch, --size, one file per --types), or the GGUF file of
--model, whose architecture, shape and weight type are read from it.`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkBenchFlags(cmd, &cfg, &mf, types); err != nil {
				return err
			}
			if dramMiB < 1 {
				return usagef("--dram-buffer must be positive")
			}
			kv, err := parseKVDType(kvDType)
			if err != nil {
				return err
			}
			cfg.KVType = kv
			cfg.DRAMBytes = dramMiB << 20
			return runReport(cmd, func(home string) (printer, error) {
				cfg.Home = home
				return bench.Run(cmd.Context(), cfg, cmd.ErrOrStderr())
			})
		},
	}
	f := cmd.Flags()
	mf.register(f, false)
	f.StringSliceVar(&types, "types", []string{"f32", "q8_0"}, "weight types of the built-in model")
	f.StringVar(&cfg.ModelPath, "model", "", "GGUF file to measure instead of a built-in model (its type and shape are read from it)")
	f.IntSliceVar(&cfg.Threads, "threads", []int{1, 2}, "thread counts")
	f.IntVar(&cfg.PromptLen, "prompt", 512, "prefill prompt length")
	f.IntVar(&cfg.DecodeTokens, "decode", 128, "tokens to decode per sequence")
	f.IntVar(&cfg.Depth, "depth", 16, "context length decode starts at: each sequence's prompt, prefilled before decode is timed")
	f.IntVar(&cfg.Batch, "batch", 32, "sequences in the aggregate decode run")
	f.IntVar(&cfg.Repeats, "repeats", 3, "runs per figure (the median is reported)")
	f.IntVar(&dramMiB, "dram-buffer", 1024, "MiB read to measure DRAM bandwidth: far beyond the caches")
	f.StringVar(&kvDType, "kv-dtype", kvDTypeFlagHelp.def, kvDTypeFlagHelp.usage)
	cmd.AddCommand(newBenchServeCmd(), newBenchOverlapCmd(), newBenchPDCmd(), newBenchLoadCmd(), newBenchHiCacheCmd())
	return cmd
}

// checkBenchFlags checks bench's flags and fills cfg's model and types.
func checkBenchFlags(cmd *cobra.Command, cfg *bench.Config, mf *modelFlags, types []string) error {
	cfg.Types = cfg.Types[:0]
	for _, t := range types {
		dt, err := builtin.ParseType(t)
		if err != nil {
			return usageError{err}
		}
		cfg.Types = append(cfg.Types, dt)
	}
	for _, th := range cfg.Threads {
		if th < 1 {
			return usagef("--threads %d must be ≥ 1", th)
		}
	}
	if cfg.PromptLen < 1 || cfg.DecodeTokens < 1 || cfg.Batch < 1 || cfg.Repeats < 1 || cfg.Depth < 1 {
		return usagef("--prompt, --decode, --depth, --batch and --repeats must be positive")
	}
	shape, err := benchShape(cmd, cfg.ModelPath, mf)
	if err != nil {
		return err
	}
	cfg.Arch, cfg.Size = mf.arch, mf.size
	if cfg.PromptLen+1 > shape.ContextLen {
		return usagef("--prompt %d and the token it generates exceed the model's context length %d", cfg.PromptLen, shape.ContextLen)
	}
	if cfg.Depth+cfg.DecodeTokens+1 > shape.ContextLen {
		return usagef("--depth %d plus --decode %d and the token prefill generates exceed the model's context length %d", cfg.Depth, cfg.DecodeTokens, shape.ContextLen)
	}
	return nil
}

// benchShape is the configuration of the model bench measures: the file of
// --model, read without its weights, or the built-in one.
func benchShape(cmd *cobra.Command, path string, mf *modelFlags) (model.Config, error) {
	if path == "" {
		shape, err := mf.shape()
		if err != nil {
			return shape, usageError{err}
		}
		return shape, nil
	}
	for _, name := range []string{"arch", "size", "types"} {
		if cmd.Flags().Changed(name) {
			return model.Config{}, usagef("--model reads the architecture, shape and weight type from the file: drop --%s", name)
		}
	}
	f, err := gguf.Open(path)
	if err != nil {
		return model.Config{}, err
	}
	defer f.Close()
	shape, err := model.ReadConfig(f)
	if err != nil {
		return shape, fmt.Errorf("%s: %w", path, err)
	}
	return shape, nil
}

func newBenchPDCmd() *cobra.Command {
	cfg := bench.PDConfig{}
	var mf modelFlags
	var kvDType string
	cmd := &cobra.Command{
		Use:   "pd",
		Short: "Measure PD disaggregation: TTFT of a prefill+decode pair against a colocated engine, and the KV transport against raw TCP",
		Long: `pd builds, in one process, a colocated engine and a prefill+decode pair (bootstrap registry
on a loopback HTTP port, KV over ZeroMQ on loopback) over the same built-in model and
configuration. For each prompt length it runs the same greedy requests one at a time on both
and reports time to first token percentiles and their PD/colocated ratio; PD tokens must equal
the colocated ones. Then it sends real KV_CHUNK messages over the ZeroMQ link for a while, with
and without the KV sockets' PLAIN authentication and its rotating credential (what a cluster
secret turns on) in interleaved rounds, and moves the same bytes over raw loopback TCP; it reports the rates and two ratios: ZeroMQ over raw TCP
(goal ≥ 0.8) and authenticated over not (goal: authentication costs at most 10%, read against the
rounds' noise: the one-sided 95% upper bound of the rounds' ratio ≥ 0.9).`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			dt, shape, err := mf.resolve()
			if err != nil {
				return usageError{err}
			}
			cfg.Arch, cfg.Size, cfg.Type = mf.arch, mf.size, dt
			if cfg.KVType, err = parseKVDType(kvDType); err != nil {
				return err
			}
			if cfg.TP < 1 || cfg.Requests < 1 || cfg.MaxTokens < 1 || cfg.TransportTime <= 0 {
				return usagef("--tp, --requests, --max-tokens and --transport-time must be positive")
			}
			if cfg.Threads < 0 {
				return usagef("--threads must not be negative (0: every CPU / tp)")
			}
			if len(cfg.Prompts) == 0 {
				return usagef("--prompts needs at least one length")
			}
			if err := shape.CheckShards(cfg.TP); err != nil {
				return usagef("--tp %d: %v", cfg.TP, err)
			}
			for _, n := range cfg.Prompts {
				if n < 1 || n+cfg.MaxTokens > shape.ContextLen {
					return usagef("--prompts %d: want 1 to %d tokens (context %d less --max-tokens %d)", n, shape.ContextLen-cfg.MaxTokens, shape.ContextLen, cfg.MaxTokens)
				}
			}
			return runReport(cmd, func(home string) (printer, error) {
				cfg.Home = home
				rep, err := bench.RunPD(cmd.Context(), cfg, cmd.ErrOrStderr())
				return &rep, err
			})
		},
	}
	f := cmd.Flags()
	mf.register(f, true)
	f.IntVar(&cfg.TP, "tp", 1, "tensor-parallel ranks of every engine")
	f.IntSliceVar(&cfg.Prompts, "prompts", []int{128, 1024}, "prompt lengths in tokens")
	f.IntVar(&cfg.Requests, "requests", 8, "requests per prompt length, one at a time")
	f.IntVar(&cfg.MaxTokens, "max-tokens", 8, "greedy tokens generated per request")
	f.IntVar(&cfg.Threads, "threads", 0, "kernel threads per rank (0: every CPU / tp)")
	f.DurationVar(&cfg.TransportTime, "transport-time", 2*time.Second, "how long the KV transport loop sends")
	f.StringVar(&kvDType, "kv-dtype", kvDTypeFlagHelp.def, kvDTypeFlagHelp.usage)
	return cmd
}

func newBenchServeCmd() *cobra.Command {
	cfg := bench.ServingConfig{}
	var mf modelFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Measure the serving path: streamed /v1/completions against an in-process server at several client concurrencies",
		Long: `serve starts an in-process server (engine and OpenAI API on a loopback port) over a
built-in model and, for each concurrency level, runs that many clients issuing streamed
/v1/completions requests (random token-id prompts, temperature 0, ignore_eos). It reports
requests/s, output tokens/s, time to first token and inter-token latency percentiles per
level, and the aggregate output rate at concurrency 32 against concurrency 1.`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			dt, shape, err := mf.resolve()
			if err != nil {
				return usageError{err}
			}
			cfg.Arch, cfg.Size, cfg.Type = mf.arch, mf.size, dt
			if len(cfg.Concurrency) == 0 {
				return usagef("--concurrency needs at least one level")
			}
			if err := checkConcurrency(cfg.Concurrency); err != nil {
				return err
			}
			if cfg.Threads < 0 || cfg.Requests < 0 {
				return usagef("--threads and --requests must not be negative (0: the default)")
			}
			if cfg.PromptLen < 1 || cfg.MaxTokens < 1 || cfg.MaxRunning < 1 {
				return usagef("--prompt, --max-tokens and --max-running must be positive")
			}
			if err := checkFits(cfg.PromptLen, cfg.MaxTokens, shape.ContextLen); err != nil {
				return err
			}
			return runReport(cmd, func(home string) (printer, error) {
				cfg.Home = home
				rep, err := bench.RunServing(cmd.Context(), cfg, cmd.ErrOrStderr())
				return &rep, err
			})
		},
	}
	f := cmd.Flags()
	mf.register(f, true)
	f.IntSliceVar(&cfg.Concurrency, "concurrency", []int{1, 8, 32, 64}, "client concurrency levels")
	f.IntVar(&cfg.PromptLen, "prompt", 128, "prompt length in tokens")
	f.IntVar(&cfg.MaxTokens, "max-tokens", 64, "tokens generated per request")
	f.IntVar(&cfg.Requests, "requests", 0, "requests per level (0: max(2×concurrency, 8))")
	f.IntVar(&cfg.Threads, "threads", 0, "engine kernel threads (0: every CPU)")
	f.IntVar(&cfg.MaxRunning, "max-running", 64, "requests the engine admits at once")
	return cmd
}

func newBenchOverlapCmd() *cobra.Command {
	cfg := bench.OverlapConfig{}
	var mf modelFlags
	cmd := &cobra.Command{
		Use:   "overlap",
		Short: "Measure the overlap loop against the lock-step loop on the serving benchmark, interleaved",
		Long: `overlap runs bench serve's workload (streamed /v1/completions against in-process servers
over a built-in model) on two engines that differ only in their loop, --schedule lockstep and
--schedule overlap, at each thread count of --threads (0: every CPU). Each concurrency level runs
--rounds times on each loop, interleaved (lock-step then overlap, then overlap then lock-step, ...)
so that a noisy machine weighs on both alike, and every figure is a ratio overlap/lock-step from
the same run: output tokens/s, inter-token latency p50 and p99 as the clients read it and as the
engine emits it.

It also dissects the decode iteration from rank 0's step records: the forward pass is the
record's ForwardStart..ForwardEnd, the period the time between the forward passes' starts of
consecutive decode steps; their difference under lock-step is the time outside the forward pass
(scheduling, sampling, streaming), and the share of it overlap took off the period is what it
hid. The report ends with the overlap loop's goals, met or not: overlap never
slower than lock-step (slower means below 1 beyond the run's noise: the one-sided 95% upper bound
of a level's round ratios under 1); the same wherever --schedule auto, the default, picks overlap
(where the thread count leaves a CPU free); and at one thread and concurrency 32 at least 70% of
the outside time hidden. It does not fail on a goal missed.`,
		Example: `  # The default: small model, every CPU and one thread, concurrency 1, 8, 32 and 64
  $ pdserve bench overlap

  # A short run on the tiny model
  $ pdserve bench overlap --size tiny --concurrency 1,8 --rounds 2`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			dt, shape, err := mf.resolve()
			if err != nil {
				return usageError{err}
			}
			cfg.Arch, cfg.Size, cfg.Type = mf.arch, mf.size, dt
			if len(cfg.Concurrency) == 0 || len(cfg.Threads) == 0 {
				return usagef("--concurrency and --threads need at least one value each")
			}
			if err := checkConcurrency(cfg.Concurrency); err != nil {
				return err
			}
			for _, th := range cfg.Threads {
				if th < 0 {
					return usagef("--threads %d must not be negative (0: every CPU)", th)
				}
			}
			if cfg.Requests < 0 {
				return usagef("--requests must not be negative (0: the default)")
			}
			if cfg.PromptLen < 1 || cfg.MaxTokens < 1 || cfg.MaxRunning < 1 || cfg.Rounds < 1 {
				return usagef("--prompt, --max-tokens, --max-running and --rounds must be positive")
			}
			if err := checkFits(cfg.PromptLen, cfg.MaxTokens, shape.ContextLen); err != nil {
				return err
			}
			return runReport(cmd, func(home string) (printer, error) {
				cfg.Home = home
				rep, err := bench.RunOverlap(cmd.Context(), cfg, cmd.ErrOrStderr())
				return &rep, err
			})
		},
	}
	f := cmd.Flags()
	mf.register(f, true)
	f.IntSliceVar(&cfg.Threads, "threads", []int{0, 1}, "engine kernel thread counts, a pair of engines each (0: every CPU)")
	f.IntSliceVar(&cfg.Concurrency, "concurrency", []int{1, 8, 32, 64}, "client concurrency levels")
	f.IntVar(&cfg.PromptLen, "prompt", 128, "prompt length in tokens")
	f.IntVar(&cfg.MaxTokens, "max-tokens", 64, "tokens generated per request")
	f.IntVar(&cfg.Requests, "requests", 0, "requests per level, round and loop (0: max(2×concurrency, 8))")
	f.IntVar(&cfg.Rounds, "rounds", 4, "interleaved rounds of each level on each loop")
	f.IntVar(&cfg.MaxRunning, "max-running", 64, "requests each engine admits at once")
	return cmd
}

// checkConcurrency checks the levels of --concurrency.
func checkConcurrency(levels []int) error {
	for _, c := range levels {
		if c < 1 {
			return usagef("--concurrency %d must be ≥ 1", c)
		}
	}
	return nil
}

// checkFits checks that a prompt of --prompt tokens and the --max-tokens
// it generates fit the model's context length.
func checkFits(promptLen, maxTokens, contextLen int) error {
	if promptLen+maxTokens > contextLen {
		return usagef("--prompt %d plus --max-tokens %d exceed the model's context length %d", promptLen, maxTokens, contextLen)
	}
	return nil
}

// defaultHiCachePacings are bench hicache's loader pacings of the incident
// cells: unlimited, and the paced one docs/hicache.md explains.
var defaultHiCachePacings = []string{"0", "64MiB/s"}

func newBenchHiCacheCmd() *cobra.Command {
	cfg := bench.HiCacheConfig{}
	var arch, size, typ, kvType, policy string
	var precisions, pacings, policies []string
	var noFault bool
	cmd := &cobra.Command{
		Use:   "hicache",
		Short: "Reproduce the HiCache index-K race (outputs against references, index-K fp8 and bf16, fault off and on), measure host hits against recompute and compare the write policies",
		Long: `hicache runs, in one process, the workload of production incident 3 on a built-in
model with a sparse-attention indexer (--arch: llama-dsa, or deepseek2-dsa, the seed's
DeepSeek shape, whose KV is one latent row per token): --sessions concurrent multi-turn
sessions over one shared system prefix, with scripted histories and greedy decoding, on a
device KV pool sized from the prompts so small that the sessions' prefixes go to the host
tier and are loaded back. Every prompt is first run alone with the prefix cache and HiCache
off: its reference. Then, for each index-K precision (--index-k) and each loader pacing
(--load-bandwidth), the workload runs with the hicache-indexk-ungated fault off (once) and on
(--runs times), --requests-per-cell requests per run, each run on a fresh engine. The report
gives, beside the pacing, the share of outputs that differ from their reference (mean, min
and max over the runs), timeouts and errors, host hits and the tokens they loaded, and the
copy-to-compute ratio the run had. Any differing output, timeout or error with the fault
off fails the command, and so does a fault-off run without a host hit.

Then the speed part: --speed-sessions sessions, each over its own prefix of --prefix
tokens, take turns on a device pool that holds one of them, so that each turn's prefix
comes back from host (HiCache on) or is computed again (HiCache off, same pool): time to
first token p50 and p99 of both and their ratio (goal: a host hit at most 0.5× recompute),
and the loader's copy rate (its LoadBytes over LoadSeconds, unpaced) against a plain copy of
the same bytes in the same run (goal: at least 0.5).

Then the write-policy part: --policy-prompts distinct prompts of --policy-prompt tokens, each
sent --policy-rounds times in rounds, --max-running at a time, --policy-tokens greedy tokens
each, on a device pool of two such prompts and a host tier 8 times it: the workload HiCache
exists for, whose prefixes leave the device before they come back. It runs with HiCache off,
then under each of --policies, side by side: host hits and their rate, pages and bytes backed
up, time to first token p50 and p99 against HiCache off, and the decode steps' mean time and
tokens per second against HiCache off, which is what the backups, copied on the writer's
goroutine beside the steps, cost the decode. An output that differs from HiCache off's fails
the command.

The fault-on cells are a data race by design: a binary built with -race refuses them
(--no-fault leaves them out). docs/hicache.md explains the figures.`,
		Example: `  # The incident (fp8 and bf16, fault off and on) and the speed part, built-in small model
  $ pdserve bench hicache

  # The incident on the DeepSeek-shaped model, the latent in bf16, the loader at a GPU's pace
  $ pdserve bench hicache --arch deepseek2-dsa --kv-dtype bf16 --load-bandwidth 64MiB/s --skip-speed --skip-policies

  # A short run on the tiny model
  $ pdserve bench hicache --size tiny --requests-per-cell 200 --runs 2 --prefix 256

  # The incident alone, bf16 index-K, the loader unpaced and at three pacings
  $ pdserve bench hicache --index-k bf16 --load-bandwidth 0,256MiB/s,64MiB/s,16MiB/s --skip-speed --skip-policies

  # The three write policies side by side, alone, on the tiny model
  $ pdserve bench hicache --size tiny --skip-incident --skip-speed`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			dt, err := builtin.ParseType(typ)
			if err != nil {
				return usageError{err}
			}
			shape, err := builtin.Shape(arch, size)
			if err != nil {
				return usageError{err}
			}
			if shape.Indexer == nil {
				return usagef("--arch %s has no sparse indexer: want %s or %s", arch, model.ArchLlamaDSA, model.ArchDeepSeek2DSA)
			}
			kv, err := kernels.ParseKVType(kvType)
			if err != nil {
				return usagef("--kv-dtype: %v", err)
			}
			cfg.Arch, cfg.Size, cfg.Type, cfg.KVType, cfg.Fault = arch, size, dt, kv, !noFault
			cfg.LoadBandwidths = cfg.LoadBandwidths[:0]
			for _, p := range pacings {
				bw, err := config.ParseRate(p)
				if err != nil {
					return usagef("--load-bandwidth: %v", err)
				}
				cfg.LoadBandwidths = append(cfg.LoadBandwidths, bw)
			}
			if len(cfg.LoadBandwidths) == 0 {
				return usagef("--load-bandwidth needs at least one pacing (0: unlimited)")
			}
			if cfg.Policy, err = prefix.ParsePolicy(policy); err != nil {
				return usagef("--write-policy %q: want %s", policy, prefix.PolicyNames())
			}
			cfg.Policies = cfg.Policies[:0]
			for _, name := range policies {
				p, err := prefix.ParsePolicy(name)
				if err != nil {
					return usagef("--policies: %q: want %s", name, prefix.PolicyNames())
				}
				cfg.Policies = append(cfg.Policies, p)
			}
			if len(cfg.Policies) == 0 && !cfg.SkipPolicies {
				return usagef("--policies needs at least one policy (or --skip-policies)")
			}
			if cfg.PolicyPrompts < 1 || cfg.PolicyPrompt < 1 || cfg.PolicyRounds < 1 || cfg.PolicyTokens < 1 {
				return usagef("--policy-prompts, --policy-prompt, --policy-rounds and --policy-tokens must be positive")
			}
			cfg.Precisions = cfg.Precisions[:0]
			for _, p := range precisions {
				ik, err := kernels.ParseIndexKDType(p)
				if err != nil {
					return usageError{err}
				}
				cfg.Precisions = append(cfg.Precisions, ik)
			}
			if len(cfg.Precisions) == 0 {
				return usagef("--index-k needs at least one precision")
			}
			if cfg.TP < 1 || cfg.Sessions < 1 || cfg.RequestsPerCell < 1 || cfg.Runs < 1 || cfg.Turns < 1 || cfg.MaxTokens < 1 ||
				cfg.MaxRunning < 1 || cfg.Prefix < 1 || cfg.SpeedSessions < 2 || cfg.SpeedTurns < 1 || cfg.RequestTimeout <= 0 {
				return usagef("--tp, --sessions, --requests-per-cell, --runs, --turns, --max-tokens, --max-running, --prefix, --speed-turns and --request-timeout must be positive, --speed-sessions at least 2")
			}
			if cfg.Threads < 0 || cfg.System < 0 {
				return usagef("--threads and --system must not be negative (0: the default)")
			}
			if err := shape.CheckShards(cfg.TP); err != nil {
				return usagef("--tp %d: %v", cfg.TP, err)
			}
			if cfg.System != 0 && cfg.System <= shape.Indexer.TopK {
				return usagef("--system %d: want more than the indexer's top-k %d, or the indexer never reads index-K", cfg.System, shape.Indexer.TopK)
			}
			if cfg.SkipIncident && cfg.SkipSpeed && cfg.SkipPolicies {
				return usagef("--skip-incident, --skip-speed and --skip-policies leave nothing to run")
			}
			home, err := builtin.Home()
			if err != nil {
				return err
			}
			cfg.Home = home
			rep, err := bench.RunHiCache(cmd.Context(), cfg, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			rep.Print(cmd.OutOrStdout())
			return hicacheVerdict(&rep)
		},
	}
	f := cmd.Flags()
	f.StringVar(&arch, "arch", model.ArchLlamaDSA, "built-in architecture with a sparse indexer: "+model.ArchLlamaDSA+" or "+model.ArchDeepSeek2DSA)
	f.StringVar(&size, "size", builtin.SizeSmall, "built-in size: "+builtin.SizeList())
	f.StringVar(&typ, "type", "f32", "weight type")
	f.StringVar(&kvType, "kv-dtype", kvDTypeFlagHelp.def, kvDTypeFlagHelp.usage)
	f.IntVar(&cfg.TP, "tp", 1, "tensor-parallel ranks of every engine")
	f.IntVar(&cfg.Threads, "threads", 0, "kernel threads per rank (0: every CPU / tp)")
	f.IntVar(&cfg.Sessions, "sessions", 60, "concurrent multi-turn sessions of the incident workload")
	f.IntVar(&cfg.RequestsPerCell, "requests-per-cell", 1000, "requests of each run of a cell")
	f.IntVar(&cfg.Runs, "runs", 3, "runs of each fault-on cell (the report gives their mean, min and max)")
	f.IntVar(&cfg.Turns, "turns", 6, "turns of one conversation; a session runs conversation after conversation")
	f.IntVar(&cfg.System, "system", 0, "shared system prefix in tokens (0: the indexer's top-k + 32)")
	f.IntVar(&cfg.MaxTokens, "max-tokens", 8, "greedy tokens generated per request")
	f.IntVar(&cfg.MaxRunning, "max-running", 8, "requests the engine admits at once (the device pool holds this many of the longest prompt)")
	f.StringSliceVar(&precisions, "index-k", []string{"fp8", "bf16"}, "index-K precisions of the cells")
	f.BoolVar(&noFault, "no-fault", false, "run the fault-off cells only")
	f.StringSliceVar(&pacings, "load-bandwidth", defaultHiCachePacings, "loader pacings of the incident cells, each rank's loads back from host in bytes per second, e.g. 64MiB/s (0: unlimited); every cell runs at each")
	f.StringVar(&policy, "write-policy", prefix.WriteThrough.String(), "the incident and speed parts' write policy, when prefix pages are backed up to host: "+prefix.PolicyNames())
	f.StringSliceVar(&policies, "policies", policyNames(), "the write policies the policy part compares side by side, each against HiCache off")
	f.IntVar(&cfg.PolicyPrompts, "policy-prompts", 12, "distinct prompts of the policy part")
	f.IntVar(&cfg.PolicyPrompt, "policy-prompt", 249, "tokens of each of the policy part's prompts (its device pool holds two)")
	f.IntVar(&cfg.PolicyRounds, "policy-rounds", 3, "times each of the policy part's prompts is sent, in rounds")
	f.IntVar(&cfg.PolicyTokens, "policy-tokens", 32, "greedy tokens of each of the policy part's requests: the decode the backups run beside")
	f.BoolVar(&cfg.SkipPolicies, "skip-policies", false, "leave the write-policy part out")
	f.DurationVar(&cfg.RequestTimeout, "request-timeout", 5*time.Minute, "bound on each request, queueing included (a request past it counts as a timeout)")
	f.IntVar(&cfg.Prefix, "prefix", 1024, "each speed session's own prefix in tokens")
	f.IntVar(&cfg.SpeedSessions, "speed-sessions", 4, "speed sessions taking turns on the device pool")
	f.IntVar(&cfg.SpeedTurns, "speed-turns", 8, "measured turns of each speed session")
	f.BoolVar(&cfg.SkipIncident, "skip-incident", false, "leave the incident part out")
	f.BoolVar(&cfg.SkipSpeed, "skip-speed", false, "leave the speed part out")
	f.Uint64Var(&cfg.Seed, "seed", 1, "seed of every prompt")
	return cmd
}

// hicacheVerdict fails a run whose fault-off cells changed an output, ended
// a request early or loaded nothing back from host (they measured nothing).
func hicacheVerdict(rep *bench.HiCacheReport) error {
	for _, c := range rep.Cells {
		if c.Fault {
			continue
		}
		for _, r := range c.Runs {
			switch {
			case r.Differ > 0:
				return fmt.Errorf("bench hicache: %d of %d outputs differ from their references with the fault off (index-K %v)", r.Differ, r.Compared, c.IndexK)
			case r.Timeouts > 0 || r.Errors > 0:
				return fmt.Errorf("bench hicache: %d timeouts and %d errors with the fault off (index-K %v)", r.Timeouts, r.Errors, c.IndexK)
			case r.HostHits == 0:
				return fmt.Errorf("bench hicache: no host hit with the fault off (index-K %v): the run measured nothing", c.IndexK)
			}
		}
	}
	if p := rep.Policies; p != nil {
		for _, s := range p.Setups {
			if s.Differ > 0 {
				return fmt.Errorf("bench hicache: %d outputs of the policy part differ from HiCache off's under %s", s.Differ, s.Name)
			}
		}
	}
	return nil
}

// printer is a benchmark report.
type printer interface{ Print(w io.Writer) }

// runReport runs a benchmark over the built-in models' cache folder and
// prints its report on stdout (progress goes to stderr).
func runReport(cmd *cobra.Command, run func(home string) (printer, error)) error {
	home, err := builtin.Home()
	if err != nil {
		return err
	}
	rep, err := run(home)
	if err != nil {
		return err
	}
	rep.Print(cmd.OutOrStdout())
	return nil
}

// modelFlags choose the built-in model of a bench command.
type modelFlags struct{ arch, size, typ string }

// register adds --arch, --size and, with weightType, --type.
func (m *modelFlags) register(f *pflag.FlagSet, weightType bool) {
	f.StringVar(&m.arch, "arch", model.ArchLlama, "built-in architecture: "+model.ArchList())
	f.StringVar(&m.size, "size", builtin.SizeSmall, "built-in size: "+builtin.SizeList())
	if weightType {
		f.StringVar(&m.typ, "type", "f32", "weight type")
	}
}

// shape is the chosen model's configuration, or why there is none.
func (m *modelFlags) shape() (model.Config, error) { return builtin.Shape(m.arch, m.size) }

// resolve checks the flags: the weight type and the model's shape.
func (m *modelFlags) resolve() (kernels.DType, model.Config, error) {
	dt, err := builtin.ParseType(m.typ)
	if err != nil {
		return dt, model.Config{}, err
	}
	shape, err := m.shape()
	return dt, shape, err
}

// policyNames is every write policy's name, the default of --policies.
func policyNames() []string {
	var out []string
	for _, p := range prefix.Policies {
		out = append(out, p.String())
	}
	return out
}
