package builtin

import (
	"bytes"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/gguf"
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

// TestMediumHasStories110MShape checks medium against llama2.c's
// stories110M: the shape, and about 110M parameters (output tied).
func TestMediumHasStories110MShape(t *testing.T) {
	c, err := Shape(model.ArchLlama, SizeMedium)
	if err != nil {
		t.Fatal(err)
	}
	if c.Dim != 768 || c.Layers != 12 || c.Heads != 12 || c.KVHeads != 12 || c.HeadDim != 64 || c.Hidden != 2048 ||
		c.VocabSize != 32000 || c.ContextLen != 2048 || !c.TiedOutput || c.Indexer != nil {
		t.Fatalf("medium is %+v", c)
	}
	if n := parameters(tensors(c)); n < 109e6 || n > 110e6 {
		t.Fatalf("medium llama has %d parameters, want about 110M", n)
	}
	dsa, err := Shape(model.ArchLlamaDSA, SizeMedium)
	if err != nil {
		t.Fatal(err)
	}
	if ix := dsa.Indexer; ix == nil || ix.Heads != 8 || ix.Dim != 64 || ix.TopK != 256 {
		t.Fatalf("medium llama-dsa indexer is %+v", dsa.Indexer)
	}
}

func parameters(ts []tensorPlan) int {
	n := 0
	for _, t := range ts {
		n += t.rows * t.cols
	}
	return n
}

// TestMediumMetadata reads medium's metadata back as the loader does,
// without drawing its 110M weights.
func TestMediumMetadata(t *testing.T) {
	for _, arch := range model.Archs {
		s := Spec{Arch: arch, Size: SizeMedium, Seed: 1, Type: kernels.Q8_0}
		want, err := Shape(arch, SizeMedium)
		if err != nil {
			t.Fatal(err)
		}
		w, err := newWriter(s, want)
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if _, err := w.WriteTo(&buf); err != nil {
			t.Fatal(err)
		}
		f, err := gguf.Parse(buf.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		got, err := model.ReadConfig(f)
		if err != nil {
			t.Fatal(err)
		}
		got.TiedOutput = want.TiedOutput // the loader infers it from the tensors
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: metadata reads back as %+v, want %+v", arch, got, want)
		}
		if name, _ := f.String("general.name"); name != "pdkit-builtin-"+arch+"-medium-seed1" {
			t.Errorf("%s: general.name %q", arch, name)
		}
		if ft, _ := f.Uint("general.file_type"); ft != 7 {
			t.Errorf("%s: general.file_type %d, want 7 (Q8_0)", arch, ft)
		}
	}
}

// TestPlanIsWhatBuildWrites ties tensors to the file: every planned tensor,
// in order, with its shape, and nothing else.
func TestPlanIsWhatBuildWrites(t *testing.T) {
	for _, arch := range []string{model.ArchLlamaDSA, model.ArchDeepSeek2DSA} {
		s := Spec{Arch: arch, Size: SizeTiny, Seed: 1, Type: kernels.F32}
		f, err := gguf.Parse(encode(t, s))
		if err != nil {
			t.Fatal(err)
		}
		c, _ := Shape(s.Arch, s.Size)
		plan := tensors(c)
		if len(f.Tensors) != len(plan) {
			t.Fatalf("%s: file has %d tensors, plan %d", arch, len(f.Tensors), len(plan))
		}
		for i, p := range plan {
			got := f.Tensors[i]
			want := []uint64{uint64(p.cols), uint64(p.rows)}
			switch {
			case p.kind == normWeight:
				want = want[:1]
			case p.heads > 1:
				want = []uint64{uint64(p.cols), uint64(p.rows / p.heads), uint64(p.heads)}
			}
			if got.Name != p.name || !slices.Equal(got.Shape, want) {
				t.Errorf("%s: tensor %d is %s %v, plan %s %v", arch, i, got.Name, got.Shape, p.name, want)
			}
		}
	}
}

// TestDeepSeekShapes: the DeepSeek-shaped sizes keep DeepSeek's
// attention proportions, medium its very sizes, and index keys of 2/9 of
// the latent row (DeepSeek-V3.2's 128 against 512 + 64).
func TestDeepSeekShapes(t *testing.T) {
	for _, size := range Sizes {
		c, err := Shape(model.ArchDeepSeek2DSA, size)
		if err != nil {
			t.Fatal(err)
		}
		ml, ix := c.MLA, c.Indexer
		if ml == nil || ix == nil || c.KVHeads != 1 || ml.KVRank != 8*c.RopeDim || ix.Dim*9 != 2*(ml.KVRank+c.RopeDim) {
			t.Errorf("%s: %+v, latent %+v, indexer %+v", size, c, ml, ix)
		}
		if size != SizeTiny && ml.NopeDim != 2*c.RopeDim {
			t.Errorf("%s: position-free key %d, RoPE %d", size, ml.NopeDim, c.RopeDim)
		}
		plain, _ := Shape(model.ArchDeepSeek2, size)
		if plain.Indexer != nil || plain.MLA == nil || *plain.MLA != *ml {
			t.Errorf("%s deepseek2: %+v", size, plain)
		}
	}
	m, _ := Shape(model.ArchDeepSeek2DSA, SizeMedium)
	if ml := m.MLA; ml.KVRank != 512 || m.RopeDim != 64 || ml.NopeDim != 128 || ml.VDim != 128 || m.Indexer.Dim != 128 {
		t.Errorf("medium is not DeepSeek-V3's attention: %+v, %+v, indexer %+v", m, ml, m.Indexer)
	}
}

func TestEveryShapeValid(t *testing.T) {
	for _, size := range Sizes {
		for _, arch := range model.Archs {
			if _, err := Shape(arch, size); err != nil {
				t.Errorf("%s %s: %v", arch, size, err)
			}
		}
	}
	if got := SizeList(); got != "tiny, small or medium" {
		t.Errorf("SizeList() = %q", got)
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

// A cached model cut short (a disk that filled while it was written, a
// truncated copy) is generated anew, and Ensure says why; the new file
// equals a fresh one.
func TestEnsureRepairsATruncatedModel(t *testing.T) {
	dir := t.TempDir()
	s := Spec{Arch: model.ArchLlama, Size: SizeTiny, Seed: 1, Type: kernels.F32}
	p, err := Ensure(dir, s)
	if err != nil {
		t.Fatal(err)
	}
	whole, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, int64(len(whole)/2)); err != nil {
		t.Fatal(err)
	}
	p2, repaired, err := EnsureRepaired(dir, s)
	if err != nil || p2 != p || repaired == nil || !strings.Contains(repaired.Error(), "extends past end of file") {
		t.Fatalf("Ensure of a truncated model: %q, repaired %v, %v", p2, repaired, err)
	}
	again, err := os.ReadFile(p)
	if err != nil || !bytes.Equal(again, whole) {
		t.Fatalf("the model generated anew differs from the first (%d bytes against %d)", len(again), len(whole))
	}
	if _, repaired, err := EnsureRepaired(dir, s); repaired != nil || err != nil {
		t.Fatalf("a sound model repaired: %v, %v", repaired, err)
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
