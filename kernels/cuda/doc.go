// Package cuda is the seam for the CUDA backend of kernels.Backend.
//
// It builds in two forms:
//
//   - without the cuda build tag (every default build), New always returns
//     an error wrapping kernels.ErrUnavailable, and nothing links against
//     CUDA;
//   - with -tags cuda, it links gorgonia.org/cu (cgo, cuda.h, libcuda). New
//     finds device 0 and creates a context on it, then, until the CUDA
//     kernels exist, releases it and returns an error wrapping
//     kernels.ErrUnavailable ("cuda kernels not implemented yet"), so callers
//     fall back to the CPU backends exactly as they do on a build without
//     the tag.
//
// gorgonia.org/cu calls cuInit in its package initialiser and exits the
// process when that fails, so a binary built with -tags cuda cannot even
// start on a machine without an NVIDIA driver and GPU: build CPU binaries
// without the tag, and never run `go test -tags cuda` on a CPU machine.
// Compiling (not running) the tagged code needs only cuda.h and the link
// stubs: see scripts/cuda-headers.sh.
//
// The CUDA milestone fills in the tagged file: compile the kernels to PTX
// (NVRTC, sm_90), set ptx, load the entry points listed in kernelNames in
// New, and replace each op's "not implemented yet" panic with a launch.
// The backend must then pass kerneltest.Run on a GPU machine, and keep the
// batch-invariance promise of package kernels (no split reductions whose
// shape depends on the batch).
package cuda
