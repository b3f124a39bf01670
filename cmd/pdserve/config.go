package main

import (
	"encoding/json"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/internal/config"
)

func newConfigCmd() *cobra.Command {
	var e engineFlags
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Print the effective engine settings and where each comes from (flag, PD_* environment, default)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			entries := config.Effective(cmd.Flags())
			kept := entries[:0]
			for _, en := range entries {
				if en.Name != "json" {
					kept = append(kept, en)
				}
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(kept)
			}
			return config.Print(cmd.OutOrStdout(), kept)
		},
	}
	e.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
