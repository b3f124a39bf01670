//go:build medium

package builtin_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// TestMediumGeneratesLoadsAndRuns writes the medium model for real (460 MB
// as F32, so it is kept out of make test by the medium tag), loads it and
// generates greedily, twice, for each architecture.
func TestMediumGeneratesLoadsAndRuns(t *testing.T) {
	for _, arch := range model.Archs {
		for _, typ := range []kernels.DType{kernels.F32, kernels.Q8_0} {
			spec := builtin.Spec{Arch: arch, Size: builtin.SizeMedium, Seed: 1, Type: typ}
			path := filepath.Join(t.TempDir(), spec.FileName())
			start := time.Now()
			if err := builtin.WriteFile(path, spec); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s %v: generated in %v", arch, typ, time.Since(start).Round(time.Millisecond))
			want, _ := builtin.Shape(arch, builtin.SizeMedium)
			m, err := model.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			if got := m.Config; got.Dim != want.Dim || got.Layers != want.Layers || got.Hidden != want.Hidden || !got.TiedOutput || (got.Indexer == nil) != (want.Indexer == nil) {
				t.Errorf("%s %v loads as %+v, want %+v", arch, typ, got, want)
			}
			first := generate(t, m)
			if again := generate(t, m); !slices.Equal(first, again) {
				t.Errorf("%s %v: greedy generation is not reproducible: %v then %v", arch, typ, first, again)
			}
			m.Close()
		}
	}
}

func generate(t *testing.T, m *model.Model) []int32 {
	t.Helper()
	b := cpu.New(2)
	defer b.Close()
	r, err := runner.New(m, b, runner.Options{MaxSeqs: 1, KVTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	prompt, err := m.Tokenizer.Encode("Once upon a time", true)
	if err != nil {
		t.Fatal(err)
	}
	res, _, err := r.Generate(context.Background(), []runner.Request{{Prompt: prompt, MaxTokens: 8, IgnoreEOS: true}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res[0].Tokens) != 8 {
		t.Fatalf("generated %d tokens, want 8", len(res[0].Tokens))
	}
	return res[0].Tokens
}
