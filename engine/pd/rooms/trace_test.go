package rooms

import (
	"testing"

	"github.com/pdkit/pdkit/internal/tracetest"
)

// TestTraces runs the scripted traces of testdata/: each file is named
// after the invariant or protocol path it proves. Run with -rewrite to
// regenerate the expected outputs, then read the diff.
func TestTraces(t *testing.T) {
	tracetest.Run(t, "testdata/*.txt", func(t *testing.T) func(string) string {
		return tracetest.Errors((&harness{}).run)
	})
}
