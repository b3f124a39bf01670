package server

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/gpu/gputest"
)

// TestDebugGPU: GET /debug/v1/gpu gives the devices NVML reads (a simulated
// 8 × H200 server here) and /metrics their gauges; a server without
// telemetry says "no GPU" and why.
func TestDebugGPU(t *testing.T) {
	get := func(url string) string {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", url, resp.StatusCode, b)
		}
		return string(b)
	}
	tel := gputest.H200()
	defer tel.Close()
	e := newEnvWith(t, serve.Config{PageSize: 4, KVTokens: 64}, Options{GPU: tel})
	var r debug.GPUResponse
	if err := json.Unmarshal([]byte(get(e.ts.URL+debug.GPUPath)), &r); err != nil {
		t.Fatal(err)
	}
	if !r.Available || len(r.Devices) != 8 || !strings.Contains(r.Devices[5].Name, "H200") || r.Devices[5].MemoryTotalBytes == 0 {
		t.Errorf("GET %s: %+v", debug.GPUPath, r)
	}
	if m := get(e.ts.URL + "/metrics"); !strings.Contains(m, "pdkit_gpu_available 1") || !strings.Contains(m, `pdkit_gpu_memory_total_bytes{gpu="7"`) {
		t.Errorf("metrics lack the GPU gauges:\n%s", m)
	}

	off := newEnvWith(t, serve.Config{PageSize: 4, KVTokens: 64}, Options{})
	if body := get(off.ts.URL + debug.GPUPath); body != `{"available":false,"reason":"no GPU: telemetry is not enabled on this server","devices":[]}`+"\n" {
		t.Errorf("without telemetry: %s", body)
	}
}
