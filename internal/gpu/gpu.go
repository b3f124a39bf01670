// Package gpu reads the GPUs' state through NVML (github.com/NVIDIA/go-nvml)
// for the servers' metrics and debug API. Without an NVIDIA driver it says
// "no GPU" and why, and calls nothing else in NVML: a call after a failed
// Init ends the process.
package gpu

import (
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/pdkit/pdkit/api/debug"
)

// Telemetry is an open NVML session, or the reason there is none. It is
// safe for concurrent use: readings are serialized.
type Telemetry struct {
	mu     sync.Mutex
	lib    nvml.Interface // nil when Init failed or after Close
	reason string
	driver string
}

// Open starts NVML from the driver's library, found at run time.
func Open() *Telemetry { return OpenWith(nvml.New()) }

// OpenWith starts NVML through lib (a simulated one in tests).
func OpenWith(lib nvml.Interface) *Telemetry {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return &Telemetry{reason: initReason(ret)}
	}
	t := &Telemetry{lib: lib}
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		t.driver = v
	}
	return t
}

// Off is telemetry that was never opened, for servers started without it.
func Off(reason string) *Telemetry { return &Telemetry{reason: reason} }

// initReason explains a failed Init without asking NVML (whose error
// strings are a library call too).
func initReason(ret nvml.Return) string {
	switch ret {
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return "no GPU: the NVIDIA driver library (libnvidia-ml.so.1) is not installed"
	case nvml.ERROR_DRIVER_NOT_LOADED:
		return "no GPU: the NVIDIA driver is not loaded"
	case nvml.ERROR_NO_PERMISSION:
		return "no GPU: no permission to use the NVIDIA driver"
	}
	return fmt.Sprintf("no GPU: NVML init failed (%s)", ret.String())
}

// Available reports whether NVML is open.
func (t *Telemetry) Available() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lib != nil
}

// Read reads every device. A reading a device does not support is left
// null; a device that cannot be read at all carries its error.
func (t *Telemetry) Read() debug.GPUResponse {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := debug.GPUResponse{Reason: t.reason, Driver: t.driver, Devices: []debug.GPU{}}
	if t.lib == nil {
		return out
	}
	out.Available = true
	n, ret := t.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		out.Reason = "device count: " + ret.String()
		return out
	}
	for i := range n {
		out.Devices = append(out.Devices, readDevice(t.lib, i))
	}
	return out
}

func readDevice(lib nvml.Interface, i int) debug.GPU {
	g := debug.GPU{Index: i}
	d, ret := lib.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		g.Error = "handle: " + ret.String()
		return g
	}
	if v, ret := d.GetName(); ret == nvml.SUCCESS {
		g.Name = v
	}
	if v, ret := d.GetUUID(); ret == nvml.SUCCESS {
		g.UUID = v
	}
	if m, ret := d.GetMemoryInfo(); ret == nvml.SUCCESS {
		g.MemoryUsedBytes, g.MemoryTotalBytes = m.Used, m.Total
	}
	if u, ret := d.GetUtilizationRates(); ret == nvml.SUCCESS {
		g.UtilizationPercent, g.MemoryUtilizationPercent = &u.Gpu, &u.Memory
	}
	if c, ret := d.GetTemperature(nvml.TEMPERATURE_GPU); ret == nvml.SUCCESS {
		g.TemperatureC = &c
	}
	if mw, ret := d.GetPowerUsage(); ret == nvml.SUCCESS {
		w := float64(mw) / 1000
		g.PowerWatts = &w
	}
	return g
}

// Close ends the NVML session; later readings say it is closed.
func (t *Telemetry) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.lib == nil {
		return nil
	}
	ret := t.lib.Shutdown()
	t.lib, t.reason = nil, "GPU telemetry closed"
	if ret != nvml.SUCCESS {
		return fmt.Errorf("gpu: NVML shutdown: %s", ret.String())
	}
	return nil
}
