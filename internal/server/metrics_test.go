package server

import (
	"bufio"
	"bytes"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/metrics"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// exposition is a scraped text exposition: sample line (name with its
// labels, as written) to value.
type exposition map[string]float64

func scrape(t *testing.T, e *env) exposition {
	t.Helper()
	code, b := get(t, e, "/metrics")
	if code != 200 {
		t.Fatalf("GET /metrics: status %d: %s", code, b)
	}
	x := exposition{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			t.Fatalf("bad exposition line %q", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad value in %q: %v", line, err)
		}
		x[line[:i]] = v
	}
	return x
}

func hasPrefix(x exposition, prefix string) bool {
	for k := range x {
		if strings.HasPrefix(k, prefix) {
			return true
		}
	}
	return false
}

func (x exposition) must(t *testing.T, name string) float64 {
	t.Helper()
	v, ok := x[name]
	if !ok {
		t.Fatalf("no sample %s in the exposition", name)
	}
	return v
}

// newMetricsEnv is a colocated server of tp ranks on the tiny model whose
// engine reports to the server's metrics, as pdserve wires them.
func newMetricsEnv(t *testing.T, tp int) *env {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	met := metrics.New(nil)
	eng, err := serve.New(m, withCPU(serve.Config{PageSize: 4, MaxRunning: 8, TP: tp, Observer: met}))
	if err != nil {
		t.Fatal(err)
	}
	srv := New(eng, m, Options{ModelName: "tiny", Metrics: met})
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return &env{m: m, eng: eng, srv: srv, ts: ts}
}

func TestMetrics(t *testing.T) {
	e := newMetricsEnv(t, 2)

	x := scrape(t, e)
	if v := x.must(t, "pdkit_generation_tokens_total"); v != 0 {
		t.Errorf("generation tokens before any request: %v", v)
	}

	const n = 4
	prompt, completion := 0, 0
	for i := range n {
		r := e.complete(t, map[string]any{"prompt": strings.Repeat("once upon a time ", i+1), "max_tokens": 3 + 2*i, "temperature": 0, "ignore_eos": true})
		prompt += r.Usage.PromptTokens
		completion += r.Usage.CompletionTokens
	}
	if completion == 0 {
		t.Fatal("no tokens generated")
	}
	waitIdle(t, e.eng)
	// The loop tells the observer of a step after it publishes it: wait
	// until the step histogram has caught up with the published count;
	// past the bound the checks below say what is off.
	waitfor.Poll(10*time.Second, func() bool {
		x = scrape(t, e)
		return x["pdkit_step_duration_seconds_count"] == x["pdkit_steps_total"]
	})
	t.Logf("prompt %d, completion %d tokens; steps %v", prompt, completion, x["pdkit_steps_total"])
	if v := x.must(t, "pdkit_generation_tokens_total"); v != float64(completion) {
		t.Errorf("generation_tokens_total %v, completions returned %d tokens", v, completion)
	}
	if v := x.must(t, "pdkit_prompt_tokens_total"); v != float64(prompt) {
		t.Errorf("prompt_tokens_total %v, want %d", v, prompt)
	}
	var reqs float64
	for k, v := range x {
		if strings.HasPrefix(k, "pdkit_requests_total{") {
			reqs += v
		}
	}
	if reqs != n {
		t.Errorf("requests_total sums to %v, want %d", reqs, n)
	}
	if v := x.must(t, "pdkit_time_to_first_token_seconds_count"); v != n {
		t.Errorf("TTFT count %v, want %d", v, n)
	}
	if v := x.must(t, "pdkit_time_to_first_token_seconds_sum"); v <= 0 || v > 60*n {
		t.Errorf("TTFT sum %v implausible", v)
	}
	if v := x.must(t, "pdkit_inter_token_latency_seconds_count"); v != float64(completion-n) {
		t.Errorf("inter-token count %v, want %d", v, completion-n)
	}
	if v := x.must(t, `pdkit_time_to_first_token_seconds_bucket{le="+Inf"}`); v != n {
		t.Errorf("TTFT +Inf bucket %v, want %d", v, n)
	}
	steps := x.must(t, "pdkit_steps_total")
	if steps < float64(completion)/n {
		t.Errorf("steps_total %v below the longest generation", steps)
	}
	if v := x.must(t, "pdkit_step_duration_seconds_count"); v != steps {
		t.Errorf("step duration count %v, steps_total %v", v, steps)
	}
	for _, r := range []string{"0", "1"} {
		if v := x.must(t, `pdkit_kv_pages_used{rank="`+r+`"}`); v != 0 {
			t.Errorf("rank %s: %v KV pages used after completion", r, v)
		}
		if v := x.must(t, `pdkit_kv_pages_capacity{rank="`+r+`"}`); v != float64(e.eng.Config().Pages()) {
			t.Errorf("rank %s: kv_pages_capacity %v, want %d", r, v, e.eng.Config().Pages())
		}
	}
	// Each rank's time in collectives, per communicator: both ran calls.
	for _, r := range []string{"0", "1"} {
		for _, comm := range []string{serve.CommControl, serve.CommForward} {
			if v := x.must(t, `pdkit_collective_wait_seconds_total{comm="`+comm+`",rank="`+r+`"}`); v <= 0 {
				t.Errorf("rank %s: %s collective wait %v", r, comm, v)
			}
		}
	}
	for _, g := range []string{"pdkit_num_running_reqs", "pdkit_num_waiting_reqs", "pdkit_retractions_total", "pdkit_aborts_total"} {
		if v := x.must(t, g); v != 0 {
			t.Errorf("%s = %v after completion", g, v)
		}
	}
	// Every request's end-to-end latency, under the model's name.
	if v := x.must(t, `pdkit_e2e_request_latency_seconds_count{model="tiny"}`); v != n {
		t.Errorf("e2e latency count %v, want %d", v, n)
	}
	// Every request's queue wait, once.
	if v := x.must(t, `pdkit_queue_time_seconds_count`); v != n {
		t.Errorf("queue time count %v, want %d", v, n)
	}
	// The Go runtime, the process and the build.
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes"} {
		x.must(t, name)
	}
	if !hasPrefix(x, "go_build_info{") {
		t.Error("no go_build_info")
	}
	// What promtool check metrics would say: nothing.
	problems, err := testutil.GatherAndLint(e.srv.opts.Metrics.Registry())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}
