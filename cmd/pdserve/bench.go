package main

import (
	"io"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/bench"
	"github.com/pdkit/pdkit/kernels"
)

func newBenchCmd() *cobra.Command {
	cfg := bench.Config{Arch: model.ArchLlama, Types: []kernels.DType{kernels.F32, kernels.Q8_0}, Threads: []int{1, 2}}
	var mf modelFlags
	var types []string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure prefill and decode speed of a built-in model against the memory-bandwidth bound",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
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
			if cfg.PromptLen < 1 || cfg.DecodeTokens < 1 || cfg.Batch < 1 || cfg.Repeats < 1 {
				return usagef("--prompt, --decode, --batch and --repeats must be positive")
			}
			if _, err := mf.shape(); err != nil {
				return usageError{err}
			}
			cfg.Arch, cfg.Size = mf.arch, mf.size
			return runReport(cmd, func(home string) (printer, error) {
				cfg.Home = home
				return bench.Run(cmd.Context(), cfg, cmd.ErrOrStderr())
			})
		},
	}
	f := cmd.Flags()
	mf.register(f, false)
	f.StringSliceVar(&types, "types", []string{"f32", "q8_0"}, "weight types")
	f.IntSliceVar(&cfg.Threads, "threads", []int{1, 2}, "thread counts")
	f.IntVar(&cfg.PromptLen, "prompt", 512, "prefill prompt length")
	f.IntVar(&cfg.DecodeTokens, "decode", 128, "tokens to decode per sequence")
	f.IntVar(&cfg.Batch, "batch", 32, "sequences in the aggregate decode run")
	f.IntVar(&cfg.Repeats, "repeats", 3, "runs per figure (the median is reported)")
	cmd.AddCommand(newBenchServeCmd(), newBenchPDCmd(), newBenchLoadCmd())
	return cmd
}

func newBenchPDCmd() *cobra.Command {
	cfg := bench.PDConfig{}
	var mf modelFlags
	cmd := &cobra.Command{
		Use:   "pd",
		Short: "Measure PD disaggregation: TTFT of a prefill+decode pair against a colocated engine, and the KV transport against raw TCP",
		Long: `pd builds, in one process, a colocated engine and a prefill+decode pair (bootstrap registry
on a loopback HTTP port, KV over ZeroMQ on loopback) over the same built-in model and
configuration. For each prompt length it runs the same greedy requests one at a time on both
and reports time to first token percentiles and their PD/colocated ratio; PD tokens must equal
the colocated ones. Then it sends real KV_CHUNK messages over the ZeroMQ link for a while and
moves the same bytes over raw loopback TCP, and reports both rates and their ratio (goal ≥ 0.8).`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			dt, shape, err := mf.resolve()
			if err != nil {
				return usageError{err}
			}
			cfg.Arch, cfg.Size, cfg.Type = mf.arch, mf.size, dt
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
			for _, c := range cfg.Concurrency {
				if c < 1 {
					return usagef("--concurrency %d must be ≥ 1", c)
				}
			}
			if cfg.Threads < 0 || cfg.Requests < 0 {
				return usagef("--threads and --requests must not be negative (0: the default)")
			}
			if cfg.PromptLen < 1 || cfg.MaxTokens < 1 || cfg.MaxRunning < 1 {
				return usagef("--prompt, --max-tokens and --max-running must be positive")
			}
			if cfg.PromptLen+cfg.MaxTokens > shape.ContextLen {
				return usagef("--prompt %d plus --max-tokens %d exceed the model's context length %d", cfg.PromptLen, cfg.MaxTokens, shape.ContextLen)
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
	f.StringVar(&m.arch, "arch", model.ArchLlama, "built-in architecture: llama or llama-dsa")
	f.StringVar(&m.size, "size", builtin.SizeSmall, "built-in size: tiny or small")
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
