package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/internal/gpu"
	"github.com/pdkit/pdkit/internal/gpu/gputest"
)

func TestStatus(t *testing.T) {
	c := newCluster(t)
	tests := []struct {
		name   string
		args   []string
		code   exitCode
		stdout string
		stderr string
	}{
		{
			name: "discovered through the router",
			args: []string{"status"},
			stdout: "ROUTER\trouter\t-\t-\t-\thealthy\tready\t-\t-\t-\t-\t-\t-\n" +
				"PREFILL\tprefill\t2\ttiny\tfp8\thealthy\tready\t0\t0\t0\t0\t0\tnone\n" +
				"DECODE\tdecode\t2\ttiny\tfp8\thealthy\tready\t0\t0\t0\t0\t0\tnone\n" +
				"\n" +
				"PREFILL\t0\t*\tidle\t*\tbootstrap=0 active=0 inflight=0\t0/0/32\toff\n" +
				"PREFILL\t1\t*\tidle\t*\tbootstrap=0 active=0 inflight=0\t0/0/32\toff\n" +
				"DECODE\t0\t*\tidle\t*\tprealloc=0 transfer=0 aborting=0\t0/0/32\toff\n" +
				"DECODE\t1\t*\tidle\t*\tprealloc=0 transfer=0 aborting=0\t0/0/32\toff\n",
		},
		{
			name: "an unreachable server among the others",
			args: []string{"--server", c.decode.ts.URL, "--server", "http://127.0.0.1:1", "status"},
			code: exitFindings,
			stdout: "DECODE\tdecode\t2\ttiny\tfp8\thealthy\tready\t0\t0\t0\t0\t0\tnone\n" +
				"http://127.0.0.1:1\t-\t-\t-\t-\tunreachable: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\t-\t-\t-\t-\t-\t-\t-\n" +
				"\n" +
				"DECODE\t0\t*\tidle\t*\tprealloc=0 transfer=0 aborting=0\t0/0/32\toff\n" +
				"DECODE\t1\t*\tidle\t*\tprealloc=0 transfer=0 aborting=0\t0/0/32\toff\n",
			stderr: "pdctl: 1 server of 2 unreachable\n",
		},
		{
			name:   "an unreachable router",
			args:   []string{"--router", "http://127.0.0.1:1", "status"},
			code:   exitError,
			stderr: "pdctl: discovering the cluster behind http://127.0.0.1:1: GET http://127.0.0.1:1/debug/v1/cluster: dial tcp 127.0.0.1:1: connect: connection refused\n",
		},
		{
			name:   "arguments",
			args:   []string{"status", "now"},
			code:   exitUsage,
			stderr: "pdctl: status takes no arguments, got [\"now\"]\nRun 'pdctl status --help' for usage.\n",
		},
		{
			name: "json",
			args: []string{"--server", c.prefill.ts.URL, "status", "--json"},
			stdout: `{
  "servers": [
    {
      "url": "PREFILL",
      "role": "prefill",
      "tp_size": 2,
      "model": "tiny",
      "healthy": true,
      "ready": true,
      "requests": {
        "aborting": 0,
        "pending": 0,
        "prefilling": 0,
        "running": 0,
        "waiting": 0
      },
      "ranks": [
        {
          "rank": 0,
          "step": 0,
          "phase": "idle",
          "step_age_ms": 0,
          "pd": {
            "active": 0,
            "bootstrap": 0,
            "inflight": 0
          },
          "kv": {
            "rank": 0,
            "used": 0,
            "cached": 0,
            "total": 32
          },
          "hicache": {
            "on": false,
            "host_tokens_used": 0,
            "host_tokens": 0
          }
        },
        {
          "rank": 1,
          "step": 0,
          "phase": "idle",
          "step_age_ms": 0,
          "pd": {
            "active": 0,
            "bootstrap": 0,
            "inflight": 0
          },
          "kv": {
            "rank": 1,
            "used": 0,
            "cached": 0,
            "total": 32
          },
          "hicache": {
            "on": false,
            "host_tokens_used": 0,
            "host_tokens": 0
          }
        }
      ],
      "gpu": {
        "available": false,
        "reason": "no GPU: telemetry is not enabled on this server",
        "devices": []
      },
      "index_k": "fp8"
    }
  ]
}
`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := c.pdctl(t, false, tt.args...)
			stdout = maskJSON(stdout, "step", "step_age_ms")
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

// TestStatusTerminal checks the aligned tables of a terminal, on fixed
// data (live servers' URLs and ages would move the columns).
func TestStatusTerminal(t *testing.T) {
	// Every health check passes while the router's requests all fail: its
	// READY cell says so.
	out := statusOutput{RouterStatus: &serverStatus{URL: "http://r:8000", Role: "router", Healthy: true, Ready: ptr(false),
		ReadyReason: "6 of the last 6 requests (within 1m0s) failed, above the limit of 50%"}, Servers: []serverStatus{
		{URL: "http://p:1", Role: "prefill", TPSize: 2, Model: "tiny", Healthy: true, Ready: ptr(true), IndexK: "fp8", IndexKSwitch: "bf16",
			Requests: map[string]int{"waiting": 3, "running": 1},
			GPU: &debug.GPUResponse{Available: true, Devices: []debug.GPU{
				{Name: "NVIDIA H200", MemoryUsedBytes: 40 << 30, MemoryTotalBytes: 141 << 30, UtilizationPercent: ptr(uint32(60))},
				{Name: "NVIDIA H200", MemoryUsedBytes: 38 << 30, MemoryTotalBytes: 141 << 30, UtilizationPercent: ptr(uint32(50))}}},
			Ranks: []rankStatus{
				{Rank: 0, Step: 812, Phase: "decode", StepAgeMS: 4.2, PD: map[string]int{"bootstrap": 2}, KV: kvPages(0, 10, 4, 32),
					HiCache: &rankHiCache{On: true, TokensUsed: 1216, Tokens: 8192}},
				{Rank: 1, Step: 812, Phase: "decode", StepAgeMS: 1520, PD: map[string]int{"active": 1}, KV: kvPages(1, 10, 4, 32),
					HiCache: &rankHiCache{On: true, TokensUsed: 960, Tokens: 8192}},
			}},
		{URL: "http://decode-1:8001", Role: "decode", TPSize: 1, Model: "tiny", IndexK: "fp8", Reason: "engine loop has not iterated for 6s (limit 5s)",
			Requests: map[string]int{"pending": 7}, GPU: &debug.GPUResponse{Reason: "no GPU"},
			Ranks: []rankStatus{{Rank: 0, Step: 90, Phase: "idle", StepAgeMS: 6000, PD: map[string]int{"transfer": 5}, KV: kvPages(0, 20, 0, 32),
				HiCache: &rankHiCache{}}}},
		{URL: "http://decode-2:8001", Role: "decode", Error: "connection refused"},
	}}
	var buf bytes.Buffer
	f := &factory{Out: &buf, OutTTY: true}
	if err := printTables(f, statusTables(out)...); err != nil {
		t.Fatal(err)
	}
	want := `SERVER                ROLE     TP  MODEL  INDEX-K                  HEALTH                                                     READY                                                                             WAITING  PREFILLING  RUNNING  ABORTING  PENDING  GPU
http://r:8000         router   -   -      -                        healthy                                                    not ready: 6 of the last 6 requests (within 1m0s) failed, above the limit of 50%  -        -           -        -         -        -
http://p:1            prefill  2   tiny   fp8 (switching to bf16)  healthy                                                    ready                                                                             3        0           1        0         0        2× NVIDIA H200 55% busy 78/282 GiB
http://decode-1:8001  decode   1   tiny   fp8                      unhealthy: engine loop has not iterated for 6s (limit 5s)  -                                                                                 0        0           0        0         7        none
http://decode-2:8001  decode   -   -      -                        unreachable: connection refused                            -                                                                                 -        -           -        -         -        -

SERVER                RANK  STEP  PHASE   AGE   PD QUEUES                         KV USED/CACHED/TOTAL  HICACHE TOKENS
http://p:1            0     812   decode  4ms   bootstrap=2 active=0 inflight=0   6/4/32                on 1.2k/8.2k
http://p:1            1     812   decode  1.5s  bootstrap=0 active=1 inflight=0   6/4/32                on 960/8.2k
http://decode-1:8001  0     90    idle    6s    prealloc=0 transfer=5 aborting=0  20/0/32               off
`
	if got := buf.String(); got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}
}

func kvPages(rank, used, cached, total int) debug.KVPages {
	return debug.KVPages{Rank: rank, Used: used, Cached: cached, Total: total}
}

// TestGPUCell sums up a simulated 8 × H200 server's GPUs, and none.
func TestGPUCell(t *testing.T) {
	tel := gputest.H200()
	defer tel.Close()
	r := tel.Read()
	if got, want := gpuCell(&r), "8× NVIDIA H200 141GB HBM3e 35% busy 0/1128 GiB"; got != want {
		t.Errorf("gpuCell = %q, want %q", got, want)
	}
	off := gpu.Off("no GPU").Read()
	if got := gpuCell(&off); got != "none" {
		t.Errorf("without a GPU: %q", got)
	}
	if got := gpuCell(nil); got != "" {
		t.Errorf("not known: %q", got)
	}
}

// TestHiCacheCell: a rank's host tier in one cell, counts made short.
func TestHiCacheCell(t *testing.T) {
	for _, c := range []struct {
		h    *rankHiCache
		want string
	}{
		{nil, ""}, {&rankHiCache{Tokens: 100}, "off"}, {&rankHiCache{On: true}, "on 0/0"},
		{&rankHiCache{On: true, TokensUsed: 1200, Tokens: 8000}, "on 1.2k/8k"},
		{&rankHiCache{On: true, TokensUsed: 999, Tokens: 999_949}, "on 999/999.9k"},
		{&rankHiCache{On: true, TokensUsed: 999_950, Tokens: 3_400_000_000}, "on 1M/3.4G"},
	} {
		if got := hicacheCell(c.h); got != c.want {
			t.Errorf("hicacheCell(%+v) = %q, want %q", c.h, got, c.want)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// A router whose health checks pass while its requests fail answers
// /readyz 503 with the reason; status reads it as not ready, and a process
// without /readyz as not saying.
func TestReadRouterReadiness(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte(`{"status":"ok"}`)) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		w.Write([]byte(`{"status":"not_ready","reason":"6 of the last 6 requests failed"}`))
	})
	ts := httptest.NewServer(mux)
	defer ts.Close()
	s := readRouter(context.Background(), ts.URL, client.New(ts.URL, "", nil))
	if !s.Healthy || s.Ready == nil || *s.Ready || s.ReadyReason != "6 of the last 6 requests failed" {
		t.Errorf("router failing its requests: %+v", s)
	}
	if cell := readyCell(*s); cell != "not ready: 6 of the last 6 requests failed" {
		t.Errorf("READY cell %q", cell)
	}
	old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
		}
	}))
	defer old.Close()
	if s := readRouter(context.Background(), old.URL, client.New(old.URL, "", nil)); s.Ready != nil || readyCell(*s) != "" {
		t.Errorf("a router without /readyz: %+v", s)
	}
}
