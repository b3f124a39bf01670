package config

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

func flags() *pflag.FlagSet {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	fs.Int("max-tokens", 128, "most tokens")
	fs.String("index-k", "fp8", "index-K precision")
	fs.Int("threads", 0, "threads")
	fs.Bool("help", false, "help")
	return fs
}

func TestPrecedenceFlagEnvDefault(t *testing.T) {
	fs := flags()
	if err := fs.Parse([]string{"--threads", "2"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"PD_THREADS": "7", "PD_INDEX_K": "bf16"}
	if err := ApplyEnv(fs, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	got := map[string]Entry{}
	for _, e := range Effective(fs) {
		got[e.Name] = e
	}
	want := map[string][2]string{
		"threads":    {"2", "flag"},
		"index-k":    {"bf16", "env"},
		"max-tokens": {"128", "default"},
	}
	for name, w := range want {
		if e := got[name]; e.Value != w[0] || e.Source != w[1] {
			t.Errorf("%s = %q from %s, want %q from %s", name, e.Value, e.Source, w[0], w[1])
		}
	}
	if _, ok := got["help"]; ok {
		t.Error("help listed as a setting")
	}
	if got["index-k"].Env != "PD_INDEX_K" {
		t.Errorf("env name %q", got["index-k"].Env)
	}
}

func TestBadEnvValueNamesTheVariable(t *testing.T) {
	fs := flags()
	_ = fs.Parse(nil)
	err := ApplyEnv(fs, func(k string) string {
		if k == "PD_MAX_TOKENS" {
			return "lots"
		}
		return ""
	})
	if err == nil || !strings.Contains(err.Error(), `PD_MAX_TOKENS="lots"`) {
		t.Fatalf("err = %v", err)
	}
}

func TestAnnotateAndPrint(t *testing.T) {
	fs := flags()
	AnnotateUsage(fs)
	AnnotateUsage(fs) // idempotent
	if u := fs.Lookup("max-tokens").Usage; u != "most tokens [$PD_MAX_TOKENS]" {
		t.Fatalf("usage %q", u)
	}
	var buf bytes.Buffer
	if err := Print(&buf, Effective(fs)); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	if !strings.Contains(out, "max-tokens  128    default  PD_MAX_TOKENS  most tokens") {
		t.Fatalf("table:\n%s", out)
	}
}
