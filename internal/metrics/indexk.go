package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
)

// indexKDescs are the index-K precision's metrics, read at scrape time
// from the engine: none on an engine whose model has no sparse indexer
// (it stores no index keys).
type indexKDescs struct {
	switches, precision *prometheus.Desc
}

func newIndexKDescs(eng *serve.Engine) *indexKDescs {
	if !eng.View().Settings().Indexer {
		return nil
	}
	return &indexKDescs{
		switches: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "indexk", "switches_total"),
			"Live switches of the index-K precision done (the admin API's, once every rank switched).", nil, nil),
		precision: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "indexk", "precision"),
			"1 for the precision the sparse indexer's keys are stored in now, 0 for the other (dtype: fp8, bf16).", []string{"dtype"}, nil),
	}
}

func (d *indexKDescs) describe(ch chan<- *prometheus.Desc) {
	if d == nil {
		return
	}
	ch <- d.switches
	ch <- d.precision
}

func (d *indexKDescs) collect(eng *serve.Engine, switches uint64, ch chan<- prometheus.Metric) {
	if d == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(d.switches, prometheus.CounterValue, float64(switches))
	now := eng.View().IndexK()
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		v := 0.0
		if dt == now {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(d.precision, prometheus.GaugeValue, v, dt.String())
	}
}
