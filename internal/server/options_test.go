package server

import (
	"strings"
	"testing"
	"time"
)

// Options.Validate refuses what New cannot run by, naming the flag; a zero
// takes its default.
func TestOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
		want []string // nil accepts
	}{
		{"defaults", Options{}, nil},
		{"set", Options{StallAfter: time.Second, MaxQueueAge: time.Minute}, nil},
		{"negative stall", Options{StallAfter: -time.Second}, []string{"stall after -1s (--stall-after) must not be negative"}},
		{"negative queue age", Options{MaxQueueAge: -1}, []string{"max queue age -1ns (--max-queue-age) must not be negative"}},
		{"both", Options{StallAfter: -1, MaxQueueAge: -1}, []string{"--stall-after", "--max-queue-age"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.opts.Validate()
			if tc.want == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted; want %q", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%v; want %q", err, w)
				}
			}
		})
	}
}
