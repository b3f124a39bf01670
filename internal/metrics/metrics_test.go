package metrics

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

// withCPU gives cfg's ranks one-thread cpu kernels unless it names a
// backend.
func withCPU(cfg serve.Config) serve.Config {
	if cfg.Backend == nil {
		cfg.Backend = func(int) kernels.Backend { return cpu.New(1) }
	}
	return cfg
}

// watched starts an engine of m with cfg (withCPU) and returns a Metrics
// watching it; the engine closes when the test ends.
func watched(t *testing.T, m *model.Model, cfg serve.Config) *Metrics {
	t.Helper()
	eng, err := serve.New(m, withCPU(cfg))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	met := New(nil)
	if err := met.Watch(eng); err != nil {
		t.Fatal(err)
	}
	return met
}

func TestReason(t *testing.T) {
	for in, want := range map[string]string{
		"stop": "stop", "length": "length", "abort": "abort", "timeout": "timeout",
		serve.ReasonSlowReader: "error", serve.ReasonClosed: "error", "error: release 3: boom": "error", "weird": "other",
	} {
		if got := Reason(in); got != want {
			t.Errorf("Reason(%q) = %q, want %q", in, got, want)
		}
	}
}

// values gathers reg into name{label values} → value.
func values(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			k := f.GetName()
			for _, l := range m.GetLabel() {
				k += "/" + l.GetValue()
			}
			switch {
			case m.Counter != nil:
				out[k] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[k] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[k+"_count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// lint fails t on what promtool check metrics would report of m's
// exposition (the same linter, client_golang's promlint).
func lint(t *testing.T, m *Metrics) {
	t.Helper()
	problems, err := testutil.GatherAndLint(m.Registry())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

func TestEngineAbortAndFinish(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	met := New(nil)
	eng, err := serve.New(m, withCPU(serve.Config{PageSize: 4, MaxRunning: 4, Observer: met}))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if err := met.Watch(eng); err != nil {
		t.Fatal(err)
	}
	if err := met.Watch(eng); err == nil {
		t.Error("second Watch of the same registry accepted")
	}
	ctx := context.Background()
	done, err := eng.Submit(ctx, serve.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 4, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	long, err := eng.Submit(ctx, serve.Request{Prompt: []int32{4, 5, 6}, MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	gen := 0
	for ev := range done.Events {
		if ev.Finish != nil {
			gen += ev.Finish.CompletionTokens
		}
	}
	<-long.Events // its first token: running now
	long.Abort()
	for ev := range long.Events {
		if ev.Finish != nil {
			if ev.Finish.Reason != serve.ReasonAbort {
				t.Fatalf("long request finished with %q", ev.Finish.Reason)
			}
			gen += ev.Finish.CompletionTokens
		}
	}
	var v map[string]float64
	// Past the bound the checks below say what is missing.
	waitfor.Poll(10*time.Second, func() bool {
		v = values(t, met.Registry())
		return v["pdkit_kv_pages_used/0"] == 0 && v["pdkit_aborts_total"] == 1
	})
	for k, want := range map[string]float64{
		"pdkit_aborts_total":                      1,
		"pdkit_requests_total/abort":              1,
		"pdkit_requests_total/length":             1,
		"pdkit_prompt_tokens_total":               6,
		"pdkit_generation_tokens_total":           float64(gen),
		"pdkit_time_to_first_token_seconds_count": 2,
		"pdkit_inter_token_latency_seconds_count": float64(gen - 2),
		"pdkit_kv_pages_used/0":                   0,
		"pdkit_kv_pages_capacity/0":               float64(eng.Config().Pages()),
		"pdkit_num_running_reqs":                  0,
		"pdkit_num_waiting_reqs":                  0,
		"pdkit_sched_kv_pages_held":               0,
	} {
		if got, ok := v[k]; !ok || got != want {
			t.Errorf("%s = %v (present %v), want %v", k, got, ok, want)
		}
	}
	// The rank's time in collectives, one series per communicator.
	for _, comm := range []string{serve.CommControl, serve.CommForward} {
		if got, ok := v["pdkit_collective_wait_seconds_total/"+comm+"/0"]; !ok || got < 0 {
			t.Errorf("collective wait on %s = %v (present %v)", comm, got, ok)
		}
	}
	if got, ok := v["pdkit_collective_stalls_total"]; !ok || got != 0 {
		t.Errorf("collective stalls = %v (present %v), want 0", got, ok)
	}
	met.RequestServed("tiny", time.Second)
	if got := values(t, met.Registry())["pdkit_e2e_request_latency_seconds/tiny_count"]; got != 1 {
		t.Errorf("e2e latency count %v, want 1", got)
	}
	lint(t, met)
}
