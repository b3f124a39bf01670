package canary

import (
	"context"
	"errors"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
)

// A canary sends, offloads, sends from the cache and without it, and
// compares the last two; a failed step is not judged. The tally counts
// and keeps the last mismatch.
func TestRun(t *testing.T) {
	var calls []string
	steps := func(cached, computed string, fail bool) Steps {
		return Steps{
			Send: func(_ context.Context, noCache bool) (string, error) {
				if noCache {
					calls = append(calls, "no_cache")
					return computed, nil
				}
				calls = append(calls, "send")
				if fail {
					return "", errors.New("refused")
				}
				return cached, nil
			},
			Offload: func(context.Context) { calls = append(calls, "offload") },
		}
	}
	if r, _, _, err := Run(t.Context(), steps("a", "a", false)); r != Match || err != nil {
		t.Fatalf("equal outputs: %s %v", r, err)
	}
	if want := []string{"send", "offload", "send", "no_cache"}; len(calls) != 4 || calls[0] != want[0] || calls[1] != want[1] || calls[3] != want[3] {
		t.Fatalf("steps %q, want %q", calls, want)
	}
	if r, c, d, _ := Run(t.Context(), steps("garbled", "a", false)); r != Mismatch || c != "garbled" || d != "a" {
		t.Fatalf("differing outputs: %s %q %q", r, c, d)
	}
	if r, _, _, err := Run(t.Context(), steps("a", "a", true)); r != Failed || err == nil {
		t.Fatalf("a failed send: %s %v", r, err)
	}
	var tl Tally
	if tl.Status() != nil || tl.Next() != 1 || tl.Next() != 2 {
		t.Fatal("a new tally")
	}
	tl.Count(Match, nil)
	tl.Count(Mismatch, &debug.CanaryMismatch{Seed: 2})
	st := tl.Status()
	if st.Results[Match] != 1 || st.Results[Mismatch] != 1 || st.LastMismatch.Seed != 2 {
		t.Fatalf("status %+v", st)
	}
}
