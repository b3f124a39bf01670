package builtin

import (
	"bytes"
	"os"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/kernels"
)

func encode(t *testing.T, s Spec) []byte {
	t.Helper()
	w, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := w.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestDeterministicFromSeed(t *testing.T) {
	s := Spec{Arch: model.ArchLlamaDSA, Size: SizeTiny, Seed: 9, Type: kernels.Q8_0}
	a, b := encode(t, s), encode(t, s)
	if !bytes.Equal(a, b) {
		t.Fatal("the same spec gave different files")
	}
	s.Seed = 10
	if bytes.Equal(a, encode(t, s)) {
		t.Fatal("another seed gave the same file")
	}
}

func TestSmallHasStories15MShape(t *testing.T) {
	c, err := Shape(model.ArchLlama, SizeSmall)
	if err != nil {
		t.Fatal(err)
	}
	if c.Dim != 288 || c.Layers != 6 || c.Heads != 6 || c.Hidden != 768 || c.VocabSize != 32000 || !c.TiedOutput {
		t.Fatalf("small is %+v", c)
	}
	if c, _ := Shape(model.ArchLlamaDSA, SizeSmall); c.Indexer == nil {
		t.Fatal("small llama-dsa has no indexer")
	}
}

func TestEnsureGeneratesOnce(t *testing.T) {
	dir := t.TempDir()
	s := Spec{Arch: model.ArchLlama, Size: SizeTiny, Seed: 1, Type: kernels.F32}
	p, err := Ensure(dir, s)
	if err != nil {
		t.Fatal(err)
	}
	st1, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	// A second call must reuse the file: mark it and check the mark stays.
	if err := os.Chmod(p, 0o600); err != nil {
		t.Fatal(err)
	}
	p2, err := Ensure(dir, s)
	if err != nil || p2 != p {
		t.Fatalf("second Ensure: %q, %v", p2, err)
	}
	st2, _ := os.Stat(p2)
	if st2.Mode().Perm() != 0o600 || st2.Size() != st1.Size() {
		t.Fatal("Ensure regenerated an existing model")
	}
}

func TestHomeFromEnvironment(t *testing.T) {
	t.Setenv("PDKIT_HOME", "/somewhere/pdkit")
	if h, err := Home(); err != nil || h != "/somewhere/pdkit" {
		t.Fatalf("Home() = %q, %v", h, err)
	}
}

func TestRefusals(t *testing.T) {
	if _, err := Shape("gpt", SizeTiny); err == nil {
		t.Error("unknown arch accepted")
	}
	if _, err := Shape(model.ArchLlama, "huge"); err == nil {
		t.Error("unknown size accepted")
	}
	if _, err := ParseType("q4_k"); err == nil {
		t.Error("unknown type accepted")
	}
}
