// Package lint holds pdkit's project-wide checks, written as tests so that
// "go test ./..." enforces them: every Go file is gofmt-formatted, the
// operator side (cmd/pdctl, tui, diag, api) stays free of the engine, the
// kernels and cgo, only kernels/cuda imports gorgonia.org/cu, go.mod and
// go.sum are tidy, no file names the machine it was written on, and no help
// text of pdserve or pdctl and no diag rule's doc, summary or remedy names
// a fault switch or a flag that does not exist (names_test.go: it reads the
// engine's fault registry and the flags of the built binaries), and the
// packages cut into small pieces stay so: size guards bound their
// functions, files and the methods of their types (size_test.go). And
// staticcheck finds nothing in the module (staticcheck_test.go): the
// version go.mod's tool line pins, the checks staticcheck.conf chooses.
// Every time.Sleep in a test says in a comment why real time must pass
// instead of waiting on a condition with internal/waitfor (sleep_test.go).
//
// The package has no non-test code.
package lint
