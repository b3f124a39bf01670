package client

import (
	"context"
	"math"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// TestParseMetrics reads an exposition written by the Prometheus client
// library itself, served over HTTP and fetched with Client.Metrics:
// labelled counters (a label value with a quote, a backslash and a
// newline), an unlabelled gauge, and a histogram whose series are left
// out by name.
func TestParseMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	req := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_requests_total", Help: "h"}, []string{"outcome"})
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_errors_total", Help: "h"}, []string{"role", "server"})
	live := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x_live", Help: "h"})
	hist := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x_seconds", Help: "h"})
	reg.MustRegister(req, errs, live, hist)
	req.WithLabelValues("ok").Add(23)
	req.WithLabelValues("upstream_error").Add(7)
	errs.WithLabelValues("prefill", `http://p:1/"a\b`+"\nc").Add(2)
	live.Set(-1.5)
	hist.Observe(0.2)
	ts := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer ts.Close()
	text, err := New(ts.URL, "", nil).Metrics(context.Background())
	if err != nil {
		t.Fatal(err)
	}

	got, err := ParseMetrics(text, "x_requests_total", "x_errors_total", "x_live")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"x_requests_total/ok": 23, "x_requests_total/upstream_error": 7,
		"x_errors_total/prefill " + `http://p:1/"a\b` + "\nc": 2, "x_live/": -1.5}
	if len(got) != len(want) {
		t.Fatalf("got %d samples, want %d: %+v", len(got), len(want), got)
	}
	for _, s := range got {
		key := s.Name + "/" + s.Labels["outcome"]
		if s.Name == "x_errors_total" {
			key = s.Name + "/" + s.Labels["role"] + " " + s.Labels["server"]
		}
		if v, ok := want[key]; !ok || v != s.Value {
			t.Errorf("sample %q = %v, want %v (known %v)", key, s.Value, v, ok)
		}
	}

	all, err := ParseMetrics(text)
	if err != nil || len(all) <= len(got) {
		t.Errorf("every sample: %d, %v", len(all), err)
	}
}

// TestParseMetricsLines: timestamps, special values and spacing are read;
// a line that is no sample is an error naming it.
func TestParseMetricsLines(t *testing.T) {
	got, err := ParseMetrics("# HELP a h\n\na{x=\"1\" , y=\"2\",} 3 1700000000000\nb +Inf\nc NaN\n")
	if err != nil || len(got) != 3 || got[0].Labels["x"] != "1" || got[0].Labels["y"] != "2" || got[0].Value != 3 ||
		!math.IsInf(got[1].Value, 1) || !math.IsNaN(got[2].Value) {
		t.Fatalf("got %+v, %v", got, err)
	}
	for _, bad := range []string{"a{x=1} 2", "a{x=\"1} 2", "a", "a 1 2 3", "a{x=\"1\"} one"} {
		if _, err := ParseMetrics(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
