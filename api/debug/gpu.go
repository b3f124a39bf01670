package debug

// GPUPath is a server's GPUs as NVML reports them (GET, JSON GPUResponse).
const GPUPath = "/debug/v1/gpu"

// GPUResponse is the body of GET /debug/v1/gpu. A machine without an
// NVIDIA driver, or a server started without GPU telemetry, answers
// Available false and the Reason.
type GPUResponse struct {
	Available bool   `json:"available"`
	Reason    string `json:"reason,omitempty"`
	Driver    string `json:"driver,omitempty"` // the driver's version
	Devices   []GPU  `json:"devices"`
}

// GPU is one device. The optional readings are null where the device or
// driver does not report them.
type GPU struct {
	Index            int    `json:"index"`
	UUID             string `json:"uuid"`
	Name             string `json:"name"`
	MemoryUsedBytes  uint64 `json:"memory_used_bytes"`
	MemoryTotalBytes uint64 `json:"memory_total_bytes"`
	// UtilizationPercent is the share of the last sample period a kernel
	// ran; MemoryUtilizationPercent the share memory was read or written.
	UtilizationPercent       *uint32  `json:"utilization_percent"`
	MemoryUtilizationPercent *uint32  `json:"memory_utilization_percent"`
	TemperatureC             *uint32  `json:"temperature_c"`
	PowerWatts               *float64 `json:"power_watts"`
	// Error says why the device could not be read at all.
	Error string `json:"error,omitempty"`
}
