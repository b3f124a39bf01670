package gpu

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// TestOpenHere opens the real NVML of this machine: with a driver it reads
// every device; without one (the CI machines) it says why, reads nothing,
// and the process lives on.
func TestOpenHere(t *testing.T) {
	tel := Open()
	defer tel.Close()
	r := tel.Read()
	if !r.Available {
		if !strings.HasPrefix(r.Reason, "no GPU: ") || len(r.Devices) != 0 {
			t.Fatalf("without NVML: %+v", r)
		}
		t.Logf("%s", r.Reason)
		return
	}
	for _, d := range r.Devices {
		if d.Name == "" || d.MemoryTotalBytes == 0 {
			t.Errorf("device %+v", d)
		}
	}
	t.Logf("%d devices, driver %s", len(r.Devices), r.Driver)
}

// TestSimulatedH200 reads a simulated 8 × H200 server: names, UUIDs and
// memory from it; utilization, temperature and power where the device
// reports them (device 0 here), null where it does not.
func TestSimulatedH200(t *testing.T) {
	srv := dgxh200.New()
	d0 := srv.Devices[0].(*server.Device)
	d0.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 87, Memory: 41}, nvml.SUCCESS }
	d0.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 63, nvml.SUCCESS }
	d0.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 512250, nvml.SUCCESS }
	for _, d := range srv.Devices[1:] {
		dev := d.(*server.Device)
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{}, nvml.ERROR_NOT_SUPPORTED }
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		dev.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	}
	tel := OpenWith(srv)
	r := tel.Read()
	if !r.Available || r.Driver == "" || len(r.Devices) != 8 {
		t.Fatalf("read %+v", r)
	}
	g := r.Devices[0]
	if !strings.Contains(g.Name, "H200") || !strings.HasPrefix(g.UUID, "GPU-") || g.MemoryTotalBytes < 140<<30 ||
		*g.UtilizationPercent != 87 || *g.MemoryUtilizationPercent != 41 || *g.TemperatureC != 63 || *g.PowerWatts != 512.25 {
		t.Errorf("device 0: %+v", g)
	}
	if g := r.Devices[7]; g.Index != 7 || g.UtilizationPercent != nil || g.TemperatureC != nil || g.PowerWatts != nil {
		t.Errorf("device 7: %+v", g)
	}
	if err := tel.Close(); err != nil {
		t.Fatal(err)
	}
	if r := tel.Read(); r.Available || r.Reason != "GPU telemetry closed" {
		t.Errorf("after Close: %+v", r)
	}
}

// TestInitFails: a failed Init is the only NVML call; the reason names the
// cause.
func TestInitFails(t *testing.T) {
	for ret, want := range map[nvml.Return]string{
		nvml.ERROR_LIBRARY_NOT_FOUND: "no GPU: the NVIDIA driver library (libnvidia-ml.so.1) is not installed",
		nvml.ERROR_DRIVER_NOT_LOADED: "no GPU: the NVIDIA driver is not loaded",
		nvml.ERROR_UNKNOWN:           "no GPU: NVML init failed (ERROR_UNKNOWN)",
	} {
		calls := 0
		lib := &mock.Interface{InitFunc: func() nvml.Return { calls++; return ret }}
		tel := OpenWith(lib) // any other call would panic: its Func is nil
		if r := tel.Read(); r.Available || r.Reason != want || calls != 1 {
			t.Errorf("Init %v: %+v after %d calls", ret, r, calls)
		}
		if err := tel.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
}
