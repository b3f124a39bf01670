package main

import (
	"testing"

	"github.com/pdkit/pdkit/internal/helptest"
)

// Every pdserve command has an Examples section of "# comment" and
// "$ pdserve ..." lines, each of which parses as the command it names; no
// entry of examples outlives its command.
func TestHelpExamples(t *testing.T) {
	for _, p := range helptest.ExampleProblems(newRootCmd, examples) {
		t.Error(p)
	}
}

// pdserve --help lists every command: the top-level ones under Available
// Commands, the others (model init, bench pd, ...) in its text.
func TestRootHelpListsEveryCommand(t *testing.T) {
	stdout, stderr, code := run(t, "--help")
	if code != 0 {
		t.Fatalf("pdserve --help: exit %d: %s", code, stderr)
	}
	for _, p := range helptest.RootHelpProblems(newRootCmd(), stdout) {
		t.Error(p)
	}
}
