package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdkit/pdkit/engine/serve"
)

// hicacheDescs are the host tier's metrics, per rank, read at scrape time
// from the engine's tier snapshots (View.HiCache): none on an engine
// without a prefix cache.
type hicacheDescs struct {
	enabled, bandwidth                  *prometheus.Desc
	capacity, used                      *prometheus.Desc
	backups, backupBytes, backupSeconds *prometheus.Desc
	backupFailures                      *prometheus.Desc
	loads, loadBytes, loadSeconds       *prometheus.Desc
	loadFailures                        *prometheus.Desc
	hits, hitTokens, dropped, abandoned *prometheus.Desc
	gateWait                            *prometheus.Desc
}

// Parts of pdkit_hicache_gate_wait_seconds_total: the forward pass's
// reads that wait at a layer's gate for loads back from host.
const (
	GateKV     = "kv"     // attention's K and V
	GateIndexK = "indexk" // the sparse indexer's index-K
)

func newHiCacheDescs() *hicacheDescs {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "hicache", name), help, append([]string{"rank"}, labels...), nil)
	}
	return &hicacheDescs{
		enabled:        d("enabled", "1 while the rank's host tier (HiCache) is on, else 0."),
		bandwidth:      d("load_bandwidth_bytes_per_second", "The pace of the rank's loads back from host, bytes per second (0: unlimited)."),
		capacity:       d("host_tokens_capacity", "Tokens the rank's host pool holds (its pages × the page size; 0 while off)."),
		used:           d("host_tokens_used", "Tokens of the rank's host pool holding cached prefixes."),
		backups:        d("backups_total", "Pages the rank backed up to host."),
		backupBytes:    d("backup_bytes_total", "Bytes the rank backed up to host."),
		backupSeconds:  d("backup_seconds_total", "Time the rank's writer spent backing pages up to host."),
		backupFailures: d("backup_failures_total", "Backups to host that failed."),
		loads:          d("loads_total", "Loads back from host."),
		loadBytes:      d("load_bytes_total", "Bytes loaded back from host."),
		loadSeconds:    d("load_seconds_total", "Time the rank's loader spent loading back from host."),
		loadFailures:   d("load_failures_total", "Loads back from host that failed."),
		hits:           d("host_hits_total", "Requests whose cached prefix was loaded (partly) back from host."),
		hitTokens:      d("hit_tokens_total", "Prompt tokens loaded back from host instead of computed."),
		dropped:        d("dropped_tokens_total", "Host-only cached tokens forgotten (evicted from host, or the tier switched off)."),
		abandoned:      d("abandoned_loads_total", "Loads back from host given up because their requests went."),
		gateWait:       d("gate_wait_seconds_total", "Time the forward pass waited at a layer's gate for loads back from host, by the read (part: kv, attention; indexk, the sparse indexer) and layer.", "part", "layer"),
	}
}

func (h *hicacheDescs) describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{h.enabled, h.bandwidth, h.capacity, h.used, h.backups, h.backupBytes, h.backupSeconds,
		h.backupFailures, h.loads, h.loadBytes, h.loadSeconds, h.loadFailures, h.hits, h.hitTokens, h.dropped, h.abandoned, h.gateWait} {
		ch <- d
	}
}

func (h *hicacheDescs) collect(eng *serve.Engine, ch chan<- prometheus.Metric) {
	for _, ts := range eng.View().HiCache() {
		rank := strconv.Itoa(ts.Rank)
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, rank)
		}
		counter := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, rank)
		}
		on := 0.0
		if ts.On {
			on = 1
		}
		gauge(h.enabled, on)
		gauge(h.bandwidth, float64(ts.LoadBandwidth))
		gauge(h.capacity, float64(ts.HostPages*ts.PageSize))
		gauge(h.used, float64(ts.HostUsed*ts.PageSize))
		t := ts.Totals
		counter(h.backups, float64(t.Backups))
		counter(h.backupBytes, float64(t.BackupBytes))
		counter(h.backupSeconds, t.BackupSeconds)
		counter(h.backupFailures, float64(t.BackupFailures))
		counter(h.loads, float64(t.Loads))
		counter(h.loadBytes, float64(t.LoadBytes))
		counter(h.loadSeconds, t.LoadSeconds)
		counter(h.loadFailures, float64(t.LoadFailures))
		counter(h.hits, float64(t.HostHits))
		counter(h.hitTokens, float64(t.HitTokens))
		counter(h.dropped, float64(t.DroppedTokens))
		counter(h.abandoned, float64(t.Abandoned))
		for part, waits := range map[string][]float64{GateKV: ts.WaitKVSeconds, GateIndexK: ts.WaitIndexKSeconds} {
			for layer, s := range waits {
				ch <- prometheus.MustNewConstMetric(h.gateWait, prometheus.CounterValue, s, rank, part, strconv.Itoa(layer))
			}
		}
	}
}

// HiCacheSwitched counts a live switch of the host tier (the admin API's
// on or off), once queued: pdkit_hicache_switches_total{direction}.
func (m *Metrics) HiCacheSwitched(on bool) {
	dir := "off"
	if on {
		dir = "on"
	}
	m.hicacheSwitches.WithLabelValues(dir).Inc()
}
