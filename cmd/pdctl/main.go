// Command pdctl is the operator's tool for a running pdkit cluster.
//
// main only builds the command tree, runs it and turns the outcome into an
// exit status; the commands live in their own files.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"syscall"
)

// version is the release this binary was built from, set at link time with
// -ldflags "-X main.version=...".
var version = "dev"

// exitCode is pdctl's exit status. Scripts may depend on these values.
//
// A command that ran but found a problem it shows in its output (status,
// fault and queues with an unreachable server: a row says so and the other
// servers are still shown) exits with exitFindings, like diagnose with
// findings. It is the same value as exitError: either way the cluster did
// not answer as a healthy one does.
type exitCode int

const (
	exitOK       exitCode = 0   // the command did what it was asked
	exitError    exitCode = 1   // the command failed
	exitFindings exitCode = 1   // the command ran and reports a problem in its output
	exitUsage    exitCode = 2   // unknown command, bad flag or bad arguments
	exitNoRun    exitCode = 2   // diagnose or bundle could not run: nothing answered
	exitCancel   exitCode = 130 // interrupted (SIGINT or SIGTERM)
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	f := &factory{
		In:     os.Stdin,
		Out:    os.Stdout,
		ErrOut: os.Stderr,
		Build:  buildInfo{Version: version, GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH},
		OutTTY: isTerminal(os.Stdout),
		Getenv: os.Getenv,
	}
	code := run(ctx, f, os.Args[1:])
	stop()
	os.Exit(int(code))
}

// run executes the command line args and maps its error to an exit code.
// This is the one place where errors become exit codes and messages on stderr.
func run(ctx context.Context, f *factory, args []string) exitCode {
	root := newCmdRoot(f)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return exitCodeFor(err, f.ErrOut)
}

func exitCodeFor(err error, stderr io.Writer) exitCode {
	var usage *usageError
	var unreachable *unreachableError
	var findings *findingsError
	var noRun *cannotRunError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, context.Canceled):
		return exitCancel
	case errors.As(err, &usage):
		fmt.Fprintf(stderr, "pdctl: %v\nRun '%s --help' for usage.\n", usage.err, usage.cmd)
		return exitUsage
	case errors.As(err, &noRun):
		fmt.Fprintf(stderr, "pdctl: cannot run: %v\n", err)
		return exitNoRun
	case errors.As(err, &findings):
		fmt.Fprintf(stderr, "pdctl: %v\n", err)
		return exitFindings
	case errors.As(err, &unreachable):
		fmt.Fprintf(stderr, "pdctl: %v\n", err)
		return exitFindings
	default:
		fmt.Fprintf(stderr, "pdctl: %v\n", err)
		return exitError
	}
}

// isTerminal says whether f is a character device (a terminal), without
// cgo or another module.
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
