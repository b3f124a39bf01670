//go:build cuda

package cuda

import (
	"fmt"
	"runtime"

	"gorgonia.org/cu"

	"github.com/pdkit/pdkit/kernels"
)

// Backend runs the kernels on one GPU (device 0).
//
// The CUDA context is current on one OS thread at a time: every method that
// talks to the device must run with the goroutine locked to a thread
// (runtime.LockOSThread) and the context made current there.
type Backend struct {
	dev  cu.Device
	name string
	ctx  cu.CUContext
	mod  cu.Module              // the kernels, loaded from ptx
	fns  map[string]cu.Function // entry points by name (kernelNames)
}

// ptx is the kernels' module, compiled for sm_90. It is empty until the
// CUDA milestone adds the kernels.
var ptx string

// kernelNames are the entry points New loads from the module.
var kernelNames = [...]string{
	"matmul_f32", "matmul_f16", "matmul_bf16", "matmul_q8_0",
	"rmsnorm", "rope", "swiglu", "softmax",
	"attention", "index_score_fp8", "index_score_bf16", "topk",
	"quantize_fp8", "dequantize_fp8", "to_bf16", "from_bf16",
}

// New creates a context on device 0 and loads the kernels. Until the
// kernels exist it releases the device again and returns an error wrapping
// kernels.ErrUnavailable, so that callers fall back to a CPU backend. Every
// failure wraps kernels.ErrUnavailable.
func New() (*Backend, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	n, err := cu.NumDevices()
	if err != nil {
		return nil, unavailable("counting devices: %v", err)
	}
	if n == 0 {
		return nil, unavailable("no CUDA device")
	}
	dev, err := cu.GetDevice(0)
	if err != nil {
		return nil, unavailable("device 0: %v", err)
	}
	name, err := dev.Name()
	if err != nil {
		return nil, unavailable("device 0: %v", err)
	}
	major, minor, err := dev.ComputeCapability()
	if err != nil {
		return nil, unavailable("%s: compute capability: %v", name, err)
	}
	ctx, err := dev.MakeContext(cu.SchedAuto)
	if err != nil {
		return nil, unavailable("%s: creating a context: %v", name, err)
	}
	b := &Backend{dev: dev, name: name, ctx: ctx, fns: make(map[string]cu.Function, len(kernelNames))}
	if ptx == "" {
		b.Close()
		return nil, unavailable("cuda kernels not implemented yet (%s, sm_%d%d initialised)", name, major, minor)
	}
	if b.mod, err = cu.LoadData(ptx); err != nil {
		b.Close()
		return nil, unavailable("%s: loading the kernels: %v", name, err)
	}
	for _, k := range kernelNames {
		fn, err := b.mod.Function(k)
		if err != nil {
			b.Close()
			return nil, unavailable("%s: kernel %s: %v", name, k, err)
		}
		b.fns[k] = fn
	}
	return b, nil
}

func unavailable(format string, args ...any) error {
	return fmt.Errorf("%w: cuda: %s", kernels.ErrUnavailable, fmt.Sprintf(format, args...))
}

// Close destroys the context (and with it the module). It is idempotent.
func (b *Backend) Close() error {
	var zero cu.CUContext
	if b.ctx == zero {
		return nil
	}
	return b.ctx.Destroy()
}

func (b *Backend) unimplemented(op string) {
	panic("kernels/cuda: " + op + " not implemented yet")
}
