package main

import (
	"encoding/json"
	"os"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/internal/config"
)

// newConfigCmd prints the effective settings of another command: its flags,
// each from the command line given here, its PD_* variable or its default.
func newConfigCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "config [COMMAND [FLAGS]]",
		Short: "Print the effective settings of a command (default: serve) and where each comes from (flag, PD_* environment, default)",
		Long: "Print the effective settings of a command (default: serve) and where each comes from.\n\n" +
			"Flags after the command name are parsed as that command would parse them, e.g.\n" +
			"  pdserve config serve --tp 2 --json",
		Args:               cobra.ArbitraryArgs,
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			if i := slices.Index(args, "--json"); i >= 0 {
				asJSON = true
				args = slices.Delete(args, i, i+1)
			}
			if slices.Contains(args, "-h") || slices.Contains(args, "--help") {
				return cmd.Help()
			}
			name := "serve"
			if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
				name, args = args[0], args[1:]
			}
			target, _, err := cmd.Root().Find([]string{name})
			if err != nil || target == cmd.Root() || target == cmd {
				return usagef("config: unknown command %q", name)
			}
			fs := target.Flags()
			if err := fs.Parse(args); err != nil {
				return usageError{err}
			}
			if err := config.ApplyEnv(fs, os.Getenv); err != nil {
				return usageError{err}
			}
			entries := config.Effective(fs)
			for i := range entries {
				if secretFlag(entries[i].Name) && entries[i].Value != "" {
					entries[i].Value = "***" // a secret: shown as set, never printed
				}
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(entries)
			}
			return config.Print(cmd.OutOrStdout(), entries)
		},
	}
	return cmd
}

// secretFlag reports whether a flag holds a secret, which config shows as
// set but never prints: the admin token, the cluster secret.
func secretFlag(name string) bool {
	return strings.HasSuffix(name, "token") || name == "cluster-secret"
}
