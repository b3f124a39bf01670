// Package helptest checks the help of a cobra command tree, for the tests
// of pdserve and pdctl: every command has an Examples section in the gh
// style ("# comment" lines, then "$ command" lines) whose command lines
// parse, and the root's help names every command. Cobra's own help and
// completion commands are left out: their texts are cobra's. The checks
// return their problems as lines, so that their own tests can see them.
package helptest

import (
	"bufio"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"

	"github.com/spf13/cobra"
)

// Commands returns every command of root's tree, root first, depth first,
// less cobra's help and completion commands and what is under them.
func Commands(root *cobra.Command) []*cobra.Command {
	out := []*cobra.Command{root}
	for _, c := range root.Commands() {
		if c.Name() == "help" || c.Name() == "completion" {
			continue
		}
		out = append(out, Commands(c)...)
	}
	return out
}

// Key is cmd's path less the root's name ("" for the root), as the
// examples maps of pdserve and pdctl key their texts.
func Key(cmd *cobra.Command) string {
	_, key, _ := strings.Cut(cmd.CommandPath(), " ")
	return key
}

// ExampleProblems checks the examples of newRoot's tree and returns one
// line per problem. Every command must have an Example made of examples,
// each one or more "# " comment lines followed by one or more "$ " command
// lines, and run itself (or, for a group, a command under it) at least
// once; every line that runs the tool (the root's name, after any
// VAR=value assignments) must name an existing command with flags and
// arguments that command accepts. examples holds the Examples set from one
// place (by Key) rather than in the commands' definitions: every key must
// name a command, so that no example outlives its command, and a command
// must not have both. newRoot must build a fresh tree on each call:
// parsing a line sets its flags.
func ExampleProblems(newRoot func() *cobra.Command, examples map[string]string) []string {
	var out []string
	errorf := func(format string, a ...any) { out = append(out, fmt.Sprintf(format, a...)) }
	root := newRoot()
	tool := root.Name()
	keys := map[string]bool{}
	for _, c := range Commands(root) {
		key := Key(c)
		keys[key] = true
		where := strings.TrimSpace(tool + " " + key)
		if c.Hidden {
			errorf("%s is hidden: the help lists every command", where)
		}
		if strings.TrimSpace(c.Example) == "" {
			errorf("%s has no Example", where)
			continue
		}
		if text, ok := examples[key]; ok && unindent(text) != unindent(c.Example) {
			errorf("%s has an Example of its own and another in examples", where)
		}
		shown := false
		lines, problems := exampleLines(where, c.Example)
		out = append(out, problems...)
		for _, line := range lines {
			args, ok := toolArgs(line, tool)
			if !ok {
				continue
			}
			target, err := parses(newRoot(), args)
			if err != nil {
				errorf("%s Example: %q does not parse: %v", where, line, err)
				continue
			}
			// The command itself, or one under it (a group's example
			// runs its subcommands).
			if k := Key(target); key == "" || k == key || strings.HasPrefix(k, key+" ") {
				shown = true
			}
		}
		if !shown {
			errorf("%s Example has no line running %s", where, where)
		}
	}
	for _, key := range slices.Sorted(maps.Keys(examples)) {
		if !keys[key] {
			errorf("examples has an entry for %q, which is not a command of %s", strings.TrimSpace(tool+" "+key), tool)
		}
	}
	return out
}

// unindent is an Example's text less its surrounding blank lines and
// each line's two-space indentation.
func unindent(text string) string {
	lines := strings.Split(strings.Trim(text, "\n"), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimPrefix(l, "  ")
	}
	return strings.Join(lines, "\n")
}

// exampleLines checks the layout of an Example (indented by two spaces;
// examples, each one or more "# " comment lines then one or more "$ "
// lines, blank lines between them optional) and returns its command lines,
// less "$ ".
func exampleLines(where, example string) (cmds, problems []string) {
	errorf := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }
	state := "start" // after a blank line or at the start, after a comment, after a command
	for i, raw := range strings.Split(example, "\n") {
		if raw == "" {
			if state == "comment" {
				errorf("%s Example line %d: a comment without a command after it", where, i+1)
			}
			state = "start"
			continue
		}
		line, ok := strings.CutPrefix(raw, "  ")
		if !ok || strings.HasPrefix(line, " ") {
			errorf("%s Example line %d is not indented by two spaces: %q", where, i+1, raw)
			continue
		}
		switch {
		case strings.HasPrefix(line, "# "):
			state = "comment"
		case strings.HasPrefix(line, "$ "):
			if state == "start" {
				errorf("%s Example line %d: a command without a comment before it", where, i+1)
			}
			state = "command"
			cmds = append(cmds, strings.TrimPrefix(line, "$ "))
		default:
			errorf("%s Example line %d is neither a \"# \" comment nor a \"$ \" command: %q", where, i+1, line)
		}
	}
	if state == "comment" {
		errorf("%s Example ends with a comment", where)
	}
	return cmds, problems
}

// assignment is a shell variable assignment before a command.
var assignment = regexp.MustCompile(`^[A-Z_][A-Z0-9_]*=`)

// toolArgs splits a command line as a shell would (quotes, a pipe or a
// trailing & ending the command) and returns the arguments after tool,
// when the line runs tool (after any VAR=value assignments).
func toolArgs(line, tool string) ([]string, bool) {
	words := split(line)
	for len(words) > 0 && assignment.MatchString(words[0]) {
		words = words[1:]
	}
	if len(words) == 0 || words[0] != tool {
		return nil, false
	}
	return words[1:], true
}

// split breaks a command line into words: single and double quotes group,
// and an unquoted | or & ends the command.
func split(line string) []string {
	var words []string
	var cur strings.Builder
	inWord := false
	var quote rune
	for _, r := range line {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		case r == '|' || r == '&':
			if inWord {
				words = append(words, cur.String())
			}
			return words
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words
}

// parses finds the command args name under root and parses the rest as
// that command would: its flags, then its positional arguments. It returns
// the command.
func parses(root *cobra.Command, args []string) (*cobra.Command, error) {
	target, rest, err := root.Find(args)
	if err != nil {
		return nil, err
	}
	if err := target.ParseFlags(rest); err != nil {
		return nil, err
	}
	if target.DisableFlagParsing {
		return target, nil
	}
	if !target.Runnable() {
		return nil, fmt.Errorf("%s only groups commands", target.CommandPath())
	}
	return target, target.ValidateArgs(target.Flags().Args())
}

// RootHelpProblems returns one line per command that help, the root's
// --help output, leaves out: it must list every direct subcommand of root
// under "Available Commands" with its Short text (and no other), and name
// every deeper command after its parent, as "parent child" or within
// "parent a|child|b" (a line break may stand for a space).
func RootHelpProblems(root *cobra.Command, help string) []string {
	var out []string
	errorf := func(format string, a ...any) { out = append(out, fmt.Sprintf(format, a...)) }
	listed := map[string]string{}
	for _, line := range Sections(help)["Available Commands"] {
		name, short, _ := strings.Cut(line, " ")
		listed[name] = strings.TrimSpace(short)
	}
	for _, c := range Commands(root)[1:] {
		key := Key(c)
		if c.Parent() == root {
			if short, ok := listed[c.Name()]; !ok {
				errorf("%s --help does not list the command %s", root.Name(), c.Name())
			} else if short != c.Short {
				errorf("%s --help lists %s as %q, want its Short %q", root.Name(), c.Name(), short, c.Short)
			}
			continue
		}
		parent := Key(c.Parent())
		re := regexp.MustCompile(`(?:^|[^a-z-])` + strings.ReplaceAll(regexp.QuoteMeta(parent), " ", `\s+`) + `\s+(?:[a-z-]+\|)*` + regexp.QuoteMeta(c.Name()) + `(?:$|[^a-z-])`)
		if !re.MatchString(help) {
			errorf("%s --help does not name the command %q (as %q or %q)", root.Name(), key, parent+" "+c.Name(), parent+" a|"+c.Name())
		}
	}
	for _, name := range slices.Sorted(maps.Keys(listed)) {
		if name != "help" && name != "completion" && !slices.ContainsFunc(root.Commands(), func(c *cobra.Command) bool { return c.Name() == name }) {
			errorf("%s --help lists %s, which is not a command", root.Name(), name)
		}
	}
	return out
}

// Sections splits a cobra help text into its indented sections ("Available
// Commands", "Flags", "Global Flags", ...): each section's lines, trimmed,
// under its heading without the colon.
func Sections(help string) map[string][]string {
	out := map[string][]string{}
	section := ""
	sc := bufio.NewScanner(strings.NewReader(help))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			section = ""
		case !strings.HasPrefix(line, " "):
			section = strings.TrimSuffix(line, ":")
		case section != "":
			out[section] = append(out[section], strings.TrimSpace(line))
		}
	}
	return out
}
