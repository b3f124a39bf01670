// Package cpu is the fast CPU implementation of kernels.Backend: a pool of
// worker goroutines owned by the Backend, cache-blocked loops, and AVX2+FMA
// inner loops in Go assembly (kern_amd64.s), with a portable Go twin of every
// inner loop (kern_generic.go) for other architectures and for x86 CPUs
// without AVX2, FMA or F16C, chosen at run time (golang.org/x/sys/cpu).
// On CPUs with AVX-512 (F, BW, VL, VBMI), Q8_0 decode (one or two x rows)
// runs a 512-bit kernel (kern_avx512_amd64.s) that gives the same bits, and
// with F, DQ and VL prefill runs 6×8 tiles of 512-bit registers
// (gemm_avx512_amd64.s), again with the same bits.
//
// Why assembly rather than the simd/archsimd package: archsimd needs the
// GOEXPERIMENT=simd toolchain flag, so a default `go build` would not get
// it, and its API is not yet covered by the Go 1 compatibility promise. The
// hot paths are a handful of short inner loops (dot-product tiles, weight
// and index-key decoding, the attention value sum, exp for softmax and
// SwiGLU), which are easy to write, review and test once in assembly, and
// then build everywhere with no flags.
//
// Batch and thread invariance (see package kernels) is exact here: work is
// split between goroutines only over independent outputs (rows of W, rows
// of x, tokens×heads, tokens×slots), never inside a sum, and every dot
// product is accumulated the same way in every tile shape (see kernelSet),
// so each output is the same bits whatever the batch holds and however many
// threads run it. TestInvariance checks this.
//
// Exponentials: the assembly Softmax (also inside Attention) and SwiGLU use
// a vectorised exp (Cephes-style range reduction and polynomial, at most 2
// ulps from math.Exp and about 1 measured, see TestExpAccuracy) and an
// 8-lane sum, well within the conformance tolerances; the portable kernels
// use math.Exp and the reference's sequential sum.
package cpu

import (
	"runtime"
	"sync"

	"github.com/pdkit/pdkit/kernels"
)

// Backend is the fast CPU backend. Its methods may be called from several
// goroutines at once. Call Close when done with it to stop its workers.
//
// Idle workers poll for the next call for up to 50 µs before parking (a
// decode step makes calls every few microseconds), so give a Backend no
// more threads than the cores it may have to itself.
type Backend struct {
	k       *kernelSet
	pool    *pool
	threads int
	// minWork is the amount of work (multiply-adds or similar) below which
	// a call is not worth splitting: waking a worker costs microseconds.
	minWork int
	scratch sync.Pool // *[]float32
}

var _ kernels.Backend = (*Backend)(nil)

// defaultMinWork is a few microseconds of work for one core: a decode
// step of the small model (288×288 to 768×288 matrices) ran fastest with
// 2 threads at this size, against half and double it.
const defaultMinWork = 1 << 15

// partsPerThread over-splits large calls so that a thread that starts late
// or runs slow does not hold the call up: the others take its parts.
const partsPerThread = 4

// New starts a backend with threads goroutines (the caller's and threads-1
// workers); threads <= 0 means runtime.GOMAXPROCS(0).
func New(threads int) *Backend { return newBackend(threads, false) }

// newBackend is New, optionally forcing the portable Go kernels (tests).
func newBackend(threads int, portable bool) *Backend {
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	k := asmKernels()
	if portable || k == nil {
		k = genericKernels()
	}
	b := &Backend{k: k, pool: newPool(threads), threads: threads, minWork: defaultMinWork}
	// A Backend dropped without Close still lets its workers go.
	runtime.AddCleanup(b, func(p *pool) { p.close() }, b.pool)
	return b
}

// Close stops the worker goroutines and waits for them to exit. It is
// idempotent; calls made after Close still work, on the calling goroutine.
func (b *Backend) Close() { b.pool.close() }

// Threads is the number of goroutines a call may use.
func (b *Backend) Threads() int { return b.threads }

func (b *Backend) Name() string { return "cpu" }

// Kernels names the inner loops in use: "avx2" (assembly), "avx2+avx512"
// (the same, with AVX-512 Q8_0 decode and prefill kernels) or "go".
func (b *Backend) Kernels() string { return b.k.name }

// parts is how many pieces to cut work into.
func (b *Backend) parts(work int) int {
	if b.threads == 1 || work < 2*b.minWork {
		return 1
	}
	return min(work/b.minWork, b.threads*partsPerThread)
}

// getScratch returns a float32 buffer of at least n elements; give it back
// with putScratch.
func (b *Backend) getScratch(n int) *[]float32 {
	p, _ := b.scratch.Get().(*[]float32)
	if p == nil {
		p = new([]float32)
	}
	if cap(*p) < n {
		*p = make([]float32, n)
	}
	*p = (*p)[:n]
	return p
}

func (b *Backend) putScratch(p *[]float32) { b.scratch.Put(p) }

// ceilDiv is ⌈a/b⌉ for positive b.
func ceilDiv(a, b int) int { return (a + b - 1) / b }
