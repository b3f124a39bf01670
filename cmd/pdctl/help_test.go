package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/internal/helptest"
)

// Every pdctl command has an Examples section of "# comment" and
// "$ pdctl ..." lines, each of which parses as the command it names; no
// entry of examples outlives its command.
func TestHelpExamples(t *testing.T) {
	newRoot := func() *cobra.Command {
		var out, errOut bytes.Buffer
		return newCmdRoot(&factory{In: strings.NewReader(""), Out: &out, ErrOut: &errOut, Build: testBuild})
	}
	for _, p := range helptest.ExampleProblems(newRoot, examples) {
		t.Error(p)
	}
}

// pdctl --help lists every command: the top-level ones under Available
// Commands, the others (fault on, queues dump, ...) in its text.
func TestRootHelpListsEveryCommand(t *testing.T) {
	code, stdout, stderr := runArgs(t, "--help")
	if code != exitOK {
		t.Fatalf("pdctl --help: exit %d: %s", code, stderr)
	}
	var out bytes.Buffer
	for _, p := range helptest.RootHelpProblems(newCmdRoot(&factory{In: strings.NewReader(""), Out: &out, ErrOut: &out, Build: testBuild}), stdout) {
		t.Error(p)
	}
}
