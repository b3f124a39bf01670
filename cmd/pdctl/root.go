package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/pdkit/pdkit/internal/cliexamples"
	"github.com/spf13/cobra"
)

// factory carries what commands take from the outside world. main builds the
// real one; tests build their own with buffers and fixed build information.
type factory struct {
	In     io.Reader
	Out    io.Writer // data: what scripts read
	ErrOut io.Writer // errors and progress
	Build  buildInfo
	// OutTTY says Out is a terminal: human tables get a header and
	// aligned columns; piped, rows are tab-separated.
	OutTTY bool
	// Getenv reads the environment (PDCTL_ROUTER, PDCTL_TOKEN); nil: none.
	Getenv func(string) string
	// screen is the terminal's size when Out cannot tell it (a test's
	// pipe standing in for a terminal); zero: Out is asked.
	screen struct{ width, height int }
	// maskVolatile replaces the cells that change from run to run (ages,
	// step numbers) with "*", for tests of exact output.
	maskVolatile bool
	// attach holds the global flags, shared by every command.
	attach attachOptions
}

func (f *factory) getenv(key string) string {
	if f.Getenv == nil {
		return ""
	}
	return f.Getenv(key)
}

// writeJSON writes v as indented JSON: the --json output of every command.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func itoa(n int) string { return strconv.Itoa(n) }

// pluralf returns "n thing" or "n things".
func pluralf(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}

// noArgs refuses positional arguments.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return newUsageError(cmd, "%s takes no arguments, got %q", cmd.Name(), args)
	}
	return nil
}

// needsCommand is the Args of a command that only groups others: run
// bare or with an unknown command it is a usage error naming the commands
// (commands, as "list, on or off").
func needsCommand(commands string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return newUsageError(cmd, "%s needs a command: %s", cmd.Name(), commands)
		}
		return newUsageError(cmd, "unknown command %q for %q", args[0], cmd.CommandPath())
	}
}

// buildInfo describes the running binary.
type buildInfo struct {
	Version   string `json:"version"`
	GoVersion string `json:"goVersion"`
	OS        string `json:"os"`
	Arch      string `json:"arch"`
}

func (b buildInfo) String() string {
	return fmt.Sprintf("pdctl %s (%s %s/%s)", b.Version, b.GoVersion, b.OS, b.Arch)
}

// usageError reports a command line that pdctl cannot run as given.
type usageError struct {
	cmd string // the command path, for the "--help" hint
	err error
}

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func newUsageError(cmd *cobra.Command, format string, a ...any) error {
	return &usageError{cmd: cmd.CommandPath(), err: fmt.Errorf(format, a...)}
}

const rootLong = `pdctl is the operator's tool for a running pdkit cluster. It attaches to the
router, prefill and decode servers through their debug and admin APIs: it
discovers every server behind --router (or talks to each --server directly)
and works while the cluster is wedged, since it reads only the servers'
lock-free snapshots.

Commands: status, queues dump, fault list|on|off, hicache status|on|off (the
host-memory KV tier), indexk status|set|ab (the sparse indexer's key precision,
switched live across the cluster), abort (synthetic ABORT frames to a prefill
rank, or the mass-abort drill), diagnose (rules over a sampled window), top (a
live view of every rank), bundle (everything an engineer needs, in one file)
and version.

Data goes to stdout: an aligned table on a terminal, tab-separated rows when
piped, JSON with --json. Progress and errors go to stderr. Exit status: 0 ok,
1 failed or found a problem it reports (an unreachable server), 2 usage,
130 interrupted.`

func newCmdRoot(f *factory) *cobra.Command {
	root := &cobra.Command{
		Use:   "pdctl",
		Short: "Operate a pdkit prefill/decode cluster",
		Long:  rootLong,
		// A bare "pdctl" shows the help; anything else must name a command.
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return nil
			}
			msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
			if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
				msg += "; did you mean " + strings.Join(s, " or ") + "?"
			}
			return newUsageError(cmd, "%s", msg)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return cmd.Help()
		},
		Version:       f.Build.Version,
		SilenceErrors: true,
		SilenceUsage:  true,
		CompletionOptions: cobra.CompletionOptions{
			HiddenDefaultCmd: true,
		},
	}
	root.SuggestionsMinimumDistance = 2
	root.SetIn(f.In)
	root.SetOut(f.Out)
	root.SetErr(f.ErrOut)
	root.SetVersionTemplate(f.Build.String() + "\n")
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return &usageError{cmd: cmd.CommandPath(), err: err}
	})

	addAttachFlags(root, f, &f.attach)
	root.AddCommand(newCmdVersion(f, nil))
	root.AddCommand(newCmdStatus(f, nil))
	root.AddCommand(newCmdFault(f))
	root.AddCommand(newCmdHiCache(f))
	root.AddCommand(newCmdIndexK(f))
	root.AddCommand(newCmdQueues(f))
	root.AddCommand(newCmdAbort(f, nil))
	root.AddCommand(newCmdDiagnose(f, nil), newCmdBundle(f, nil), newCmdTop(f, nil))
	cliexamples.Set(root, examples)
	return root
}
