// Command pdserve runs pdkit's engine: its serving roles (a colocated
// server, PD prefill and decode servers, the router, and launch, which
// starts a whole PD cluster), built-in models, single-process generation,
// benchmarks, and the effective settings of each command.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/internal/cliexamples"
	"github.com/pdkit/pdkit/internal/config"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// usageError marks a bad command line: exit code 2, like flag errors.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

// usageArgs makes a cobra positional-argument check a usage error.
func usageArgs(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			return usageError{err}
		}
		return nil
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "pdserve",
		Short: "Run pdkit's prefill/decode serving engine",
		Long: `pdserve runs pdkit's engine: the serving roles (serve: prefill and decode in
one process; prefill and decode: the two halves of a PD cluster, moving KV
over ZeroMQ; router: the OpenAI-compatible front of a PD cluster; launch: a
router, prefill and decode servers as supervised child processes), and the
tools around them (model init|info: write a built-in model, inspect a GGUF
file; generate: one generation without a server; bench and
bench serve|overlap|pd|load|hicache: the model, serving, overlap against
lock-step, PD, cluster-load and HiCache benchmarks;
config: the effective settings of a command and where each comes from).

Without --model, commands use the built-in model: a llama-family GGUF whose
weights are random (generated deterministically from a seed), so its text is
gibberish by construction. --model runs a GGUF of architecture llama,
llama-dsa, deepseek2 (every block dense, attn_q without a low rank) or
deepseek2-dsa with F32, F16, BF16 or Q8_0 weights and the tokenizer it
carries; pdserve model info FILE says whether one loads.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version,
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(newModelCmd(), newGenerateCmd(), newBenchCmd(), newConfigCmd())
	root.AddCommand(newServeCmd(), newPrefillCmd(), newDecodeCmd())
	root.AddCommand(newLaunchCmd())
	root.AddCommand(newRouterCmd())
	// Every flag can also come from its PD_* environment variable.
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		if err := config.ApplyEnv(cmd.Flags(), os.Getenv); err != nil {
			return usageError{err}
		}
		return nil
	}
	annotate(root)
	cliexamples.Set(root, examples)
	return root
}

// annotate documents each flag's environment variable in --help.
func annotate(cmd *cobra.Command) {
	config.AnnotateUsage(cmd.Flags())
	for _, c := range cmd.Commands() {
		annotate(c)
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCmd().ExecuteContext(ctx)
	stop()
	os.Exit(exitCode(err))
}

// exitCode maps errors to exit codes in one place: 0 ok, 2 usage, 130
// interrupted, 1 anything else.
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	fmt.Fprintln(os.Stderr, "pdserve:", err)
	var ue usageError
	switch {
	case errors.As(err, &ue):
		return 2
	case errors.Is(err, context.Canceled):
		return 130
	}
	return 1
}
