// Package tracetest runs scripted trace tests: files of commands, each
// followed by the output it must produce, in the manner of etcd raft's
// interaction tests. A state machine's test gives a function that runs one
// command; the files say what each command must print. With the test
// binary's -rewrite flag the files' outputs are regenerated instead.
//
// A file is a list of cases. Each case is optional comment lines ("#")
// and blank lines, one command line, a "----" line and the expected output
// up to the next blank line (or the end of the file).
package tracetest

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of testdata/*.txt traces")

// Case is one command of a trace file and the output it expects.
type Case struct {
	Pre  []string // comments and blank lines before the command
	Cmd  string
	Line int
	Want string
}

// Parse reads a trace file's text; tail is what follows the last case.
func Parse(text string) (cases []Case, tail []string, bad int) {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	var pre []string
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if strings.TrimSpace(l) == "" || strings.HasPrefix(l, "#") {
			pre = append(pre, l)
			continue
		}
		c := Case{Pre: pre, Cmd: l, Line: i + 1}
		pre = nil
		if i+1 >= len(lines) || lines[i+1] != "----" {
			return cases, pre, i + 1
		}
		i += 2
		var out []string
		for ; i < len(lines) && lines[i] != ""; i++ {
			out = append(out, lines[i])
		}
		if len(out) > 0 {
			c.Want = strings.Join(out, "\n") + "\n"
		}
		cases = append(cases, c)
		if i < len(lines) {
			pre = append(pre, "") // the blank line that ended the output
		}
	}
	return cases, pre, 0
}

// Run runs every file matching glob as a subtest: a fresh command runner
// from newRunner per file, each command's output compared with the file's.
func Run(t *testing.T, glob string, newRunner func(t *testing.T) func(cmd string) string) {
	t.Helper()
	files, err := filepath.Glob(glob)
	if err != nil || len(files) == 0 {
		t.Fatalf("no traces match %s: %v", glob, err)
	}
	for _, path := range files {
		t.Run(strings.TrimSuffix(filepath.Base(path), ".txt"), func(t *testing.T) {
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			cases, tail, bad := Parse(string(data))
			if bad != 0 {
				t.Fatalf("%s:%d: command without a ---- line", path, bad)
			}
			run := newRunner(t)
			var b strings.Builder
			for _, c := range cases {
				got := run(c.Cmd)
				if *rewrite {
					for _, l := range c.Pre {
						b.WriteString(l + "\n")
					}
					b.WriteString(c.Cmd + "\n----\n" + got)
					continue
				}
				if got != c.Want {
					t.Fatalf("%s:%d: %s\ngot:\n%swant:\n%s", path, c.Line, c.Cmd, got, c.Want)
				}
			}
			if *rewrite {
				for _, l := range tail {
					b.WriteString(l + "\n")
				}
				if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// Args are a command's key=value arguments.
type Args map[string]string

// SplitArgs splits a command's fields into its key=value arguments and the
// rest, in order.
func SplitArgs(fields []string) (Args, []string) {
	a := Args{}
	var rest []string
	for _, f := range fields {
		if k, v, ok := strings.Cut(f, "="); ok {
			a[k] = v
		} else {
			rest = append(rest, f)
		}
	}
	return a, rest
}

// Int is argument k as an integer, def when absent.
func (a Args) Int(k string, def int) (int, error) {
	v, ok := a[k]
	if !ok {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("%s=%q: %v", k, v, err)
	}
	return n, nil
}

// Dur is argument k as a duration (a bare number is seconds), def when
// absent.
func (a Args) Dur(k string, def time.Duration) (time.Duration, error) {
	v, ok := a[k]
	if !ok {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		if n, nerr := strconv.Atoi(v); nerr == nil {
			return time.Duration(n) * time.Second, nil
		}
		return 0, fmt.Errorf("%s=%q: %v", k, v, err)
	}
	return d, nil
}

// Str is argument k, def when absent.
func (a Args) Str(k, def string) string {
	if v, ok := a[k]; ok {
		return v
	}
	return def
}

// Errors turns a command runner that can fail into one Run takes: a
// command's error is its output, as "error: ..." on one line.
func Errors(run func(cmd string) (string, error)) func(string) string {
	return func(cmd string) string {
		out, err := run(cmd)
		if err != nil {
			return "error: " + err.Error() + "\n"
		}
		return out
	}
}
