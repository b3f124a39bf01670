package reftest

import (
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/kernels"
)

// The reference decodes and rounds number formats with its own code. These
// tests check it against first principles (known values) and against the
// kernels package's conversions: two independent implementations that agree
// on every code, and on every tie, are unlikely to share a bug.

func same(a, b float64) bool { return a == b || (math.IsNaN(a) && math.IsNaN(b)) }

func TestKnownValues(t *testing.T) {
	cases := []struct {
		name string
		got  float64
		want float64
	}{
		{"f16 1", F16(0x3C00), 1},
		{"f16 -2", F16(0xC000), -2},
		{"f16 max", F16(0x7BFF), 65504},
		{"f16 min subnormal", F16(0x0001), 0x1p-24},
		{"bf16 1", BF16(0x3F80), 1},
		{"bf16 -1.5", BF16(0xBFC0), -1.5},
		{"e4m3 1", E4M3(0x38), 1},
		{"e4m3 max", E4M3(0x7E), 448},
		{"e4m3 -max", E4M3(0xFE), -448},
		{"e4m3 min subnormal", E4M3(0x01), 0x1p-9},
		{"e4m3 min normal", E4M3(0x08), 0x1p-6},
		{"round e4m3 tie to even (1+1/16 -> 1)", RoundE4M3(1 + 1.0/16), 1},
		{"round e4m3 tie to even (1+3/16 -> 1.25)", RoundE4M3(1 + 3.0/16), 1.25},
		{"round e4m3 saturates", RoundE4M3(1000), 448},
		{"round e4m3 464 saturates", RoundE4M3(464), 448},
		{"round e4m3 subnormal tie", RoundE4M3(1.5 * 0x1p-9), 2 * 0x1p-9},
		{"round bf16 tie to even", RoundBF16(1 + 1.0/256), 1},
		{"round bf16 tie up to even", RoundBF16(1 + 3.0/256), 1 + 4.0/256},
	}
	for _, c := range cases {
		if !same(c.got, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, c.got, c.want)
		}
	}
	if !math.IsNaN(E4M3(0x7F)) || !math.IsNaN(E4M3(0xFF)) {
		t.Error("e4m3 S.1111.111 is not NaN")
	}
}

func TestDecodersAgreeWithKernels(t *testing.T) {
	for c := range 256 {
		if got, want := E4M3(uint8(c)), float64(kernels.FP8ToF32(uint8(c))); !same(got, want) {
			t.Errorf("e4m3 %#02x: %v, kernels %v", c, got, want)
		}
	}
	for c := range 1 << 16 {
		if got, want := F16(uint16(c)), float64(kernels.F16ToF32(uint16(c))); !same(got, want) {
			t.Fatalf("f16 %#04x: %v, kernels %v", c, got, want)
		}
		if got, want := BF16(uint16(c)), float64(kernels.BF16ToF32(uint16(c))); !same(got, want) {
			t.Fatalf("bf16 %#04x: %v, kernels %v", c, got, want)
		}
	}
}

func TestRoundingAgreesWithKernels(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var xs []float32
	// Every e4m3 value, and the midpoints between neighbours (exact ties),
	// and values just either side of them.
	for c := range 0x7F {
		v := E4M3(uint8(c))
		next := E4M3(uint8(c + 1))
		if math.IsNaN(next) {
			next = 512
		}
		mid := (v + next) / 2
		for _, x := range []float64{v, mid, math.Nextafter(mid, 0), math.Nextafter(mid, 1000)} {
			xs = append(xs, float32(x), -float32(x))
		}
	}
	for range 20000 {
		xs = append(xs, float32(rng.NormFloat64()*math.Exp2(float64(rng.IntN(40)-20))))
	}
	for _, x := range xs {
		if x > 448 || x < -448 {
			continue
		}
		code := kernels.F32ToFP8(x)
		if got, want := RoundE4M3(float64(x)), float64(kernels.FP8ToF32(code)); !same(got, want) {
			t.Errorf("e4m3 round %v (%b): %v, kernels %v", x, math.Float32bits(x), got, want)
		}
		if got := EncodeE4M3(float64(x)); got != code {
			t.Errorf("e4m3 encode %v: %#02x, kernels %#02x", x, got, code)
		}
		if got, want := RoundBF16(float64(x)), float64(kernels.BF16ToF32(kernels.F32ToBF16(x))); !same(got, want) {
			t.Errorf("bf16 round %v: %v, kernels %v", x, got, want)
		}
		if got, want := RoundF16(float64(x)), float64(kernels.F16ToF32(kernels.F32ToF16(x))); !same(got, want) {
			t.Errorf("f16 round %v: %v, kernels %v", x, got, want)
		}
	}
	// bf16 ties: float32s whose low 16 bits are exactly 0x8000.
	for range 2000 {
		bits := rng.Uint32()&0x3FFF0000 | 0x8000 | 0x3C000000
		x := math.Float32frombits(bits)
		if got, want := RoundBF16(float64(x)), float64(kernels.BF16ToF32(kernels.F32ToBF16(x))); !same(got, want) {
			t.Errorf("bf16 tie %v: %v, kernels %v", x, got, want)
		}
	}
}

func TestQuantizeIndexKey(t *testing.T) {
	k := []float64{0.5, -1.75, 3, 0.001}
	got := quantizeIndexKey(k, "fp8")
	s := float64(float32(3) / 448)
	for i, v := range k {
		if want := RoundE4M3(float64(float32(v))/s) * s; got[i] != want {
			t.Errorf("fp8 key[%d] = %v, want %v", i, got[i], want)
		}
	}
	if got[2] != 3 && math.Abs(got[2]-3) > 1e-6 {
		t.Errorf("the largest element should survive: %v", got[2])
	}
	zero := quantizeIndexKey([]float64{0, 0}, "fp8")
	if zero[0] != 0 || zero[1] != 0 {
		t.Errorf("zero key: %v", zero)
	}
	b := quantizeIndexKey(k, "bf16")
	for i, v := range k {
		if math.Abs(b[i]-v) > math.Abs(v)/256 {
			t.Errorf("bf16 key[%d] = %v, from %v", i, b[i], v)
		}
	}
}

// TestReadConfigDeepSeek2 checks that the latent-attention shape is read from
// llama.cpp's deepseek2 keys: the head's lengths from the *_mla keys, not
// from key_length and value_length (the cache row's).
func TestReadConfigDeepSeek2(t *testing.T) {
	for _, arch := range []string{"deepseek2", "deepseek2-dsa"} {
		path := filepath.Join(t.TempDir(), "tiny.gguf")
		if err := builtin.WriteFile(path, builtin.Spec{Arch: arch, Size: builtin.SizeTiny, Seed: 1, Type: kernels.F32}); err != nil {
			t.Fatal(err)
		}
		f, err := gguf.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		c, err := ReadConfig(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		want, err := builtin.Shape(arch, builtin.SizeTiny)
		if err != nil {
			t.Fatal(err)
		}
		got := [...]int{c.Heads, c.KVHeads, c.HeadDim, c.RopeDim, c.KVRank, c.NopeDim, c.VDim}
		exp := [...]int{want.Heads, 1, want.HeadDim, want.RopeDim, want.MLA.KVRank, want.MLA.NopeDim, want.MLA.VDim}
		if got != exp || !c.MLA() {
			t.Errorf("%s: heads, kv heads, head dim, rope, rank, nope, value = %v, want %v", arch, got, exp)
		}
		if hasIdx := c.IdxHeads > 0; hasIdx != (arch == "deepseek2-dsa") {
			t.Errorf("%s: indexer heads %d", arch, c.IdxHeads)
		}
	}
}
