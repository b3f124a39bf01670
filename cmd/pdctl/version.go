package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/spf13/cobra"
)

type versionOptions struct {
	Out   io.Writer
	Build buildInfo
	JSON  bool
}

// newCmdVersion builds "pdctl version". Tests pass runF to capture the parsed
// options instead of running the command.
func newCmdVersion(f *factory, runF func(*versionOptions) error) *cobra.Command {
	opts := &versionOptions{Out: f.Out, Build: f.Build}
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print pdctl's version and the Go version it was built with",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return newUsageError(cmd, "version takes no arguments, got %q", args)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if runF != nil {
				return runF(opts)
			}
			return versionRun(opts)
		},
	}
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

func versionRun(opts *versionOptions) error {
	if opts.JSON {
		enc := json.NewEncoder(opts.Out)
		enc.SetIndent("", "  ")
		return enc.Encode(opts.Build)
	}
	_, err := fmt.Fprintln(opts.Out, opts.Build)
	return err
}
