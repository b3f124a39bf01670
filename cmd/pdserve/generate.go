package main

import (
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/tokenizer"
)

type generateOptions struct {
	engine    engineFlags
	prompt    string
	maxTokens int
	sampling  sample.Params
	pageSize  int
}

func newGenerateCmd() *cobra.Command {
	o := generateOptions{}
	cmd := &cobra.Command{
		Use:   "generate --prompt TEXT",
		Short: "Complete a prompt in this process (completion on stdout, speed on stderr)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return generateRun(cmd, o)
		},
	}
	f := cmd.Flags()
	o.engine.register(f)
	f.StringVar(&o.prompt, "prompt", "", "prompt text (required)")
	f.IntVar(&o.maxTokens, "max-tokens", 128, "most tokens to generate")
	f.Float32Var(&o.sampling.Temperature, "temperature", 0, "sampling temperature (0: greedy, reproducible)")
	f.Float32Var(&o.sampling.TopP, "top-p", 1, "nucleus sampling mass")
	f.Uint64Var(&o.sampling.Seed, "seed", 0, "sampling seed")
	f.IntVar(&o.pageSize, "page-size", 16, "KV page size in tokens")
	return cmd
}

func generateRun(cmd *cobra.Command, o generateOptions) error {
	stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
	if o.prompt == "" {
		return usagef("--prompt is required")
	}
	if o.maxTokens < 1 {
		return usagef("--max-tokens %d must be at least 1", o.maxTokens)
	}
	if err := o.sampling.Validate(); err != nil {
		return usageError{err}
	}
	kv, err := o.engine.kvType()
	if err != nil {
		return err
	}
	m, b, ik, closeAll, err := o.engine.open(stderr)
	if err != nil {
		return err
	}
	defer closeAll()
	prompt, err := m.Tokenizer.Encode(o.prompt, true)
	if err != nil {
		return err
	}
	if len(prompt) == 0 {
		return usagef("the prompt encodes to no tokens")
	}
	if n := len(prompt) + o.maxTokens; n > m.Config.ContextLen {
		return usagef("prompt (%d tokens) + --max-tokens %d exceed the context length %d", len(prompt), o.maxTokens, m.Config.ContextLen)
	}
	r, err := runner.New(m, b, runner.Options{PageSize: o.pageSize, KVTokens: len(prompt) + o.maxTokens, IndexK: ik, KVType: kv})
	if err != nil {
		return err
	}
	dec := tokenizer.NewStreamDecoder(m.Tokenizer)
	var werr error
	emit := func(_ int, tok int32) {
		if m.Tokenizer.IsEOG(tok) || werr != nil {
			return
		}
		_, werr = io.WriteString(stdout, dec.Add(tok))
	}
	req := runner.Request{Prompt: prompt, MaxTokens: o.maxTokens, Sampling: o.sampling}
	_, st, err := r.Generate(cmd.Context(), []runner.Request{req}, emit)
	if err != nil {
		return err
	}
	if werr == nil {
		_, werr = io.WriteString(stdout, dec.Flush()+"\n")
	}
	if werr != nil {
		return werr
	}
	printSpeed(stderr, st, b.Name())
	return nil
}

// printSpeed reports prompt and generation speed. The first generated token
// comes out of the prefill step, so decode speed counts the others.
func printSpeed(w io.Writer, st runner.Stats, backend string) {
	fmt.Fprintf(w, "prompt: %d tokens in %v (%.0f tokens/s); generated %d tokens",
		st.PromptTokens, st.Prefill.Round(time.Microsecond), rate(st.PromptTokens, st.Prefill), st.OutputTokens)
	if st.OutputTokens > 1 {
		fmt.Fprintf(w, ", decode %.1f tokens/s", rate(st.OutputTokens-1, st.Decode))
	}
	fmt.Fprintf(w, " [%s]\n", backend)
}

func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}
