package model_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// A model's fingerprint is the same for the same bytes and differs for
// other weights; CheckFile names a file written over in place, and another
// file renamed to its path, and is rate-limited.
func TestModelIdentity(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, seed uint64) string {
		p := filepath.Join(dir, name)
		if err := builtin.WriteFile(p, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: seed, Type: kernels.F32}); err != nil {
			t.Fatal(err)
		}
		return p
	}
	open := func(p string) *model.Model {
		m, err := model.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	a, a2, b := open(write("a.gguf", 1)), open(write("a2.gguf", 1)), open(write("b.gguf", 2))
	if !strings.HasPrefix(a.Fingerprint(), "sha256s:") || a.Fingerprint() != a2.Fingerprint() || a.Fingerprint() == b.Fingerprint() {
		t.Fatalf("fingerprints: %q, the same bytes %q, other weights %q", a.Fingerprint(), a2.Fingerprint(), b.Fingerprint())
	}
	now := time.Now()
	if c := a.CheckFile(now, time.Minute); c.Changed || c.Fingerprint != a.Fingerprint() {
		t.Fatalf("an untouched file: %+v", c)
	}
	// Written over in place: a new modification time.
	later := now.Add(time.Hour)
	if err := os.Chtimes(filepath.Join(dir, "a.gguf"), later, later); err != nil {
		t.Fatal(err)
	}
	if c := a.CheckFile(now.Add(time.Second), time.Minute); c.Changed {
		t.Fatal("checked again within its bound")
	}
	if c := a.CheckFile(now.Add(2*time.Minute), time.Minute); !c.Changed || !strings.Contains(c.Why, "after the server loaded it") {
		t.Fatalf("a file written after load: %+v", c)
	}
	// Another file renamed to the path.
	if err := os.Rename(filepath.Join(dir, "b.gguf"), filepath.Join(dir, "a2.gguf")); err != nil {
		t.Fatal(err)
	}
	if c := a2.CheckFile(now, time.Minute); !c.Changed || !strings.Contains(c.Why, "another file") {
		t.Fatalf("another file at the path: %+v", c)
	}
}

// A change the sampled check cannot see (one byte between its samples,
// the file's size and time kept) is seen by a full rehash on demand, and
// stays seen.
func TestVerifyFileFindsWhatSamplesMiss(t *testing.T) {
	p, m := testmodel.Own(t, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 1, Type: kernels.F32})
	clock := func() time.Time { return time.Unix(100, 0) }
	c, err := m.VerifyFile(t.Context(), clock)
	if err != nil || !c.Matches() || c.First || !strings.HasPrefix(c.SHA256, "sha256:") || c.SHA256 != c.Baseline {
		t.Fatalf("an untouched file, hashed whole at load: %+v, %v", c, err)
	}
	testmodel.FlipBetweenSamples(t, p)
	if fc := m.CheckFile(time.Now(), 0); fc.Changed {
		t.Fatalf("the sampled check saw the byte (move it between the samples): %+v", fc)
	}
	c, err = m.VerifyFile(t.Context(), clock)
	if err != nil || c.Matches() {
		t.Fatalf("after a byte changed: %+v, %v", c, err)
	}
	if fc := m.CheckFile(time.Now(), 0); !fc.Changed || !strings.Contains(fc.Why, "full hash changed") || fc.Verified.IsZero() {
		t.Fatalf("the sampled check after the rehash: %+v", fc)
	}
}
