package helptest

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// tree is a small tool: a runnable "run" with a --n flag and no arguments,
// and a group "fault" with "on NAME".
func tree(examples map[string]string) func() *cobra.Command {
	return func() *cobra.Command {
		root := &cobra.Command{Use: "tool", Long: "tool does things: run, fault on."}
		run := &cobra.Command{Use: "run", Short: "Run it", Args: cobra.NoArgs, RunE: func(*cobra.Command, []string) error { return nil }}
		run.Flags().Int("n", 1, "times")
		fault := &cobra.Command{Use: "fault", Short: "Faults"}
		on := &cobra.Command{Use: "on NAME", Short: "Switch one on", Args: cobra.ExactArgs(1), RunE: func(*cobra.Command, []string) error { return nil }}
		fault.AddCommand(on)
		root.AddCommand(run, fault)
		for _, c := range Commands(root) {
			c.Example = examples[Key(c)]
		}
		return root
	}
}

func TestExampleProblems(t *testing.T) {
	good := map[string]string{
		"":         "  # Run it twice\n  $ tool run --n 2\n\n  # Then switch a fault on, through a pipe\n  $ FOO=1 tool fault on x | cat\n  # No blank line needed\n  $ tool run",
		"run":      "  # Run it\n  $ tool run\n  $ tool run --n=3 &",
		"fault":    "  # Switch a fault on\n  $ tool fault on 'a b'",
		"fault on": "  # Switch one on\n  # (a second comment line)\n  $ tool fault on x",
	}
	if got := ExampleProblems(tree(good), good); len(got) != 0 {
		t.Errorf("good examples: %q", got)
	}
	// A command whose Example is its own, not the entry in examples.
	both := map[string]string{"run": "  # Run it once more\n  $ tool run"}
	if got, want := ExampleProblems(tree(good), both), []string{"tool run has an Example of its own and another in examples"}; !slices.Equal(got, want) {
		t.Errorf("problems: %q, want %q", got, want)
	}

	bad := map[string]string{
		"":         "  # No command after this comment",
		"run":      "  $ tool run --m 2\n  # a comment\n  $ tool run extra\n  plain text\n    $ tool run",
		"fault":    "  # Only a group\n  $ tool fault\n\n  # Elsewhere\n  $ other fault on x",
		"fault on": "",
		"gone":     "  # A command that no longer exists\n  $ tool gone",
	}
	got := ExampleProblems(tree(bad), bad) // cobra sorts the commands
	want := []string{
		`tool Example ends with a comment`,
		`tool Example has no line running tool`,
		`tool fault Example: "tool fault" does not parse: tool fault only groups commands`,
		`tool fault Example has no line running tool fault`,
		`tool fault on has no Example`,
		`tool run Example line 1: a command without a comment before it`,
		`tool run Example line 4 is neither a "# " comment nor a "$ " command: "plain text"`,
		`tool run Example line 5 is not indented by two spaces: "    $ tool run"`,
		`tool run Example: "tool run --m 2" does not parse: unknown flag: --m`,
		`tool run Example: "tool run extra" does not parse: unknown command "extra" for "tool run"`,
		`tool run Example has no line running tool run`,
		`examples has an entry for "tool gone", which is not a command of tool`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestRootHelpProblems(t *testing.T) {
	root := tree(nil)()
	help := func(long string) string {
		root.Long = long
		var b bytes.Buffer
		root.SetOut(&b)
		if err := root.Help(); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}
	for _, long := range []string{"tool: run, fault on.", "tool: run, fault off|on|list.", "tool: run, fault\non."} {
		if got := RootHelpProblems(root, help(long)); len(got) != 0 {
			t.Errorf("help %q: %q", long, got)
		}
	}
	got := RootHelpProblems(root, help("tool: run, fault only."))
	want := []string{`tool --help does not name the command "fault on" (as "fault on" or "fault a|on")`}
	if !slices.Equal(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// A help that does not list a top-level command, or lists one that
	// is not there.
	h := strings.Replace(help("tool: run, fault on."), "  run ", "  walk ", 1)
	got = RootHelpProblems(root, h)
	want = []string{"tool --help does not list the command run", "tool --help lists walk, which is not a command"}
	if !slices.Equal(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
