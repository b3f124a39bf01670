// Package gputest gives tests a GPU telemetry over NVML's simulated
// 8 × H200 server (go-nvml's mock), with fixed readings.
package gputest

import (
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/pdkit/pdkit/internal/gpu"
)

// H200 opens telemetry over a simulated 8 × H200 server. Device i reports
// 10·i % utilization and 5 % memory utilization, 300 W; temperatures are
// not supported (null). The caller closes it.
func H200() *gpu.Telemetry {
	srv := dgxh200.New()
	for i, d := range srv.Devices {
		dev := d.(*server.Device)
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			return nvml.Utilization{Gpu: uint32(10 * i), Memory: 5}, nvml.SUCCESS
		}
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		dev.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 300000, nvml.SUCCESS }
	}
	return gpu.OpenWith(srv)
}
