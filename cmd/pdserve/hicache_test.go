package main

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/config"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// The --hicache flags are refused, with the reason, when they cannot work:
// the tier without the prefix cache (by flag or PD_* variable), a ratio
// that is not positive, an unknown write policy, a size or rate that does
// not parse, a pool beyond the memory available; on every engine role.
func TestHiCacheFlagsRefused(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	for _, role := range []string{"serve", "prefill", "decode"} {
		for _, c := range []struct {
			args []string
			msg  string
		}{
			{[]string{"--hicache", "--no-prefix-cache"}, "--hicache needs the prefix cache, which --no-prefix-cache turns off"},
			{[]string{"--hicache-ratio", "0"}, "--hicache-ratio 0: want a positive multiple"},
			{[]string{"--hicache-ratio", "-1"}, "--hicache-ratio -1"},
			{[]string{"--hicache-ratio", "NaN"}, "--hicache-ratio NaN"},
			{[]string{"--hicache-write-policy", "lazy"}, `--hicache-write-policy "lazy": want write-through, write-through-selective or write-back`},
			{[]string{"--hicache-size", "big"}, `"big" is not a size`},
			{[]string{"--hicache-size", "-1GiB"}, `is not a size`},
			{[]string{"--hicache-load-bandwidth", "fast"}, `"fast" is not a rate`},
		} {
			args := append([]string{role, "--model", path, "--port", "0"}, c.args...)
			if _, stderr, code := run(t, args...); code != 2 || !strings.Contains(stderr, c.msg) {
				t.Errorf("%v: exit %d, %q; want 2 and %q", args, code, stderr, c.msg)
			}
		}
	}
	// A decode server keeps no host tier.
	if _, stderr, code := run(t, "decode", "--model", path, "--port", "0", "--hicache"); code != 2 || !strings.Contains(stderr, "a decode server keeps no host tier") {
		t.Errorf("decode --hicache: exit %d, %q", code, stderr)
	}
	// The HiCache fault applies to colocated and prefill servers, not to
	// decode ones; serve takes --fault like the PD roles.
	for _, args := range [][]string{{"decode", "--fault", serve.FaultHiCacheIndexKUngated}, {"serve", "--fault", serve.FaultBootstrapAbortCrash}} {
		if _, stderr, code := run(t, append(args, "--model", path, "--port", "0", "--threads", "1")...); code != 2 || !strings.Contains(stderr, args[2]) {
			t.Errorf("%v: exit %d, %q", args, code, stderr)
		}
	}
	// More than the machine has: refused at start, naming the flags.
	if _, stderr, code := run(t, "serve", "--model", path, "--port", "0", "--threads", "1", "--hicache", "--hicache-size", "1000TiB"); code != 2 ||
		!strings.Contains(stderr, "host pool exceeds available memory") || !strings.Contains(stderr, "lower --hicache-size or --hicache-ratio") {
		t.Errorf("--hicache-size 1000TiB: exit %d, %q", code, stderr)
	}
	t.Setenv("PD_HICACHE", "true")
	t.Setenv("PD_NO_PREFIX_CACHE", "1")
	if _, stderr, code := run(t, "serve", "--model", path); code != 2 || !strings.Contains(stderr, "--hicache needs the prefix cache") {
		t.Errorf("PD_HICACHE with PD_NO_PREFIX_CACHE: exit %d, %q", code, stderr)
	}
	t.Setenv("PD_NO_PREFIX_CACHE", "")
	t.Setenv("PD_HICACHE_SIZE", "lots")
	if _, stderr, code := run(t, "serve", "--model", path); code != 2 || !strings.Contains(stderr, `PD_HICACHE_SIZE="lots"`) {
		t.Errorf("PD_HICACHE_SIZE=lots: exit %d, %q", code, stderr)
	}
}

// pdserve config shows the --hicache flags of every engine role and of
// launch, with their defaults, values in their units and sources.
func TestConfigHiCache(t *testing.T) {
	t.Setenv("PD_HICACHE_LOAD_BANDWIDTH", "2GB/s")
	for _, role := range []string{"serve", "prefill", "decode", "launch"} {
		out, stderr, code := run(t, "config", role, "--hicache-size", "512MiB")
		if code != 0 {
			t.Fatalf("config %s: exit %d: %s", role, code, stderr)
		}
		for _, want := range []string{
			`(?m)^hicache\s+false\s+default\s+PD_HICACHE\s`,
			`(?m)^hicache-size\s+512MiB\s+flag\s+PD_HICACHE_SIZE\s`,
			`(?m)^hicache-ratio\s+2\s+default\s+PD_HICACHE_RATIO\s`,
			`(?m)^hicache-write-policy\s+write-through\s+default\s+PD_HICACHE_WRITE_POLICY\s`,
			`(?m)^hicache-load-bandwidth\s+2GB/s\s+env\s+PD_HICACHE_LOAD_BANDWIDTH\s`,
		} {
			if !regexp.MustCompile(want).MatchString(out) {
				t.Errorf("config %s lacks %s:\n%s", role, want, out)
			}
		}
	}
}

// A server started with the --hicache flags (and the HiCache fault) runs
// with them: its settings publish them, GET /debug/v1/hicache shows the
// tier on with the pool asked for, and the fault is on.
func TestServeHiCache(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	t.Setenv("PD_HICACHE_WRITE_POLICY", "write-back")
	s := startServe(t, "--model", path, "--threads", "1", "--tp", "2", "--page-size", "4", "--shutdown-timeout", "1ms",
		"--hicache", "--hicache-size", "1MiB", "--hicache-load-bandwidth", "1GB/s", "--fault", serve.FaultHiCacheIndexKUngated)
	getJSON := func(path string, v any) {
		t.Helper()
		resp, err := http.Get(s.url + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(v) != nil {
			t.Fatalf("GET %s: %d", path, resp.StatusCode)
		}
	}
	var st debug.Settings
	getJSON(debug.SettingsPath, &st)
	want := debug.HiCacheSettings{EnabledAtStart: true, SizeBytes: 1 << 20, Ratio: 2, WritePolicy: "write-back", LoadBandwidthBytesPerSecond: 1e9}
	if st.HiCache == nil || *st.HiCache != want || !slices.Contains(st.FaultsOn, serve.FaultHiCacheIndexKUngated) {
		t.Errorf("settings: hicache %+v, faults on %v; want %+v", st.HiCache, st.FaultsOn, want)
	}
	var h debug.HiCacheResponse
	getJSON(debug.HiCachePath, &h)
	if !h.On || len(h.Ranks) != 2 {
		t.Fatalf("hicache: %+v", h)
	}
	for _, rk := range h.Ranks {
		if !rk.On || rk.Policy != "write-back" || rk.LoadBandwidthBytesPerSecond != 1e9 || rk.HostPages < 1 || rk.HostTokens != 4*rk.HostPages {
			t.Errorf("rank %d: %+v", rk.Rank, rk)
		}
	}
	if !waitfor.Poll(5*time.Second, func() bool { return strings.Contains(s.errb.String(), "hicache on") }) {
		t.Fatalf("no start-up line for the tier:\n%s", s.errb)
	}
}

// launch hands the --hicache flags set, on its command line or by their
// PD_* variables, to its prefill and decode servers, and refuses what they
// would refuse before starting any.
func TestLaunchHiCache(t *testing.T) {
	cmd := newLaunchCmd()
	fs := cmd.Flags()
	if err := fs.Parse([]string{"--hicache", "--hicache-size", "2GiB"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"PD_HICACHE_LOAD_BANDWIDTH": "500MiB/s"}
	if err := config.ApplyEnv(fs, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	got := hicacheArgs(fs)
	want := []string{"--hicache=true", "--hicache-load-bandwidth=500MiB/s", "--hicache-size=2GiB"}
	if !slices.Equal(got, want) {
		t.Errorf("args %q, want %q", got, want)
	}
	if args := hicacheArgs(newLaunchCmd().Flags()); len(args) != 0 {
		t.Errorf("defaults passed on: %q", args)
	}

	for _, c := range []struct {
		args []string
		msg  string
	}{
		{[]string{"--hicache-ratio", "0"}, "--hicache-ratio 0"},
		{[]string{"--hicache-write-policy", "never"}, "--hicache-write-policy"},
		{[]string{"--hicache-size", "x"}, "not a size"},
	} {
		if _, stderr, code := run(t, append([]string{"launch"}, c.args...)...); code != 2 || !strings.Contains(stderr, c.msg) {
			t.Errorf("launch %v: exit %d, %q", c.args, code, stderr)
		}
	}
	t.Setenv("PD_NO_PREFIX_CACHE", "true")
	if _, stderr, code := run(t, "launch", "--hicache"); code != 2 || !strings.Contains(stderr, "PD_NO_PREFIX_CACHE turns off") {
		t.Errorf("launch --hicache with PD_NO_PREFIX_CACHE: exit %d, %q", code, stderr)
	}
}

// A truncated model file stops the server with what to do about it.
func TestServeTruncatedModel(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cut.gguf")
	if err := builtin.WriteFile(path, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 1, Type: kernels.F32}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, st.Size()/2); err != nil {
		t.Fatal(err)
	}
	_, stderr, code := run(t, "serve", "--model", path, "--port", "0", "--threads", "1")
	if code == 0 || !strings.Contains(stderr, "extends past end of file") || !strings.Contains(stderr, "copy it again") {
		t.Fatalf("exit %d: %s", code, stderr)
	}
}
