// Package bench measures the model runtime the way an operator sizes a
// deployment: prompt (prefill) speed, single-stream decode speed, aggregate
// decode speed of a batch, each against the memory-bandwidth bound measured
// in the same run (decode reads every weight once per step, so weight bytes ÷
// read bandwidth is the fastest a step can be).
package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/internal/membw"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// Config chooses what to measure.
type Config struct {
	Home  string          // cache folder for the built-in models
	Arch  string          // built-in architecture (llama compares with llama.cpp on the same file)
	Size  string          // built-in size (default small)
	Types []kernels.DType // weight types of the built-in model
	// ModelPath, when set, is a GGUF file measured instead of a built-in
	// model: Arch, Size and Types are ignored, the file says its shape and
	// weight type.
	ModelPath    string
	Threads      []int
	PromptLen    int // prefill benchmark prompt
	DecodeTokens int // tokens generated per sequence in the decode benchmarks
	// Depth is the context length the decode benchmarks start at: each
	// sequence's prompt, prefilled before decode is timed (default 16).
	Depth     int
	Batch     int // sequences in the aggregate decode benchmark
	Repeats   int // each figure is the median of this many runs
	DRAMBytes int // buffer for the DRAM bandwidth (default 1 GiB: far beyond the caches)
	// KVType is the element type the KV pools store K and V in: F32 (the
	// zero value), BF16 or F16.
	KVType kernels.DType
}

// Row is one line of the report.
type Row struct {
	Type        kernels.DType
	Threads     int
	Prefill     float64 // prompt tokens/s
	Decode1     float64 // tokens/s, one sequence
	DecodeBatch float64 // tokens/s summed over Batch sequences
	Bound       float64 // tokens/s if a decode step only streamed the weights from DRAM at the measured bandwidth
	// BoundResident is the same bound with the bandwidth of reading a buffer
	// the size of the weights again and again: on a machine whose caches
	// hold the whole model, decode streams from cache, not DRAM.
	BoundResident float64
}

// Report is a whole run.
type Report struct {
	Config        Config
	Model         string          // what was measured: "built-in llama small model", "llama model FILE"
	Shape         model.Config    // its configuration, read from the file
	BandwidthGBs  map[int]float64 // read bandwidth by thread count, plain loads (internal/membw)
	KernelGBs     map[int]float64 // the same buffer streamed by the engine's 1×8 MatMul kernel
	Rows          []Row
	WeightBytes   map[kernels.DType]int64
	ModelFileName map[kernels.DType]string
}

// Run measures every (type, threads) pair.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if cfg.Size == "" {
		cfg.Size = builtin.SizeSmall
	}
	if cfg.DRAMBytes == 0 {
		cfg.DRAMBytes = 1 << 30
	}
	if cfg.Depth == 0 {
		cfg.Depth = 16
	}
	rep := &Report{Config: cfg, BandwidthGBs: map[int]float64{}, KernelGBs: map[int]float64{}, WeightBytes: map[kernels.DType]int64{}, ModelFileName: map[kernels.DType]string{}}
	for _, th := range cfg.Threads {
		bw := membw.Read(cfg.DRAMBytes, th, cfg.Repeats)
		b := cpu.New(th)
		kbw := Bandwidth(b, cfg.DRAMBytes, cfg.Repeats)
		b.Close()
		rep.BandwidthGBs[th], rep.KernelGBs[th] = bw/1e9, kbw/1e9
		fmt.Fprintf(progress, "read bandwidth, %d thread(s): %.1f GB/s (the MatMul kernel: %.1f)\n", th, bw/1e9, kbw/1e9)
	}
	if cfg.ModelPath != "" {
		m, err := model.Open(cfg.ModelPath)
		if err != nil {
			return nil, err
		}
		defer m.Close()
		typ := m.Layers[0].Q.DType
		rep.Config.Types = []kernels.DType{typ}
		rep.Model = fmt.Sprintf("%s model %s", m.Config.Arch, filepath.Base(cfg.ModelPath))
		return rep, measureModel(ctx, rep, m, typ, cfg.ModelPath, progress)
	}
	rep.Model = fmt.Sprintf("built-in %s %s model", cfg.Arch, cfg.Size)
	for _, typ := range cfg.Types {
		spec := builtin.Spec{Arch: cfg.Arch, Size: cfg.Size, Seed: builtin.DefaultSeed, Type: typ}
		m, path, err := openBuiltin(cfg.Home, spec)
		if err != nil {
			return nil, err
		}
		err = measureModel(ctx, rep, m, typ, path, progress)
		m.Close()
		if err != nil {
			return nil, err
		}
	}
	return rep, nil
}

// measureModel adds the rows of one model file, one per thread count.
func measureModel(ctx context.Context, rep *Report, m *model.Model, typ kernels.DType, path string, progress io.Writer) error {
	cfg := rep.Config
	if err := checkLengths(cfg, m.Config.ContextLen); err != nil {
		return err
	}
	rep.Shape = m.Config
	rep.ModelFileName[typ] = path
	wb := StepWeightBytes(m)
	rep.WeightBytes[typ] = wb
	for _, th := range cfg.Threads {
		row, err := measure(ctx, m, typ, th, cfg)
		if err != nil {
			return err
		}
		row.Bound = rep.BandwidthGBs[th] * 1e9 / float64(wb)
		row.BoundResident = membw.Read(int(wb), th, cfg.Repeats) / float64(wb)
		rep.Rows = append(rep.Rows, row)
		fmt.Fprintf(progress, "%v, %d thread(s): prefill %.0f, decode %.1f, batch %d %.1f tokens/s\n", typ, th, row.Prefill, row.Decode1, cfg.Batch, row.DecodeBatch)
	}
	return nil
}

// checkLengths checks that the prefill prompt and a decode at the depth fit
// the model's context.
func checkLengths(cfg Config, contextLen int) error {
	if cfg.PromptLen+1 > contextLen {
		return fmt.Errorf("bench: a %d-token prompt and the token it generates exceed the model's context length %d", cfg.PromptLen, contextLen)
	}
	if cfg.Depth+cfg.DecodeTokens+1 > contextLen {
		return fmt.Errorf("bench: depth %d plus %d decoded tokens and the token prefill generates exceed the model's context length %d", cfg.Depth, cfg.DecodeTokens, contextLen)
	}
	return nil
}

func measure(ctx context.Context, m *model.Model, typ kernels.DType, threads int, cfg Config) (Row, error) {
	b := cpu.New(threads)
	defer b.Close()
	row := Row{Type: typ, Threads: threads}
	rng := rand.New(rand.NewPCG(7, 7))
	prompt := func(n int) []int32 { return randTokens(rng, n, m.Config.VocabSize) }
	// run prefills chunk prompt tokens per step. The decode runs prefill
	// every prompt in one step, so each sequence starts decoding at the
	// depth together and the decode time holds decode steps only.
	run := func(reqs []runner.Request, chunk int) (runner.Stats, error) {
		kv := 0
		for _, q := range reqs {
			kv += len(q.Prompt) + q.MaxTokens
		}
		r, err := runner.New(m, b, runner.Options{MaxSeqs: len(reqs), KVTokens: kv + 16*len(reqs), PrefillChunk: chunk, KVType: cfg.KVType})
		if err != nil {
			return runner.Stats{}, err
		}
		_, st, err := r.Generate(ctx, reqs, nil)
		return st, err
	}
	var pre, d1, db []float64
	for range cfg.Repeats {
		st, err := run([]runner.Request{{Prompt: prompt(cfg.PromptLen), MaxTokens: 1, IgnoreEOS: true}}, cfg.PromptLen)
		if err != nil {
			return row, err
		}
		pre = append(pre, float64(st.PromptTokens)/st.Prefill.Seconds())

		st, err = run([]runner.Request{{Prompt: prompt(cfg.Depth), MaxTokens: cfg.DecodeTokens + 1, IgnoreEOS: true}}, cfg.Depth)
		if err != nil {
			return row, err
		}
		d1 = append(d1, float64(cfg.DecodeTokens)/st.Decode.Seconds())

		reqs := make([]runner.Request, cfg.Batch)
		for i := range reqs {
			reqs[i] = runner.Request{Prompt: prompt(cfg.Depth), MaxTokens: cfg.DecodeTokens + 1, IgnoreEOS: true}
		}
		st, err = run(reqs, cfg.Batch*cfg.Depth)
		if err != nil {
			return row, err
		}
		db = append(db, float64(cfg.Batch*cfg.DecodeTokens)/st.Decode.Seconds())
	}
	row.Prefill, row.Decode1, row.DecodeBatch = median(pre), median(d1), median(db)
	return row, nil
}

// StepWeightBytes is what one decode step reads of the weights: every
// layer matrix and the output projection (the embedding lookup reads one row).
func StepWeightBytes(m *model.Model) int64 {
	var n int64
	add := func(x *kernels.Matrix) {
		if x != nil {
			n += int64(len(x.Data))
		}
	}
	for i := range m.Layers {
		l := &m.Layers[i]
		for _, x := range []*kernels.Matrix{l.Q, l.K, l.V, l.O, l.Gate, l.Up, l.Down, l.IndexQ, l.IndexK, l.IndexW} {
			add(x)
		}
		n += int64(4 * (len(l.AttnNorm) + len(l.FFNNorm)))
	}
	add(m.Output)
	return n
}

// Bandwidth measures read bandwidth in bytes/s over a buffer of about the
// given size with the backend's own streaming kernel: a one-row MatMul over
// an F32 matrix reads every byte once and does almost no arithmetic per byte.
// A buffer far larger than the caches measures DRAM.
func Bandwidth(b kernels.Backend, bytes, repeats int) float64 {
	const cols = 1024
	rows := max(bytes/(4*cols), 1)
	data := make([]float32, rows*cols)
	for i := range data {
		data[i] = float32(i%7) * 0.25
	}
	w, err := kernels.NewMatrix(kernels.F32, rows, cols, kernels.F32Bytes(data))
	if err != nil {
		panic(err) // sizes above are constants
	}
	x := make([]float32, cols)
	out := make([]float32, rows)
	b.MatMul(out, x, w, 1) // fault the pages in
	var runs []float64
	for range max(repeats, 1) {
		start := time.Now()
		b.MatMul(out, x, w, 1)
		runs = append(runs, float64(len(w.Data))/time.Since(start).Seconds())
	}
	return median(runs)
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// Print writes the report as a table.
func (r *Report) Print(w io.Writer) {
	c := r.Config
	mc := r.Shape
	fmt.Fprintf(w, "\n%s (dim %d, %d layers, vocab %d); prefill: %d-token prompt; decode: %d tokens after a %d-token prompt (depth %d); batch: %d sequences; KV %s; median of %d\n\n",
		r.Model, mc.Dim, mc.Layers, mc.VocabSize, c.PromptLen, c.DecodeTokens, c.Depth, c.Depth, c.Batch, kernels.KVName(c.KVType), c.Repeats)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "weights\tthreads\tprefill tok/s\tdecode tok/s\tDRAM bound\tresident bound\tof resident\tbatch-%d tok/s\tbatch/single\t\n", c.Batch)
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%v\t%d\t%.0f\t%.1f\t%.0f\t%.0f\t%.0f%%\t%.0f\t%.1fx\t\n",
			row.Type, row.Threads, row.Prefill, row.Decode1, row.Bound, row.BoundResident, 100*row.Decode1/row.BoundResident, row.DecodeBatch, row.DecodeBatch/row.Decode1)
	}
	tw.Flush()
	fmt.Fprintln(w)
	for _, typ := range c.Types {
		fmt.Fprintf(w, "%v: %.1f MB of weights per decode step (%s)\n", typ, float64(r.WeightBytes[typ])/1e6, r.ModelFileName[typ])
	}
	for _, th := range c.Threads {
		fmt.Fprintf(w, "DRAM read bandwidth (%d MiB buffer), %d thread(s): %.1f GB/s with plain 32-byte loads; pdkit's 1×8 MatMul kernel streams the same buffer at %.1f GB/s\n",
			c.DRAMBytes>>20, th, r.BandwidthGBs[th], r.KernelGBs[th])
	}
	fmt.Fprintln(w, "DRAM bound: weight bytes per step ÷ DRAM bandwidth (plain loads, the memory system's rate, not a kernel's); resident bound: the same with the bandwidth of re-reading a buffer the size of the weights (what decode does when the caches hold the model)")
}
