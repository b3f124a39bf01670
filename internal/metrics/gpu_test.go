package metrics

import (
	"strings"
	"testing"

	"github.com/pdkit/pdkit/internal/gpu"
	"github.com/pdkit/pdkit/internal/gpu/gputest"
)

// TestGPUCollector: on a simulated 8 × H200 server the scrape has every
// device's memory and, where reported, utilization, temperature and power;
// without NVML only pdkit_gpu_available 0.
func TestGPUCollector(t *testing.T) {
	tel := gputest.H200()
	defer tel.Close()
	m := New(nil)
	if err := m.WatchGPU(tel); err != nil {
		t.Fatal(err)
	}
	v := values(t, m.Registry())
	uuid := tel.Read().Devices[3].UUID
	name := tel.Read().Devices[3].Name
	key := func(metric string) string { return "pdkit_gpu_" + metric + "/3/" + name + "/" + uuid } // labels by name: gpu, name, uuid
	if v["pdkit_gpu_available"] != 1 || v[key("utilization_ratio")] != 0.3 || v[key("memory_utilization_ratio")] != 0.05 ||
		v[key("power_watts")] != 300 || v[key("memory_total_bytes")] < 140<<30 {
		t.Errorf("scrape: %v", v)
	}
	if _, ok := v[key("temperature_celsius")]; ok {
		t.Error("a temperature the device does not report was exported")
	}

	off := New(nil)
	if err := off.WatchGPU(gpu.Off("no GPU: telemetry off")); err != nil {
		t.Fatal(err)
	}
	for k, x := range values(t, off.Registry()) {
		if strings.HasPrefix(k, "pdkit_gpu_") && (k != "pdkit_gpu_available" || x != 0) {
			t.Errorf("without a GPU: %s %v", k, x)
		}
	}
}
