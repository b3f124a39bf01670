package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/abtest"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// abConfig is the servers of the indexk ab tests: the tiny llama-dsa
// model (indexer top-k 8), 64 device pages of 4 tokens per rank, a host
// tier of 4 times that, on at start and paced to 1GB/s, index-K fp8.
var abConfig = serve.Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, IndexK: kernels.IndexFP8,
	HiCache: serve.HiCacheConfig{Enabled: true, Ratio: 4, LoadBandwidth: 1e9},
	PD:      serve.PDConfig{BootstrapTimeout: time.Minute, TransferTimeout: time.Minute},
	Logger:  slog.New(slog.DiscardHandler)}

// abArgs is the shortened workload: 8 sessions, 48 requests per cell, 4
// greedy tokens each.
var abArgs = []string{"indexk", "ab", "--sessions", "8", "--requests", "48", "--turns", "4", "--max-tokens", "4", "--request-timeout", "2m", "--drain", "10s"}

func newABCluster(t *testing.T, cfg serve.Config) *cluster {
	t.Helper()
	return newABClusterOf(t, model.ArchLlamaDSA, cfg)
}

// newABClusterOf is newABCluster over the tiny built-in model of arch.
func newABClusterOf(t *testing.T, arch string, cfg serve.Config) *cluster {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: arch, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	cc := clustertest.New(t, clustertest.Options{Model: m, Config: cfg,
		Router: router.Options{HealthInterval: 20 * time.Millisecond}, HealthyWithin: 10 * time.Second})
	return &cluster{m: m, prefill: nodeOf(cc.Prefill), decode: nodeOf(cc.Decode), registry: cc.Registry, router: cc.Router.URL}
}

// abPdctl runs pdctl against c as c.pdctl does, with "indexk ab" in the
// command tree even where the indexk command does not add it yet.
func (c *cluster) abPdctl(t *testing.T, tty bool, args ...string) (exitCode, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	f := &factory{In: strings.NewReader(""), Out: &out, ErrOut: &errOut, Build: testBuild,
		OutTTY: tty, maskVolatile: true,
		Getenv: func(k string) string {
			if k == "PDCTL_ROUTER" {
				return c.router
			}
			return ""
		}}
	root := newCmdRoot(f)
	root.SetArgs(args)
	code := exitCodeFor(root.ExecuteContext(t.Context()), f.ErrOut)
	return code, c.names(out.String()), c.names(errOut.String())
}

// serverState reads what indexk ab must restore on n.
func serverState(t *testing.T, n *node) string {
	t.Helper()
	c := client.New(n.ts.URL, "", nil)
	st, err := c.Settings(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.HiCache(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("index_k %s, hicache %s, bandwidth %d, faults %v", st.IndexK, onOff(h.On), st.HiCache.LoadBandwidthBytesPerSecond, st.FaultsOn)
}

// TestIndexKAB runs the whole matrix against a live PD cluster with every
// fault off: every cell of fp8 and bf16 × HiCache on and off compares 48
// outputs and finds none corrupt, the HiCache-on cells loaded prefixes back
// from host, the exit status is 0, and the servers end as they were found
// (index-K fp8, HiCache on at the prefill, paced to 1GB/s), though the run
// switched all three. The human output and the JSON are exact, volatile values masked.
func TestIndexKAB(t *testing.T) {
	c := newABCluster(t, abConfig)
	before := []string{serverState(t, c.prefill), serverState(t, c.decode)}
	// The decode keeps no host tier: its pacing stays as set, its tier off.
	if want := []string{"index_k fp8, hicache on, bandwidth 1000000000, faults []", "index_k fp8, hicache off, bandwidth 1000000000, faults []"}; !slices.Equal(before, want) {
		t.Fatalf("the servers start as %q, want %q", before, want)
	}

	start := time.Now()
	code, stdout, stderr := c.abPdctl(t, false, append(abArgs, "--load-bandwidth", "64MiB/s")...)
	t.Logf("indexk ab took %v:\n%s%s", time.Since(start), stdout, stderr)
	const row = "\t48\t0\t0.0%\t0\t0\t*\t*\t*\t*\t*\t*\t*\n"
	wantOut := "fp8\ton" + row + "fp8\toff" + row + "bf16\ton" + row + "bf16\toff" + row
	wantErr := "indexk ab: 8 sessions, 48 requests per cell (11 conversations of up to 6 turns), prompts of 34 to 118 tokens (mean 64) over a 28-token shared prefix, 16 tokens more each turn, 4 greedy tokens each\n" +
		"indexk ab: a device KV pool of 256 tokens per rank and a host tier of 1024; the sessions' histories (about 348 tokens) do not fit the device pool: they spill to the host tier and come back\n" +
		"indexk ab: no fault switch on, loads back from host paced to 64MiB/s per rank\n" +
		"fp8: 48 references in *\n" +
		"fp8 with hicache on: 0 of 48 outputs corrupt, 0 timeouts, 0 errors, * host hits loading * tokens, *\n" +
		"fp8 with hicache off: 0 of 48 outputs corrupt, 0 timeouts, 0 errors, * host hits loading * tokens, *\n" +
		"PREFILL (prefill): index-K fp8 → bf16, admission paused *\n" +
		"DECODE (decode): index-K fp8 → bf16, admission paused *\n" +
		"bf16: 48 references in *\n" +
		"bf16 with hicache on: 0 of 48 outputs corrupt, 0 timeouts, 0 errors, * host hits loading * tokens, *\n" +
		"bf16 with hicache off: 0 of 48 outputs corrupt, 0 timeouts, 0 errors, * host hits loading * tokens, *\n" +
		"PREFILL (prefill): index-K bf16 → fp8, admission paused *\n" +
		"DECODE (decode): index-K bf16 → fp8, admission paused *\n" +
		"indexk ab: restored the settings found on 2 servers\n" +
		"indexk ab: no corrupt output in 4 cells (192 outputs compared with their references)\n"
	if code != exitOK || stdout != wantOut || stderr != wantErr {
		t.Errorf("exit %d, want 0\nstdout:\n%s\nwant:\n%s\nstderr:\n%s\nwant:\n%s", code, stdout, wantOut, stderr, wantErr)
	}
	after := []string{serverState(t, c.prefill), serverState(t, c.decode)}
	if !slices.Equal(after, before) {
		t.Errorf("the servers end as %q, want them restored to %q", after, before)
	}

	// The same as JSON, HiCache on only, the servers' own pacing.
	code, stdout, stderr = c.abPdctl(t, false, append(abArgs, "--hicache", "on", "--json")...)
	if code != exitOK {
		t.Fatalf("--json: exit %d\n%s%s", code, stdout, stderr)
	}
	var rep abReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("--json: %v\n%s", err, stdout)
	}
	for _, cell := range rep.Cells {
		if cell.HostHits == 0 || cell.HitTokens == 0 {
			t.Errorf("%s with hicache %s: %d host hits loading %d tokens: nothing came back from host", cell.IndexK, cell.HiCache, cell.HostHits, cell.HitTokens)
		}
		if cell.TTFTMS.P50 <= 0 || cell.TTFTMS.P50 > cell.TTFTMS.P99 || cell.ITLMS.P99 <= 0 || cell.ITLMS.P50 > cell.ITLMS.P99 {
			t.Errorf("%s with hicache %s: TTFT %+v, ITL %+v", cell.IndexK, cell.HiCache, cell.TTFTMS, cell.ITLMS)
		}
	}
	got := maskJSON(stdout, "p50", "p99", "host_hits", "hit_tokens", "seconds")
	if got != abWantJSON {
		t.Errorf("--json:\n%s\nwant:\n%s", got, abWantJSON)
	}
	if after := []string{serverState(t, c.prefill), serverState(t, c.decode)}; !slices.Equal(after, before) {
		t.Errorf("after --json the servers are %q, want %q", after, before)
	}
}

const abWantJSON = `{
  "router": "ROUTER",
  "workload": {
    "source": "built-in",
    "sessions": 8,
    "requests": 48,
    "conversations": 11,
    "max_turns": 6,
    "max_tokens": 4,
    "prompt_tokens_min": 34,
    "prompt_tokens_max": 118,
    "prompt_tokens_mean": 64,
    "system_tokens": 28,
    "per_turn_tokens": 16,
    "working_set_tokens": 348,
    "device_tokens": 256,
    "host_tokens": 1024
  },
  "load_bandwidth_bytes_per_second": null,
  "servers": [
    {
      "url": "PREFILL",
      "role": "prefill",
      "index_k": "fp8",
      "hicache": "on",
      "load_bandwidth_bytes_per_second": 1000000000,
      "faults_on": []
    },
    {
      "url": "DECODE",
      "role": "decode",
      "index_k": "fp8",
      "hicache": "",
      "load_bandwidth_bytes_per_second": 0,
      "faults_on": []
    }
  ],
  "references": [
    {
      "index_k": "fp8",
      "requests": 48,
      "seconds": 0
    },
    {
      "index_k": "bf16",
      "requests": 48,
      "seconds": 0
    }
  ],
  "cells": [
    {
      "index_k": "fp8",
      "hicache": "on",
      "requests": 48,
      "compared": 48,
      "corrupt": 0,
      "corrupt_share": 0,
      "timeouts": 0,
      "errors": 0,
      "ttft_ms": {
        "p50": 0,
        "p99": 0
      },
      "itl_ms": {
        "p50": 0,
        "p99": 0
      },
      "host_hits": 0,
      "hit_tokens": 0,
      "seconds": 0
    },
    {
      "index_k": "bf16",
      "hicache": "on",
      "requests": 48,
      "compared": 48,
      "corrupt": 0,
      "corrupt_share": 0,
      "timeouts": 0,
      "errors": 0,
      "ttft_ms": {
        "p50": 0,
        "p99": 0
      },
      "itl_ms": {
        "p50": 0,
        "p99": 0
      },
      "host_hits": 0,
      "hit_tokens": 0,
      "seconds": 0
    }
  ],
  "corrupt_cells": 0,
  "restored": true
}
`

// TestIndexKABDeepSeekShaped: the matrix runs on the DeepSeek-shaped
// model (latent attention, a bf16 latent row per token beside its index
// keys) as on llama-dsa: with every fault off no output is corrupt in any
// of the four cells, the HiCache-on cells load prefixes back from host,
// and the exit status is 0.
func TestIndexKABDeepSeekShaped(t *testing.T) {
	cfg := abConfig
	cfg.KVType = kernels.BF16
	c := newABClusterOf(t, model.ArchDeepSeek2DSA, cfg)
	code, stdout, stderr := c.abPdctl(t, false, append(abArgs, "--load-bandwidth", "64MiB/s", "--json")...)
	var rep abReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("exit %d: %v\nstdout:\n%s\nstderr:\n%s", code, err, stdout, stderr)
	}
	if code != exitOK || len(rep.Cells) != 4 {
		t.Fatalf("exit %d with %d cells, want 0 and 4\n%s", code, len(rep.Cells), stderr)
	}
	for _, cell := range rep.Cells {
		if cell.Corrupt != 0 || cell.Compared != 48 || cell.Timeouts != 0 || cell.Errors != 0 {
			t.Errorf("%s with hicache %s: %d of %d corrupt, %d timeouts, %d errors", cell.IndexK, cell.HiCache, cell.Corrupt, cell.Compared, cell.Timeouts, cell.Errors)
		}
		if cell.HiCache == "on" && cell.HostHits == 0 {
			t.Errorf("%s with hicache on: no host hit", cell.IndexK)
		}
	}
}

// TestIndexKABCannotRun: what indexk ab refuses before it switches
// anything (exit 2), and its flags.
func TestIndexKABCannotRun(t *testing.T) {
	c := newABCluster(t, abConfig)
	plainModel := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	plain := nodeOf(clustertest.NewNode(t, plainModel, serve.Config{PageSize: 4, KVTokens: 128, MaxRunning: 4}, server.Options{}, nil))
	noCache := newNode(t, c.m, serve.Config{PageSize: 4, KVTokens: 128, MaxRunning: 4, DisablePrefixCache: true}, server.Options{})
	tests := []struct {
		name   string
		args   []string
		code   exitCode
		stderr string
	}{
		{
			name:   "an unreachable router",
			args:   []string{"--router", "http://127.0.0.1:1", "indexk", "ab"},
			code:   exitNoRun,
			stderr: "pdctl: cannot run: discovering the cluster behind http://127.0.0.1:1: GET http://127.0.0.1:1/debug/v1/cluster: dial tcp 127.0.0.1:1: connect: connection refused\n",
		},
		{
			name:   "an unreachable server",
			args:   []string{"--server", c.prefill.ts.URL, "--server", "http://127.0.0.1:1", "indexk", "ab"},
			code:   exitNoRun,
			stderr: "pdctl: cannot run: http://127.0.0.1:1: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\n",
		},
		{
			name:   "no sparse indexer",
			args:   []string{"--server", plain.ts.URL, "indexk", "ab"},
			code:   exitNoRun,
			stderr: "pdctl: cannot run: the servers' model has no sparse indexer: it stores no index keys, so there is no index-K precision to A/B\n",
		},
		{
			name:   "no prefix cache, hicache on asked",
			args:   []string{"--server", noCache.ts.URL, "indexk", "ab"},
			code:   exitNoRun,
			stderr: "pdctl: cannot run: no server has a prefix cache, so none has a host tier to switch on (run with --hicache off)\n",
		},
		{
			name:   "a prompts file that is not there",
			args:   []string{"indexk", "ab", "--prompts", "/nonexistent/prompts.jsonl"},
			code:   exitNoRun,
			stderr: "pdctl: cannot run: open /nonexistent/prompts.jsonl: no such file or directory\n",
		},
		{
			name:   "an unknown precision",
			args:   []string{"indexk", "ab", "--precisions", "fp8,fp16"},
			code:   exitUsage,
			stderr: "pdctl: --precisions: unknown value \"fp16\" (want [fp8 bf16])\nRun 'pdctl indexk ab --help' for usage.\n",
		},
		{
			name:   "a state twice",
			args:   []string{"indexk", "ab", "--hicache", "on,on"},
			code:   exitUsage,
			stderr: "pdctl: --hicache: \"on\" twice\nRun 'pdctl indexk ab --help' for usage.\n",
		},
		{
			name:   "no sessions",
			args:   []string{"indexk", "ab", "--sessions", "0"},
			code:   exitUsage,
			stderr: "pdctl: --sessions 0: want at least 1\nRun 'pdctl indexk ab --help' for usage.\n",
		},
		{
			name:   "a bad pacing",
			args:   []string{"indexk", "ab", "--load-bandwidth", "fast"},
			code:   exitUsage,
			stderr: "pdctl: invalid argument \"fast\" for \"--load-bandwidth\" flag: \"fast\" is not a rate: want bytes per second, e.g. 2GB/s, 500MiB/s or 0\nRun 'pdctl indexk ab --help' for usage.\n",
		},
	}
	for _, tc := range tests {
		code, stdout, stderr := c.abPdctl(t, false, tc.args...)
		stderr = strings.NewReplacer(plain.ts.URL, "PLAIN", noCache.ts.URL, "NOCACHE").Replace(stderr)
		if code != tc.code || stdout != "" || stderr != tc.stderr {
			t.Errorf("%s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s\nwant:\n%s", tc.name, code, tc.code, stdout, stderr, tc.stderr)
		}
	}
}

// The flags become the options.
func TestIndexKABOptions(t *testing.T) {
	var got *indexkABOptions
	var out, errOut bytes.Buffer
	f := &factory{In: strings.NewReader(""), Out: &out, ErrOut: &errOut, Build: testBuild}
	cmd := newCmdIndexKAB(f, func(_ context.Context, o *indexkABOptions) error { got = o; return nil })
	cmd.SetArgs([]string{"--sessions", "20", "--requests", "240", "--precisions", "bf16", "--hicache", "on", "--load-bandwidth", "16MiB/s", "--prompts", "p.jsonl", "--json"})
	if err := cmd.ExecuteContext(t.Context()); err != nil {
		t.Fatal(err)
	}
	want := indexkABOptions{Sessions: 20, Requests: 240, Turns: 6, MaxTokens: 8, Precisions: []string{"bf16"}, HiCache: []string{"on"},
		LoadBandwidth: 16 << 20, SetBandwidth: true, Prompts: "p.jsonl", Seed: 1, RequestTimeout: abtest.DefaultTimeout,
		Drain: debug.IndexKDefaultDrain, JSON: true}
	got.f, got.Attach = nil, nil
	if !reflect.DeepEqual(*got, want) {
		t.Errorf("options %+v\nwant %+v", *got, want)
	}
}
