// Package lint holds pdkit's project-wide checks, written as tests so that
// "go test ./..." enforces them: every Go file is gofmt-formatted, the
// operator side (cmd/pdctl, tui, diag, api) stays free of the engine, the
// kernels and cgo, only kernels/cuda imports gorgonia.org/cu, go.mod and
// go.sum are tidy, and no file names the machine it was written on.
//
// The package has no non-test code.
package lint
