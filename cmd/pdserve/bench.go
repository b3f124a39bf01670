package main

import (
	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/bench"
	"github.com/pdkit/pdkit/kernels"
)

func newBenchCmd() *cobra.Command {
	cfg := bench.Config{Arch: model.ArchLlama, Types: []kernels.DType{kernels.F32, kernels.Q8_0}, Threads: []int{1, 2}}
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
			if _, err := builtin.Shape(cfg.Arch, cfg.Size); err != nil {
				return usageError{err}
			}
			home, err := builtin.Home()
			if err != nil {
				return err
			}
			cfg.Home = home
			rep, err := bench.Run(cmd.Context(), cfg, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			rep.Print(cmd.OutOrStdout())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Arch, "arch", model.ArchLlama, "built-in architecture: llama or llama-dsa")
	f.StringVar(&cfg.Size, "size", builtin.SizeSmall, "built-in size: tiny or small")
	f.StringSliceVar(&types, "types", []string{"f32", "q8_0"}, "weight types")
	f.IntSliceVar(&cfg.Threads, "threads", []int{1, 2}, "thread counts")
	f.IntVar(&cfg.PromptLen, "prompt", 512, "prefill prompt length")
	f.IntVar(&cfg.DecodeTokens, "decode", 128, "tokens to decode per sequence")
	f.IntVar(&cfg.Batch, "batch", 32, "sequences in the aggregate decode run")
	f.IntVar(&cfg.Repeats, "repeats", 3, "runs per figure (the median is reported)")
	return cmd
}
