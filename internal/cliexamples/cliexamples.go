// Package cliexamples gives the commands of a cobra tree their Examples
// sections from one map, so that pdserve's and pdctl's examples each read
// as one set, kept beside each other rather than scattered over the
// commands. It depends on cobra alone (pdctl may import it).
package cliexamples

import (
	"strings"

	"github.com/spf13/cobra"
)

// Set sets the Example of cmd and of every command under it that has none
// from examples, keyed by the command's path less the root's name ("" for
// the root, "queues dump"), indented as cobra prints it under "Examples:".
func Set(cmd *cobra.Command, examples map[string]string) {
	if text, ok := examples[Key(cmd)]; ok && cmd.Example == "" {
		cmd.Example = indent(text)
	}
	for _, c := range cmd.Commands() {
		Set(c, examples)
	}
}

// Key is cmd's path less the root's name: the key of its examples.
func Key(cmd *cobra.Command) string {
	_, key, _ := strings.Cut(cmd.CommandPath(), " ")
	return key
}

// indent trims text's surrounding blank lines and indents every other
// line by two spaces.
func indent(text string) string {
	var b strings.Builder
	for i, line := range strings.Split(strings.Trim(text, "\n"), "\n") {
		if i > 0 {
			b.WriteByte('\n')
		}
		if line != "" {
			b.WriteString("  " + line)
		}
	}
	return b.String()
}
