package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// run executes pdserve with args in process, as the binary would.
func run(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := newRootCmd()
	cmd.SetArgs(args)
	cmd.SetOut(&out)
	cmd.SetErr(&errb)
	err := cmd.ExecuteContext(context.Background())
	// exitCode prints to the process's stderr; capture the code only.
	saved := os.Stderr
	os.Stderr, _ = os.Open(os.DevNull)
	code = exitCode(err)
	os.Stderr = saved
	if err != nil {
		errb.WriteString(err.Error())
	}
	return out.String(), errb.String(), code
}

func TestModelInitInfoGenerate(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tiny.gguf")
	_, stderr, code := run(t, "model", "init", "--arch", "llama-dsa", "--size", "tiny", "--seed", "5", "-o", path)
	if code != 0 {
		t.Fatalf("model init: exit %d: %s", code, stderr)
	}
	first, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Deterministic: the same flags write the same bytes.
	path2 := filepath.Join(dir, "again.gguf")
	if _, stderr, code := run(t, "model", "init", "--arch", "llama-dsa", "--size", "tiny", "--seed", "5", "-o", path2); code != 0 {
		t.Fatal(stderr)
	}
	if second, _ := os.ReadFile(path2); !bytes.Equal(first, second) {
		t.Fatal("model init with the same seed wrote different files")
	}

	info, stderr, code := run(t, "model", "info", path)
	if code != 0 {
		t.Fatalf("model info: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"arch\tllama-dsa", "dim\t64", "indexer\t2 heads × 16, top-k 8"} {
		if !strings.Contains(info, want) {
			t.Errorf("model info lacks %q:\n%s", want, info)
		}
	}

	gen := func(extra ...string) (string, string) {
		args := append([]string{"generate", "--model", path, "--prompt", "Once upon a time", "--max-tokens", "12"}, extra...)
		out, stderr, code := run(t, args...)
		if code != 0 {
			t.Fatalf("generate %v: exit %d: %s", extra, code, stderr)
		}
		return out, stderr
	}
	out, stderr := gen()
	if strings.TrimSpace(out) == "" {
		t.Fatal("generate printed no completion")
	}
	if !regexp.MustCompile(`generated \d+ tokens, decode [0-9.]+ tokens/s`).MatchString(stderr) {
		t.Errorf("stderr lacks the speed line: %q", stderr)
	}
	if again, _ := gen(); again != out {
		t.Errorf("greedy generation is not reproducible: %q then %q", out, again)
	}
	if refOut, _ := gen("--backend", "ref"); refOut != out {
		t.Errorf("ref backend: %q, cpu backend: %q", refOut, out)
	}
	s1, _ := gen("--temperature", "1", "--seed", "3")
	s2, _ := gen("--temperature", "1", "--seed", "3")
	if s1 != s2 {
		t.Errorf("seeded sampling differs: %q vs %q", s1, s2)
	}
	if out, _ := gen("--index-k", "bf16"); strings.TrimSpace(out) == "" {
		t.Error("bf16 index-K generated nothing")
	}
	for _, kv := range []string{"bf16", "f16"} {
		if out, _ := gen("--kv-dtype", kv); strings.TrimSpace(out) == "" {
			t.Errorf("%s KV generated nothing", kv)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	dir := t.TempDir()
	cases := [][]string{
		{"model", "init", "--size", "huge", "-o", filepath.Join(dir, "x.gguf")},
		{"model", "init", "--arch", "gpt", "-o", filepath.Join(dir, "x.gguf")},
		{"model", "init", "--type", "q4_k", "-o", filepath.Join(dir, "x.gguf")},
		{"model", "init"},
		{"generate", "--prompt", "x", "--max-tokens", "0"},
		{"generate", "--prompt", "x", "--temperature", "-1"},
		{"generate", "--prompt", "x", "--index-k", "fp4"},
		{"generate", "--prompt", "x", "--kv-dtype", "fp8"},
		{"generate", "--prompt", "x", "--backend", "gpu"},
		{"generate", "--bogus"},
	}
	for _, args := range cases {
		_, stderr, code := run(t, args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "x.gguf")); err == nil {
		t.Error("a refused model init wrote a file")
	}
}

func TestBadModelFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad.gguf")
	if err := os.WriteFile(path, []byte("GGUF\x03\x00\x00\x00truncated"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, stderr, code := run(t, "generate", "--model", path, "--prompt", "x")
	if code != 1 || !strings.Contains(stderr, "gguf") {
		t.Fatalf("exit %d, stderr %q: want exit 1 naming the GGUF problem", code, stderr)
	}
	_, stderr, code = run(t, "model", "info", filepath.Join(t.TempDir(), "missing.gguf"))
	if code != 1 || !strings.Contains(stderr, "no such file") {
		t.Fatalf("missing file: exit %d, stderr %q", code, stderr)
	}
}

func TestConfigShowsSources(t *testing.T) {
	t.Setenv("PD_THREADS", "3")
	t.Setenv("PD_KV_DTYPE", "bf16")
	out, stderr, code := run(t, "config", "--index-k", "bf16")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^index-k\s+bf16\s+flag\s+PD_INDEX_K\s`),
		regexp.MustCompile(`(?m)^threads\s+3\s+env\s+PD_THREADS\s`),
		regexp.MustCompile(`(?m)^kv-dtype\s+bf16\s+env\s+PD_KV_DTYPE\s`),
		regexp.MustCompile(`(?m)^backend\s+cpu\s+default\s+PD_BACKEND\s`),
	} {
		if !want.MatchString(out) {
			t.Errorf("config output lacks %v:\n%s", want, out)
		}
	}
	t.Setenv("PD_THREADS", "many")
	if _, stderr, code := run(t, "config"); code != 2 || !strings.Contains(stderr, "PD_THREADS") {
		t.Errorf("bad PD_THREADS: exit %d, %q", code, stderr)
	}
}

// config shows the serve command's settings by default, another command's
// on request, and never prints a token.
func TestConfigOfCommands(t *testing.T) {
	t.Setenv("PD_ADMIN_TOKEN", "s3cret")
	out, stderr, code := run(t, "config", "serve", "--tp", "2", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{`"name": "tp"`, `"value": "2"`, `"name": "no-prefix-cache"`, `"name": "stall-after"`, `"value": "***"`} {
		if !strings.Contains(out, want) {
			t.Errorf("config serve --json lacks %s:\n%s", want, out)
		}
	}
	if strings.Contains(out, "s3cret") {
		t.Error("config printed the admin token")
	}
	out, _, code = run(t, "config", "generate")
	if code != 0 || !regexp.MustCompile(`(?m)^max-tokens\s+128\s+default`).MatchString(out) {
		t.Errorf("config generate: exit %d\n%s", code, out)
	}
	if _, stderr, code := run(t, "config", "nope"); code != 2 || !strings.Contains(stderr, `unknown command "nope"`) {
		t.Errorf("config nope: exit %d, %q", code, stderr)
	}
	if _, _, code := run(t, "config", "serve", "--tp", "x"); code != 2 {
		t.Errorf("config serve --tp x: exit %d", code)
	}
}
