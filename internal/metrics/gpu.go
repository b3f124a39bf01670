package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdkit/pdkit/internal/gpu"
)

// WatchGPU registers the GPU collector: every scrape reads t (NVML), so the
// figures are as fresh as the scrape. Without a GPU only
// pdkit_gpu_available (0) is exported.
func (m *Metrics) WatchGPU(t *gpu.Telemetry) error { return m.reg.Register(newGPUCollector(t)) }

type gpuCollector struct {
	t                                             *gpu.Telemetry
	available                                     *prometheus.Desc
	memUsed, memTotal, util, memUtil, temp, power *prometheus.Desc
}

func newGPUCollector(t *gpu.Telemetry) *gpuCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "gpu", name), help, labels, nil)
	}
	dev := []string{"gpu", "uuid", "name"}
	return &gpuCollector{t: t,
		available: d("available", "1 when NVML reads the GPUs, 0 without a GPU or driver."),
		memUsed:   d("memory_used_bytes", "Device memory in use (all processes).", dev...),
		memTotal:  d("memory_total_bytes", "Device memory in all.", dev...),
		util:      d("utilization_ratio", "Share of the last sample period a kernel ran.", dev...),
		memUtil:   d("memory_utilization_ratio", "Share of the last sample period device memory was read or written.", dev...),
		temp:      d("temperature_celsius", "GPU core temperature.", dev...),
		power:     d("power_watts", "Power draw of the board.", dev...),
	}
}

func (c *gpuCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.available, c.memUsed, c.memTotal, c.util, c.memUtil, c.temp, c.power} {
		ch <- d
	}
}

func (c *gpuCollector) Collect(ch chan<- prometheus.Metric) {
	r := c.t.Read()
	up := 0.0
	if r.Available {
		up = 1
	}
	ch <- prometheus.MustNewConstMetric(c.available, prometheus.GaugeValue, up)
	for _, g := range r.Devices {
		if g.Error != "" {
			continue
		}
		labels := []string{strconv.Itoa(g.Index), g.UUID, g.Name}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
		}
		gauge(c.memUsed, float64(g.MemoryUsedBytes))
		gauge(c.memTotal, float64(g.MemoryTotalBytes))
		if g.UtilizationPercent != nil {
			gauge(c.util, float64(*g.UtilizationPercent)/100)
			gauge(c.memUtil, float64(*g.MemoryUtilizationPercent)/100)
		}
		if g.TemperatureC != nil {
			gauge(c.temp, float64(*g.TemperatureC))
		}
		if g.PowerWatts != nil {
			gauge(c.power, *g.PowerWatts)
		}
	}
}
