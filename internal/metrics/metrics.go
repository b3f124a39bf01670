// Package metrics exposes a serving engine's state and latencies in the
// Prometheus text format, under the namespace "pdkit".
//
// Every Metrics registers on a registry of its own (never the global
// default one), so that several servers in one process do not collide.
//
// Two sources feed it:
//
//   - An engine collector reads the engine at scrape time without locks
//     (the loop's published snapshot, its health and the KV pools' atomic
//     counters), so a scrape answers while the loop is stuck: requests
//     running and waiting, KV pages used and in all per rank, retractions
//     and aborts.
//   - The Metrics is a serve.Observer: set it as serve.Config.Observer and
//     the loop reports every token, finished request and forward step with
//     timestamps it took itself, which feed the token and request counters
//     and the time-to-first-token, inter-token and step-duration
//     histograms. Its methods only update atomics; they never block.
//
// The HTTP server adds what only it sees: RequestServed feeds
//
//	pdkit_e2e_request_latency_seconds{model}  from a request's arrival to its answer's end
//
// and the engine's QueueObserver feeds
//
//	pdkit_queue_time_seconds  from a request's arrival until it is first given its resources
//
// Every registry also carries the Go runtime (go_*), process (process_*)
// and build-information (go_build_info) collectors of client_golang.
//
// # KV pages
//
// Each rank's pool is split three ways, read lock-free at scrape time:
//
//	pdkit_kv_pages_used{rank}      pages held by sequences (requests) and not by the prefix cache
//	pdkit_kv_pages_cached{rank}    pages the prefix cache holds, whether or not a request shares them
//	pdkit_kv_pages_capacity{rank}  every page of the pool: used + cached + free
//
// "Used" is this one definition everywhere pdkit reports pages used; the
// debug API's kv[].used counts the cached pages too (used + cached here).
//
// Names follow Prometheus conventions (promtool check metrics is clean):
// counters end in _total, gauges never do, units are base units.
//
// # Collectives
//
// The ranks of an engine talk over two communicators, each with its own
// sequence numbers and watchdog: control (the loop's agreements: step
// input and output, the poll, free-page and prefix MINs, the plan digest)
// and forward (the model's collectives inside a forward pass). The engine
// collector reads, lock-free:
//
//	pdkit_collective_wait_seconds_total{rank,comm}  time inside the communicator's collectives (comm: control or forward)
//	pdkit_collective_stalls_total                   collectives either communicator's watchdog reported as stalled
//	pdkit_engine_restarts_total                     rank group rebuilds after a collective timeout or a broken group
//
// # PD roles
//
// On a prefill or decode engine (serve.Config.Role) the engine collector
// also reads, at scrape time and only through the engine's lock-free PD
// accessors (PDQueueEntries, PDLinks, PDFailures, PDTransferBytes):
//
//	pdkit_num_prefill_bootstrap_queue_reqs{rank}  prefill: waiting for the decode's transfer info
//	pdkit_num_prefill_inflight_queue_reqs{rank}   prefill: KV sent, waiting for the decode's ack
//	pdkit_num_decode_prealloc_queue_reqs{rank}    decode: resolving the registry, reserving pages
//	pdkit_num_decode_transfer_queue_reqs{rank}    decode: waiting for the KV
//	pdkit_num_decode_aborting_queue_reqs{rank}    decode: ABORT sent, pages held until acked
//	pdkit_pd_failed_reqs_total                    PD requests failed (client aborts not counted)
//	pdkit_kv_transfer_bytes_total                 KV payload sent (prefill) or received (decode), rank 0's share
//	pdkit_pd_messages_received_total{rank}        messages the rank's socket received
//	pdkit_pd_dropped_messages_total{rank,reason}  dropped: malformed (the handler refused it),
//	                                              handler_panic (recovered), late (unknown room),
//	                                              misplaced (a type the role never receives),
//	                                              fault (a drop-* fault switch)
//	pdkit_pd_messages_sent_total{rank}            messages handed to ZeroMQ
//	pdkit_pd_send_errors_total{rank}              connect or send failures
//	pdkit_pd_receive_loop_up{rank}                1 while the rank's receive loop runs, else 0
//	pdkit_pd_refused_reqs_total{reason}           refused on arrival: room_in_use (a live request has
//	                                              the room), bootstrap_url (not a prefill registry
//	                                              of the decode's --prefill-bootstrap), unsigned
//	                                              (not signed with the cluster secret)
//	pdkit_pd_bootstrap_lookups_evicted_total      decode: registry lookups dropped from its bounded
//	                                              cache (--bootstrap-cache-size)
//
// The queue gauges use the reference system's names; each rank's count is
// taken from the queues the rank last published (after its last loop
// iteration), and a role exports only its own queues. A colocated engine
// exports none of these.
//
// On a decode engine the Metrics is also a serve.PDObserver: each rank
// reports every request's KV transfer as it completes, which feeds
//
//	pdkit_kv_transfer_duration_seconds{rank}  from sending TRANSFER_INFO to the last KV chunk applied
//	pdkit_kv_transfer_request_bytes{rank}     KV payload bytes of one request's transfer
//
// # HiCache
//
// On an engine with a prefix cache the engine collector reads each rank's
// host tier from its last published snapshot (View.HiCache), whether the
// tier is on or off (its counters run across switches):
//
//	pdkit_hicache_enabled{rank}                          1 while the tier is on
//	pdkit_hicache_host_tokens_capacity{rank}             host pool size in tokens (pages × page size; 0 while off)
//	pdkit_hicache_host_tokens_used{rank}                 of those, holding cached prefixes
//	pdkit_hicache_load_bandwidth_bytes_per_second{rank}  the loader's pace (0: unlimited)
//	pdkit_hicache_backups_total{rank}                    pages backed up to host; also _backup_bytes_total,
//	                                                     _backup_seconds_total, _backup_failures_total
//	pdkit_hicache_loads_total{rank}                      loads back from host; also _load_bytes_total,
//	                                                     _load_seconds_total, _load_failures_total
//	pdkit_hicache_host_hits_total{rank}                  requests whose prefix was loaded back from host
//	pdkit_hicache_hit_tokens_total{rank}                 prompt tokens so loaded
//	pdkit_hicache_dropped_tokens_total{rank}             host-only cached tokens forgotten
//	pdkit_hicache_abandoned_loads_total{rank}            loads given up because their requests went
//	pdkit_hicache_gate_wait_seconds_total{rank,part,layer}  the forward pass's waits at a layer's gate
//	                                                     (part: kv, attention; indexk, the sparse indexer)
//	pdkit_prefix_unstalls_total                          waiting requests that gave up their cached prefix
//	                                                     because nothing ran and the queue's head did not fit
//
// The admin API's switches feed pdkit_hicache_switches_total{direction}
// (on, off) through HiCacheSwitched.
//
// # Index-K
//
// On an engine whose model has a sparse indexer, read at scrape time:
//
//	pdkit_indexk_precision{dtype}  1 for the precision the index keys are stored in now (fp8 or bf16), 0 for the other
//	pdkit_indexk_switches_total    live precision switches done (serve.Engine.SetIndexK, the admin API's)
package metrics

import (
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pdkit/pdkit/engine/serve"
)

// Namespace prefixes every metric name.
const Namespace = "pdkit"

// Metrics holds the observer-fed metrics and the registry they live on.
type Metrics struct {
	reg *prometheus.Registry

	promptTokens prometheus.Counter
	genTokens    prometheus.Counter
	requests     *prometheus.CounterVec
	ttft         prometheus.Histogram
	itl          prometheus.Histogram
	step         prometheus.Histogram
	kvTransfer   *prometheus.HistogramVec
	kvBytes      *prometheus.HistogramVec
	e2e          *prometheus.HistogramVec
	queue        prometheus.Histogram

	hicacheSwitches *prometheus.CounterVec
	onFinish        atomic.Pointer[func(reason string)] // OnFinish's
	pdUnsigned      atomic.Uint64                       // PDRefusedUnsigned's
}

// PDRefusedUnsigned counts a PD request the server refused for not being
// signed with the cluster secret (pdkit_pd_refused_reqs_total{reason=
// "unsigned"}).
func (m *Metrics) PDRefusedUnsigned() { m.pdUnsigned.Add(1) }

// OnFinish has f told the reason of every request the engine finishes,
// after it is counted (a server's readiness window); a later call
// replaces f.
func (m *Metrics) OnFinish(f func(reason string)) { m.onFinish.Store(&f) }

var (
	_ serve.Observer      = (*Metrics)(nil)
	_ serve.PDObserver    = (*Metrics)(nil)
	_ serve.QueueObserver = (*Metrics)(nil)
)

// Latency buckets in seconds: 1ms to about 33s.
var latencyBuckets = prometheus.ExponentialBuckets(0.001, 2, 16)

// RequestBuckets are the buckets of end-to-end request latencies in
// seconds: 10ms to about 41 minutes, since a long generation or a request
// queued under load takes minutes, not milliseconds.
var RequestBuckets = prometheus.ExponentialBuckets(0.01, 2, 18)

// QueueBuckets are the buckets of queue times in seconds: 10ms to about 9
// minutes, each a quarter wider than the last, fine enough that a
// percentile estimated from them (histogram_quantile) is within a quarter
// of the truth.
var QueueBuckets = prometheus.ExponentialBuckets(0.01, 1.25, 50)

// RegisterProcess registers client_golang's Go runtime, process and build
// information collectors on reg: go_* (goroutines, memory, GC), process_*
// (CPU, resident memory, open files) and go_build_info.
func RegisterProcess(reg prometheus.Registerer) {
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewBuildInfoCollector())
}

// New registers the observer-fed metrics and the process collectors on reg
// (a fresh registry when nil) and returns them. Attach an engine with Watch.
func New(reg *prometheus.Registry) *Metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &Metrics{
		reg: reg,
		promptTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "prompt_tokens_total",
			Help: "Prompt tokens of finished requests.",
		}),
		genTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "generation_tokens_total",
			Help: "Tokens generated, counted as they are emitted.",
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "requests_total",
			Help: "Finished requests by finish reason (stop, length, abort, timeout, error).",
		}, []string{"finish_reason"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "time_to_first_token_seconds",
			Help:    "Time from submission to a request's first generated token (mirrors sglang:time_to_first_token_seconds).",
			Buckets: latencyBuckets,
		}),
		itl: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "inter_token_latency_seconds",
			Help:    "Time between consecutive generated tokens of a request (mirrors sglang:inter_token_latency_seconds).",
			Buckets: latencyBuckets,
		}),
		step: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "step_duration_seconds",
			Help:    "Duration of loop iterations that ran a forward step.",
			Buckets: latencyBuckets,
		}),
	}
	m.kvTransfer = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "kv_transfer_duration_seconds",
		Help:    "Decode side: from sending TRANSFER_INFO to the last KV chunk applied, per request and rank.",
		Buckets: latencyBuckets,
	}, []string{"rank"})
	m.kvBytes = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "kv_transfer_request_bytes",
		Help:    "Decode side: KV payload bytes of one request's transfer, per rank.",
		Buckets: prometheus.ExponentialBuckets(1024, 4, 12),
	}, []string{"rank"})
	m.e2e = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "e2e_request_latency_seconds",
		Help:    "Time from a generation request's arrival at the server to the end of its answer, for requests the engine took, by model served (mirrors sglang:e2e_request_latency_seconds).",
		Buckets: RequestBuckets,
	}, []string{"model"})
	m.queue = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "queue_time_seconds",
		Help:    "Time a request waited its turn: from arrival until the server first gave it its resources (its first forward step; on a decode, its KV pages) (mirrors sglang:queue_time_seconds).",
		Buckets: QueueBuckets,
	})
	m.hicacheSwitches = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "hicache_switches_total",
		Help: "Live switches of the host tier (HiCache) through the admin API, by direction (on, off).",
	}, []string{"direction"})
	m.hicacheSwitches.WithLabelValues("on")
	m.hicacheSwitches.WithLabelValues("off")
	reg.MustRegister(m.promptTokens, m.genTokens, m.requests, m.ttft, m.itl, m.step, m.kvTransfer, m.kvBytes, m.e2e, m.queue, m.hicacheSwitches)
	RegisterProcess(reg)
	return m
}

// RequestServed records a generation request of model that took d from
// its arrival at the server to the end of its answer.
func (m *Metrics) RequestServed(model string, d time.Duration) {
	m.e2e.WithLabelValues(model).Observe(d.Seconds())
}

// QueueWaited implements serve.QueueObserver.
func (m *Metrics) QueueWaited(_ uint64, waited time.Duration) { m.queue.Observe(waited.Seconds()) }

// Registry is the registry the metrics live on.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Watch registers a collector that reads eng at scrape time. Call it once
// per engine.
func (m *Metrics) Watch(eng *serve.Engine) error {
	return m.reg.Register(newEngineCollector(eng, &m.pdUnsigned))
}

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// TokenEmitted implements serve.Observer.
func (m *Metrics) TokenEmitted(_ uint64, n int, since time.Duration) {
	m.genTokens.Inc()
	if n == 1 {
		m.ttft.Observe(since.Seconds())
	} else {
		m.itl.Observe(since.Seconds())
	}
}

// RequestFinished implements serve.Observer.
func (m *Metrics) RequestFinished(_ uint64, f serve.Finish) {
	m.promptTokens.Add(float64(f.PromptTokens))
	m.requests.WithLabelValues(Reason(f.Reason)).Inc()
	if on := m.onFinish.Load(); on != nil {
		(*on)(f.Reason)
	}
}

// StepFinished implements serve.Observer.
func (m *Metrics) StepFinished(rec serve.StepRecord) {
	m.step.Observe(rec.End.Sub(rec.Start).Seconds())
}

// Reason maps a finish reason onto a bounded label value: every
// "error: ..." text becomes "error".
func Reason(r string) string {
	switch r {
	case serve.ReasonStop, serve.ReasonLength, serve.ReasonAbort, serve.ReasonTimeout:
		return r
	}
	if strings.HasPrefix(r, "error") {
		return "error"
	}
	return "other"
}

// engineCollector reads an engine at scrape time.
type engineCollector struct {
	eng                        *serve.Engine
	pdUnsigned                 *atomic.Uint64 // the Metrics' count of unsigned PD requests
	running, waiting           *prometheus.Desc
	pagesUsed, pagesCapacity   *prometheus.Desc
	retractions, aborts, steps *prometheus.Desc
	heldPages, schedPages      *prometheus.Desc
	pagesCached, collWait      *prometheus.Desc
	promptTokens, cachedTokens *prometheus.Desc
	prefixHits, evictions      *prometheus.Desc
	unstalls                   *prometheus.Desc
	loopAge, stalls            *prometheus.Desc
	restarts                   *prometheus.Desc

	// PD roles only (nil descs on a colocated engine).
	pd *pdDescs
	// The host tier, per rank.
	hicache *hicacheDescs
	// The index-K precision (nil without a sparse indexer).
	indexK *indexKDescs
}

func newEngineCollector(eng *serve.Engine, pdUnsigned *atomic.Uint64) *engineCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, labels, nil)
	}
	return &engineCollector{
		eng:           eng,
		running:       d("num_running_reqs", "Admitted requests (prefilling and decoding)."),
		waiting:       d("num_waiting_reqs", "Requests waiting for admission, queued or not yet taken by the loop."),
		pagesUsed:     d("kv_pages_used", "KV pages of the rank's pool held by sequences (requests) and not by the prefix cache; used + cached + free = capacity.", "rank"),
		pagesCached:   d("kv_pages_cached", "KV pages the rank's prefix cache holds, whether or not a request shares them.", "rank"),
		collWait:      d("collective_wait_seconds_total", "Time the rank spent inside collectives of the communicator comm (control: the loop's agreements; forward: the model's), waiting for its peers and moving data.", "rank", "comm"),
		promptTokens:  d("prefix_cache_prompt_tokens_total", "Prompt tokens of admitted requests."),
		cachedTokens:  d("prefix_cache_hit_tokens_total", "Prompt tokens read from the prefix cache instead of computed."),
		prefixHits:    d("prefix_cache_hits_total", "Requests whose prompt matched at least one cached page."),
		evictions:     d("prefix_cache_evicted_pages_total", "Cached pages evicted to make room (rank 0)."),
		unstalls:      d("prefix_unstalls_total", "Waiting requests that gave up their cached prefix (to compute it) because nothing ran and the queue's head did not fit otherwise."),
		stalls:        d("collective_stalls_total", "Collectives the watchdogs of the rank group's communicators reported as stalled."),
		restarts:      d("engine_restarts_total", "Rebuilds of the rank group after a collective waited past --collective-timeout or the group broke; each failed the requests in flight."),
		loopAge:       d("loop_age_seconds", "Time since the least recent start of a loop iteration over the ranks."),
		pagesCapacity: d("kv_pages_capacity", "KV pages of the rank's pool, used, cached or free.", "rank"),
		retractions:   d("retractions_total", "Requests retracted to free KV."),
		aborts:        d("aborts_total", "Requests finished by an abort."),
		steps:         d("steps_total", "Forward steps run."),
		heldPages:     d("sched_kv_pages_held", "KV pages the scheduler holds for its requests (per rank)."),
		schedPages:    d("sched_kv_pages_capacity", "KV pages the scheduler manages (per rank)."),
		pdUnsigned:    pdUnsigned,
		pd:            newPDDescs(eng.Config().Role),
		hicache:       newHiCacheDescs(),
		indexK:        newIndexKDescs(eng),
	}
}

func (c *engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.running, c.waiting, c.pagesUsed, c.pagesCapacity, c.retractions, c.aborts, c.steps, c.heldPages, c.schedPages,
		c.pagesCached, c.collWait, c.promptTokens, c.cachedTokens, c.prefixHits, c.evictions, c.unstalls, c.loopAge, c.stalls, c.restarts} {
		ch <- d
	}
	c.pd.describe(ch)
	c.hicache.describe(ch)
	c.indexK.describe(ch)
}

func (c *engineCollector) Collect(ch chan<- prometheus.Metric) {
	h := c.eng.View().Health(time.Now())
	s := c.eng.View().Snapshot()
	gauge := func(d *prometheus.Desc, v int, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), labels...)
	}
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	gauge(c.running, h.Running)
	gauge(c.waiting, h.Waiting+h.Pending)
	for r := range c.eng.View().Ranks() {
		used, cached, total := c.eng.View().KVPages(r)
		rank := strconv.Itoa(r)
		gauge(c.pagesUsed, used-cached, rank)
		gauge(c.pagesCached, cached, rank)
		gauge(c.pagesCapacity, total, rank)
		for _, comm := range []string{serve.CommControl, serve.CommForward} {
			ch <- prometheus.MustNewConstMetric(c.collWait, prometheus.CounterValue, c.eng.View().CollectiveWait(comm, r).Seconds(), rank, comm)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.loopAge, prometheus.GaugeValue, h.LoopAge.Seconds())
	counter(c.promptTokens, s.Totals.PromptTokens)
	counter(c.cachedTokens, s.Totals.CachedTokens)
	counter(c.prefixHits, s.Totals.PrefixHits)
	counter(c.evictions, s.Totals.PrefixEvictions)
	counter(c.unstalls, s.Totals.Unstalls)
	counter(c.stalls, c.eng.View().StallsReported())
	counter(c.restarts, s.Totals.Restarts)
	gauge(c.heldPages, s.Queue.HeldPages)
	gauge(c.schedPages, s.Queue.TotalPages)
	counter(c.retractions, s.Totals.Retractions)
	counter(c.aborts, s.Totals.Aborts)
	counter(c.steps, s.Totals.Steps)
	c.pd.collect(c.eng, c.pdUnsigned.Load(), ch)
	c.hicache.collect(c.eng, ch)
	c.indexK.collect(c.eng, s.Totals.IndexKSwitches, ch)
}

// KVTransferred implements serve.PDObserver.
func (m *Metrics) KVTransferred(rank, bytes int, d time.Duration) {
	r := strconv.Itoa(rank)
	m.kvTransfer.WithLabelValues(r).Observe(d.Seconds())
	m.kvBytes.WithLabelValues(r).Observe(float64(bytes))
}
