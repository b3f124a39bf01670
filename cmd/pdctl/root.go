package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
)

// factory carries what commands take from the outside world. main builds the
// real one; tests build their own with buffers and fixed build information.
type factory struct {
	In     io.Reader
	Out    io.Writer // data: what scripts read
	ErrOut io.Writer // errors and progress
	Build  buildInfo
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
router, prefill and decode servers through their admin API and the documented
ZeroMQ messages: cluster status, per-queue request dumps, synthetic ABORTs,
HiCache on/off, an A/B of the index-K precision (indexk ab), a terminal view of
ranks, steps and queues (top), and diagnose, which names a known fault from
live snapshots and shows the evidence.

Those commands arrive with the serving milestones; this build has version only.`

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

	root.AddCommand(newCmdVersion(f, nil))
	return root
}
