package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
)

// benchQuick are bench flags that keep a run on the tiny model short.
var benchQuick = []string{"--threads", "1", "--prompt", "32", "--decode", "4", "--batch", "2", "--repeats", "1", "--dram-buffer", "4"}

func TestBenchModelFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tiny.gguf")
	if _, stderr, code := run(t, "model", "init", "--arch", "llama", "--size", "tiny", "-o", path); code != 0 {
		t.Fatalf("model init: exit %d: %s", code, stderr)
	}
	t.Setenv("PDKIT_HOME", t.TempDir())
	out, stderr, code := run(t, append([]string{"bench", "--model", path}, benchQuick...)...)
	if code != 0 {
		t.Fatalf("bench --model: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"llama model tiny.gguf (dim 64, 2 layers, vocab 512)", "after a 16-token prompt (depth 16)", "F32: ", path} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "Q8_0") {
		t.Errorf("an F32 file reported Q8_0 rows:\n%s", out)
	}
}

func TestBenchDepth(t *testing.T) {
	t.Setenv("PDKIT_HOME", t.TempDir())
	args := append([]string{"bench", "--size", "tiny", "--types", "q8_0", "--depth", "300"}, benchQuick...)
	out, stderr, code := run(t, args...)
	if code != 0 {
		t.Fatalf("bench --depth: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"built-in llama tiny model", "decode: 4 tokens after a 300-token prompt (depth 300)", "Q8_0"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestBenchUsageErrors(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tiny.gguf")
	if _, stderr, code := run(t, "model", "init", "--arch", "llama", "--size", "tiny", "-o", path); code != 0 {
		t.Fatalf("model init: exit %d: %s", code, stderr)
	}
	t.Setenv("PDKIT_HOME", dir)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--size", "huge"}, "tiny, small or medium"},
		{[]string{"--depth", "0"}, "--depth"},
		{[]string{"--size", "tiny", "--prompt", "32", "--depth", "500", "--decode", "12"}, "--depth 500 plus --decode 12"},
		{[]string{"--size", "tiny"}, "--prompt 512"},
		{[]string{"--model", path, "--size", "small"}, "drop --size"},
		{[]string{"--model", path, "--types", "q8_0"}, "drop --types"},
		{[]string{"--model", path, "--arch", "llama"}, "drop --arch"},
		{[]string{"--model", path, "--prompt", "32", "--depth", "600"}, "context length 512"},
		{[]string{"--dram-buffer", "0"}, "--dram-buffer"},
	}
	for _, c := range cases {
		_, stderr, code := run(t, append([]string{"bench"}, c.args...)...)
		if code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("bench %v: exit %d, stderr %q: want exit 2 naming %q", c.args, code, stderr, c.want)
		}
	}
	_, stderr, code := run(t, "bench", "--model", filepath.Join(dir, "missing.gguf"))
	if code != 1 || !strings.Contains(stderr, "no such file") {
		t.Errorf("missing --model file: exit %d, stderr %q: want exit 1", code, stderr)
	}
}

// TestReadmeNamesEverySize keeps README's Models section in step with the
// built-in sizes: model init's usage line and the table name each one.
func TestReadmeNamesEverySize(t *testing.T) {
	data, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(data)
	usage := "--size " + strings.Join(builtin.Sizes, "|")
	if line := "pdserve model init --arch " + strings.Join(model.Archs, "|") + " " + usage; !strings.Contains(readme, line) {
		t.Errorf("README's model init line is not %q", line)
	}
	for _, size := range builtin.Sizes {
		if !strings.Contains(readme, "| `"+size+"` |") {
			t.Errorf("README's size table lacks %s", size)
		}
	}
	for _, flag := range []string{"bench --model", "--depth N", "--size medium --repeats 1"} {
		if !strings.Contains(readme, flag) {
			t.Errorf("README lacks %q", flag)
		}
	}
}
