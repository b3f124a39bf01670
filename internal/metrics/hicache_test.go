package metrics

import (
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// The host tier's metrics, per rank: the pool as the engine sized it, a
// gate-wait series per layer and read, the switches by direction; none of
// the tier's on an engine without a prefix cache; lint-clean either way.
func TestHiCacheMetrics(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	met := watched(t, m, serve.Config{TP: 2, PageSize: 4, KVTokens: 64, MaxRunning: 2,
		HiCache: serve.HiCacheConfig{Enabled: true, Ratio: 3, LoadBandwidth: 5e8}})
	met.HiCacheSwitched(false)
	met.HiCacheSwitched(false)
	v := values(t, met.Registry())
	layers := m.Config.Layers
	for _, rank := range []string{"0", "1"} {
		for k, want := range map[string]float64{
			"pdkit_hicache_enabled/" + rank: 1, "pdkit_hicache_host_tokens_capacity/" + rank: 3 * 64,
			"pdkit_hicache_host_tokens_used/" + rank: 0, "pdkit_hicache_load_bandwidth_bytes_per_second/" + rank: 5e8,
			"pdkit_hicache_loads_total/" + rank: 0, "pdkit_hicache_backups_total/" + rank: 0,
		} {
			if got, ok := v[k]; !ok || got != want {
				t.Errorf("%s = %v (present %v), want %v", k, got, ok, want)
			}
		}
	}
	waits := 0
	for k := range v {
		if strings.HasPrefix(k, "pdkit_hicache_gate_wait_seconds_total/") {
			waits++
		}
	}
	if waits != 2*2*layers {
		t.Errorf("%d gate wait series, want 2 ranks × 2 parts × %d layers", waits, layers)
	}
	if v["pdkit_hicache_switches_total/off"] != 2 || v["pdkit_hicache_switches_total/on"] != 0 {
		t.Errorf("switches: off %v on %v", v["pdkit_hicache_switches_total/off"], v["pdkit_hicache_switches_total/on"])
	}
	if _, ok := v["pdkit_prefix_unstalls_total"]; !ok {
		t.Error("no pdkit_prefix_unstalls_total")
	}
	lint(t, met)

	met = watched(t, m, serve.Config{PageSize: 4, DisablePrefixCache: true})
	for k := range values(t, met.Registry()) {
		if strings.HasPrefix(k, "pdkit_hicache_") && !strings.HasPrefix(k, "pdkit_hicache_switches_total") {
			t.Errorf("an engine without a prefix cache exports %s", k)
		}
	}
	lint(t, met)
}
