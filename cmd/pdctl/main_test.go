package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

var testBuild = buildInfo{Version: "v0.1.0", GoVersion: "go1.26.8", OS: "linux", Arch: "amd64"}

// runArgs runs pdctl with args and returns its exit code, stdout and stderr.
func runArgs(t *testing.T, args ...string) (exitCode, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	f := &factory{In: strings.NewReader(""), Out: &out, ErrOut: &errOut, Build: testBuild}
	code := run(context.Background(), f, args)
	return code, out.String(), errOut.String()
}

func TestRun(t *testing.T) {
	tests := []struct {
		name   string
		args   []string
		code   exitCode
		stdout string
		stderr string
	}{
		{
			name:   "version",
			args:   []string{"version"},
			stdout: "pdctl v0.1.0 (go1.26.8 linux/amd64)\n",
		},
		{
			name: "version json",
			args: []string{"version", "--json"},
			stdout: `{
  "version": "v0.1.0",
  "goVersion": "go1.26.8",
  "os": "linux",
  "arch": "amd64"
}
`,
		},
		{
			name:   "version flag",
			args:   []string{"--version"},
			stdout: "pdctl v0.1.0 (go1.26.8 linux/amd64)\n",
		},
		{
			name:   "version with an argument",
			args:   []string{"version", "extra"},
			code:   exitUsage,
			stderr: "pdctl: version takes no arguments, got [\"extra\"]\nRun 'pdctl version --help' for usage.\n",
		},
		{
			name:   "unknown flag",
			args:   []string{"version", "--yaml"},
			code:   exitUsage,
			stderr: "pdctl: unknown flag: --yaml\nRun 'pdctl version --help' for usage.\n",
		},
		{
			name:   "unknown command with a suggestion",
			args:   []string{"versoin"},
			code:   exitUsage,
			stderr: "pdctl: unknown command \"versoin\" for \"pdctl\"; did you mean version?\nRun 'pdctl --help' for usage.\n",
		},
		{
			name:   "unknown command",
			args:   []string{"upgrade"},
			code:   exitUsage,
			stderr: "pdctl: unknown command \"upgrade\" for \"pdctl\"\nRun 'pdctl --help' for usage.\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := runArgs(t, tt.args...)
			if code != tt.code {
				t.Errorf("exit code = %d, want %d", code, tt.code)
			}
			if stdout != tt.stdout {
				t.Errorf("stdout:\n%s\nwant:\n%s", stdout, tt.stdout)
			}
			if stderr != tt.stderr {
				t.Errorf("stderr:\n%s\nwant:\n%s", stderr, tt.stderr)
			}
		})
	}
}

// TestRunHelp checks that a bare pdctl, --help and help explain pdctl and
// name its commands.
func TestRunHelp(t *testing.T) {
	for _, args := range [][]string{nil, {"--help"}, {"help"}} {
		code, stdout, stderr := runArgs(t, args...)
		if code != exitOK || stderr != "" {
			t.Errorf("pdctl %q: exit code %d, stderr %q; want 0 and nothing", args, code, stderr)
		}
		for _, want := range []string{"operator's tool", "diagnose", "mass-abort drill", "version"} {
			if !strings.Contains(stdout, want) {
				t.Errorf("pdctl %q: help lacks %q:\n%s", args, want, stdout)
			}
		}
	}
}

func TestExitCodeForCanceled(t *testing.T) {
	var stderr bytes.Buffer
	err := context.Canceled
	if code := exitCodeFor(err, &stderr); code != exitCancel || stderr.Len() != 0 {
		t.Errorf("exitCodeFor(%v) = %d, stderr %q; want %d and nothing", err, code, stderr.String(), exitCancel)
	}
}
