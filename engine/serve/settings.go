package serve

import (
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/kernels"
)

// settingsOf publishes cfg (already defaulted). Every field of Config,
// PDConfig and HiCacheConfig is either published here or named in
// TestSettingsCoverConfig's list of fields that are not settings
// (functions, the start-up faults).
func settingsOf(cfg Config, indexer bool, faultsOn []string) debug.Settings {
	s := debug.Settings{
		Role: cfg.Role, Name: cfg.Name, TPSize: cfg.TP,
		PageSize: cfg.PageSize, KVTokens: cfg.KVTokens, KVMemoryBytes: cfg.KVMemory, KVPages: cfg.Pages(), MaxRunning: cfg.MaxRunning,
		MaxBatchTokens: cfg.MaxBatchTokens, PrefillChunk: cfg.PrefillChunk, PrefixCache: !cfg.DisablePrefixCache, Schedule: cfg.Schedule,
		IndexK: cfg.IndexK.String(), Indexer: indexer, KVDType: kernels.KVName(cfg.KVType),
		HeartbeatMS:       msOf(cfg.Heartbeat),
		FlightRecorderLen: cfg.FlightRecorderLen,
		DecisionLogLen:    cfg.DecisionLogLen,
		CloseTimeoutMS:    msOf(cfg.CloseTimeout),
		WaitingTimeoutMS:  msOf(cfg.WaitingTimeout), PrefillTimeoutMS: msOf(cfg.PrefillTimeout), RequestTimeoutMS: msOf(cfg.RequestTimeout),
		FaultsOn: faultsOn,
	}
	if s.FaultsOn == nil {
		s.FaultsOn = []string{}
	}
	if s.FlightRecorderLen == 0 {
		s.FlightRecorderLen = dist.DefaultFlightRecorderLen
	}
	if cfg.CollectiveWatchdog > 0 {
		s.CollectiveWatchdogMS = msOf(cfg.CollectiveWatchdog)
	}
	s.CollectiveTimeoutMS = msOf(cfg.CollectiveTimeout)
	if !cfg.DisablePrefixCache {
		h := cfg.HiCache
		s.HiCache = &debug.HiCacheSettings{
			EnabledAtStart: h.Enabled, SizeBytes: h.Bytes, Ratio: h.Ratio,
			WritePolicy: h.Policy.String(), LoadBandwidthBytesPerSecond: h.LoadBandwidth,
		}
	}
	if cfg.Role == pdproto.RolePrefill || cfg.Role == pdproto.RoleDecode {
		p := cfg.PD
		s.PD = &debug.PDSettings{
			Host:                 p.Host,
			BootstrapTimeoutMS:   msOf(p.BootstrapTimeout),
			TransferTimeoutMS:    msOf(p.TransferTimeout),
			InflightTimeoutMS:    msOf(p.InflightTimeout),
			AbortAckTimeoutMS:    msOf(p.AbortAckTimeout),
			SendTimeoutMS:        msOf(p.SendTimeout),
			HeartbeatIntervalMS:  msOf(p.HeartbeatInterval),
			HeartbeatTimeoutMS:   msOf(p.HeartbeatTimeout),
			ReservedDecodeTokens: p.ReservedDecodeTokens,
			MaxMessageBytes:      p.MaxMessageBytes,
			MaxPeerSockets:       p.MaxPeerSockets,
			PeerSocketIdleMS:     msOf(p.PeerSocketIdle),
			ReplyQueue:           p.ReplyQueue,
			EarlyRoomsPerSender:  p.EarlyRoomsPerSender,
			HandshakeTimeoutMS:   msOf(p.HandshakeTimeout),
			MaxConnections:       p.MaxConnections,
			PrefillBootstrap:     strings.Join(p.PrefillBootstrap, ","),
			BootstrapCacheSize:   p.BootstrapCacheSize,
			AdvertiseHost:        p.advertiseHost(),
			Authenticated:        p.Secret.Set(),
		}
	}
	return s
}

// msOf is d in float milliseconds, the debug API's unit.
func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// DefaultConfig is the Config New runs with when given a zero one (less
// what depends on the model: the KV capacity, and the kernel backend the
// caller must give): the one place the defaults of the engine and of the
// PD roles are written. Flag defaults and tools read them here.
func DefaultConfig() Config {
	var c Config
	c.setDefaults(nil)
	return c
}
