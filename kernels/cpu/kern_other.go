//go:build !amd64

package cpu

// asmKernels: there are assembly kernels for amd64 only.
func asmKernels() *kernelSet { return nil }
