package bench

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// TestRunTiny runs the whole benchmark on the tiny model: real files, real
// generation, every figure present and positive.
func TestRunTiny(t *testing.T) {
	cfg := Config{
		Home: t.TempDir(), Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny,
		Types: []kernels.DType{kernels.F32, kernels.Q8_0}, Threads: []int{1, 2},
		PromptLen: 40, DecodeTokens: 8, Batch: 4, Repeats: 1, DRAMBytes: 4 << 20,
	}
	rep, err := Run(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != 4 {
		t.Fatalf("%d rows, want 4", len(rep.Rows))
	}
	for _, r := range rep.Rows {
		if !(r.Prefill > 0 && r.Decode1 > 0 && r.DecodeBatch > 0 && r.Bound > 0 && r.BoundResident > 0) {
			t.Errorf("row %+v has a non-positive figure", r)
		}
	}
	checkReport(t, rep.Print, "built-in llama-dsa tiny model (dim 64, 2 layers, vocab 512)", "Q8_0", "batch-4 tok/s", "DRAM read bandwidth")
}

// TestRunModelFileAtDepth measures a GGUF file given by path, its type and
// shape read from it, with decode at a depth.
func TestRunModelFileAtDepth(t *testing.T) {
	path, err := builtin.Ensure(t.TempDir(), builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 1, Type: kernels.Q8_0})
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		ModelPath: path, Types: []kernels.DType{kernels.F32}, Threads: []int{1},
		PromptLen: 40, DecodeTokens: 8, Depth: 300, Batch: 2, Repeats: 1, DRAMBytes: 4 << 20,
	}
	rep, err := Run(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != 1 || rep.Rows[0].Type != kernels.Q8_0 || !(rep.Rows[0].Decode1 > 0 && rep.Rows[0].DecodeBatch > 0) {
		t.Fatalf("rows %+v, want one Q8_0 row with positive figures", rep.Rows)
	}
	checkReport(t, rep.Print, "llama model "+filepath.Base(path)+" (dim 64, 2 layers, vocab 512)", "after a 300-token prompt (depth 300)", "Q8_0: ")

	cfg.Depth = 510
	if _, err := Run(context.Background(), cfg, io.Discard); err == nil || !strings.Contains(err.Error(), "depth 510") {
		t.Fatalf("depth 510 plus 8 decoded tokens beyond the context 512: %v", err)
	}
}

// checkReport prints a report through print, logs it and checks that it
// says each of wants; it returns the report.
func checkReport(t *testing.T, print func(io.Writer), wants ...string) string {
	t.Helper()
	var out bytes.Buffer
	print(&out)
	t.Log(out.String())
	for _, want := range wants {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
	return out.String()
}

// TestStepWeightBytes counts every matrix a decode step reads, once.
func TestStepWeightBytes(t *testing.T) {
	path, err := builtin.Ensure(t.TempDir(), builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 1, Type: kernels.F32})
	if err != nil {
		t.Fatal(err)
	}
	m, err := model.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c := m.Config
	perLayer := c.QDim()*c.Dim + 2*c.KVDim()*c.Dim + c.Dim*c.QDim() + 3*c.Hidden*c.Dim + 2*c.Dim
	want := int64(4 * (c.Layers*perLayer + c.VocabSize*c.Dim))
	if got := StepWeightBytes(m); got != want {
		t.Fatalf("StepWeightBytes = %d, want %d", got, want)
	}
}

func TestBandwidthPositive(t *testing.T) {
	b := cpu.New(1)
	defer b.Close()
	if bw := Bandwidth(b, 1<<20, 1); !(bw > 0) {
		t.Fatalf("bandwidth %v", bw)
	}
}
