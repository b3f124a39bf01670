package main

import (
	"errors"
	"fmt"
	"io"
	"runtime"

	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/engine/gguf"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
	"github.com/pdkit/pdkit/kernels/ref"
)

// engineFlags are the flags every command that runs a model shares.
type engineFlags struct {
	model   string
	backend string
	threads int
	indexK  string
	kvDType string
}

func (e *engineFlags) register(f *pflag.FlagSet) {
	f.StringVar(&e.model, "model", "", "GGUF model file (default: the built-in small llama-dsa model, generated once into $PDKIT_HOME)")
	f.StringVar(&e.backend, "backend", "cpu", "kernels: cpu (fast) or ref (plain-Go reference, slow)")
	f.IntVar(&e.threads, "threads", 0, "CPU threads for the cpu backend (0: all)")
	f.StringVar(&e.indexK, "index-k", "fp8", "index-K precision of the sparse indexer: fp8 or bf16")
	f.StringVar(&e.kvDType, "kv-dtype", kvDTypeFlagHelp.def, kvDTypeFlagHelp.usage)
}

// kvDTypeFlagHelp is --kv-dtype's default and help, the same on every
// command that has the flag.
var kvDTypeFlagHelp = struct{ def, usage string }{"f32",
	"element type the KV cache stores K and V (or a deepseek2 model's latent) in: f32, bf16 or f16 (16-bit: half the KV memory and PD transfer bytes per token, " +
		"K and V rounded to nearest; a prefill and its decodes must agree)"}

// kvType reads --kv-dtype.
func (e *engineFlags) kvType() (kernels.DType, error) {
	return parseKVDType(e.kvDType)
}

// parseKVDType reads a --kv-dtype value as a usage error.
func parseKVDType(s string) (kernels.DType, error) {
	kv, err := kernels.ParseKVType(s)
	if err != nil {
		return 0, usagef("--kv-dtype %q: want f32, bf16 or f16", s)
	}
	return kv, nil
}

// resolveModel returns the model path, generating the default model into
// the cache folder when none is given.
func resolveModel(path string, stderr io.Writer) (string, error) {
	if path != "" {
		return path, nil
	}
	home, err := builtin.Home()
	if err != nil {
		return "", err
	}
	spec := builtin.Default()
	p, repaired, err := builtin.EnsureRepaired(home, spec)
	if err != nil {
		return "", err
	}
	if repaired != nil {
		fmt.Fprintf(stderr, "model: the cached built-in model was damaged (%v); generated it anew\n", repaired)
	}
	fmt.Fprintf(stderr, "model: %s (built-in %s %s)\n", p, spec.Arch, spec.Size)
	return p, nil
}

// newBackend builds the kernels; the returned func releases them.
func newBackend(name string, threads int) (kernels.Backend, func(), error) {
	perRank, err := rankBackends(name, threads)
	if err != nil {
		return nil, nil, err
	}
	b := perRank(0)
	release := func() {}
	if c, ok := b.(interface{ Close() }); ok {
		release = c.Close
	}
	return b, release, nil
}

// rankBackends checks the backend flags and returns what gives each TP
// rank of an engine its own kernels; the engine closes them.
func rankBackends(name string, threads int) (func(rank int) kernels.Backend, error) {
	if threads < 0 {
		return nil, usagef("--threads %d must be ≥ 0", threads)
	}
	switch name {
	case "cpu":
		return func(int) kernels.Backend { return cpu.New(threads) }, nil
	case "ref":
		return func(int) kernels.Backend { return ref.New() }, nil
	}
	return nil, usagef("--backend %q: want cpu or ref", name)
}

// open loads the model and kernels the flags name.
func (e *engineFlags) open(stderr io.Writer) (*model.Model, kernels.Backend, kernels.IndexKDType, func(), error) {
	ik, err := kernels.ParseIndexKDType(e.indexK)
	if err != nil {
		return nil, nil, 0, nil, usageError{err}
	}
	b, closeB, err := newBackend(e.backend, e.threads)
	if err != nil {
		return nil, nil, 0, nil, err
	}
	path, err := resolveModel(e.model, stderr)
	if err != nil {
		closeB()
		return nil, nil, 0, nil, err
	}
	m, err := openModel(path)
	if err != nil {
		closeB()
		return nil, nil, 0, nil, err
	}
	return m, b, ik, func() { m.Close(); closeB() }, nil
}

// openModel opens the model at path; a file that is not a whole GGUF says
// what to do about it.
func openModel(path string) (*model.Model, error) {
	m, err := model.Open(path)
	if errors.Is(err, gguf.ErrFormat) {
		return nil, fmt.Errorf("%w\nthe model file is damaged or not a GGUF (a truncated copy, a disk that filled while it was written?): "+
			"copy it again, or run without --model to use the built-in model, which pdserve generates anew when its cached copy is damaged", err)
	}
	return m, err
}

// resolveSchedule checks --schedule and turns auto into the loop that
// suits the kernels (serve.ResolveSchedule): the ranks' forward passes keep
// tp × threads CPU threads busy (the ref backend's one per rank) against
// the CPUs Go runs on. why says what auto saw; empty for a loop named.
func resolveSchedule(schedule, backend string, threads, tp int) (loop, why string, err error) {
	switch schedule {
	case serve.ScheduleLockstep, serve.ScheduleOverlap:
		return schedule, "", nil
	case serve.ScheduleAuto:
	default:
		return "", "", usagef("--schedule %q: want %s, %s or %s", schedule, serve.ScheduleLockstep, serve.ScheduleOverlap, serve.ScheduleAuto)
	}
	per := threads
	if backend == "ref" {
		per = 1
	}
	busy, cpus := per*max(1, tp), runtime.GOMAXPROCS(0)
	loop = serve.ResolveSchedule(schedule, busy, cpus)
	what, verb := fmt.Sprintf("%d kernel threads", busy), "leave"
	if tp > 1 {
		what += fmt.Sprintf(" (%d ranks × %d)", tp, per)
	}
	if busy == 1 {
		what, verb = "1 kernel thread", "leaves"
	}
	free := "a CPU free for the loop"
	if loop == serve.ScheduleLockstep {
		free = "no CPU free"
	}
	return loop, fmt.Sprintf("auto: %s on %d CPUs %s %s", what, cpus, verb, free), nil
}
