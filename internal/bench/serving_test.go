package bench

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
)

// TestRunServingTiny runs the serving benchmark end to end on the tiny
// model: a real server on loopback, streamed requests at two concurrency
// levels. It checks the structure of the figures, never their speed.
func TestRunServingTiny(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cfg := ServingConfig{
		Home: t.TempDir(), Arch: model.ArchLlama, Size: builtin.SizeTiny, Threads: 1, MaxRunning: 8,
		Concurrency: []int{1, 4}, PromptLen: 24, MaxTokens: 6, Requests: 6, RequestTimeout: time.Minute,
	}
	rep, err := RunServing(ctx, cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Levels) != 2 {
		t.Fatalf("%d levels, want 2", len(rep.Levels))
	}
	for i, l := range rep.Levels {
		if l.Concurrency != cfg.Concurrency[i] {
			t.Errorf("level %d has concurrency %d, want %d", i, l.Concurrency, cfg.Concurrency[i])
		}
		if l.Requests != cfg.Requests {
			t.Errorf("c=%d: %d requests completed, want %d", l.Concurrency, l.Requests, cfg.Requests)
		}
		if want := cfg.Requests * cfg.MaxTokens; l.OutputTokens != want {
			t.Errorf("c=%d: %d output tokens, want %d", l.Concurrency, l.OutputTokens, want)
		}
		if l.Chunks < 1 || l.Chunks > l.OutputTokens {
			t.Errorf("c=%d: %d text chunks for %d tokens", l.Concurrency, l.Chunks, l.OutputTokens)
		}
		if !(l.Elapsed > 0 && l.ReqPerSec > 0 && l.TokPerSec > 0 && l.TTFTP50 > 0) {
			t.Errorf("c=%d: a non-positive rate or latency: %+v", l.Concurrency, l)
		}
		if l.TTFTP50 > l.TTFTP99 || l.ITLP50 > l.ITLP99 || l.ITLP50 < 0 {
			t.Errorf("c=%d: percentiles out of order: %+v", l.Concurrency, l)
		}
	}
	if s, ok := rep.Speedup(4); !ok || s <= 0 {
		t.Errorf("Speedup(4) = %v, %v", s, ok)
	}
	if _, ok := rep.Speedup(32); ok {
		t.Error("Speedup(32) reported for a level that did not run")
	}
	checkReport(t, rep.Print, "built-in llama tiny model", "output tok/s", "TTFT p99 ms", "ITL p50 ms")
}

// TestRunServingRefuses checks the settings refused before a server starts.
func TestRunServingRefuses(t *testing.T) {
	base := ServingConfig{Home: t.TempDir(), Size: builtin.SizeTiny}
	bad := base
	bad.Concurrency = []int{1, 0}
	if _, err := RunServing(t.Context(), bad, io.Discard); err == nil {
		t.Error("concurrency 0 accepted")
	}
	bad = base
	bad.PromptLen, bad.MaxTokens = 500, 100 // the tiny context is 512
	if _, err := RunServing(t.Context(), bad, io.Discard); err == nil || !strings.Contains(err.Error(), "context length") {
		t.Errorf("prompt beyond the context: err %v", err)
	}
}

func TestPercentile(t *testing.T) {
	v := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct{ p, want float64 }{
		{50, 5}, {90, 9}, {99, 10}, {100, 10}, {10, 1}, {1, 1}, {0, 1},
	} {
		if got := percentile(v, c.p); got != c.want {
			t.Errorf("percentile(1..10, %v) = %v, want %v", c.p, got, c.want)
		}
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("percentile(nil) = %v, want 0", got)
	}
	if got := percentile([]float64{7}, 99); got != 7 {
		t.Errorf("percentile([7], 99) = %v, want 7", got)
	}
	if got := percentile([]float64{1, 100}, 50); got != 1 {
		t.Errorf("percentile([1 100], 50) = %v, want 1", got)
	}
}

// TestSummarize checks the figures of a level from made-up samples.
func TestSummarize(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	lv := summarize(2, []result{
		{start: at(0), first: at(100), end: at(1000), itl: []time.Duration{10 * time.Millisecond, 30 * time.Millisecond}, chunks: 3, tokens: 4},
		{start: at(500), first: at(700), end: at(2000), itl: []time.Duration{20 * time.Millisecond}, chunks: 2, tokens: 4},
	})
	if lv.Requests != 2 || lv.OutputTokens != 8 || lv.Chunks != 5 || lv.Elapsed != 2*time.Second {
		t.Fatalf("summarize: %+v", lv)
	}
	if lv.ReqPerSec != 1 || lv.TokPerSec != 4 {
		t.Errorf("rates %v req/s, %v tok/s; want 1 and 4", lv.ReqPerSec, lv.TokPerSec)
	}
	if lv.TTFTP50 != 100 || lv.TTFTP99 != 200 || lv.ITLP50 != 20 || lv.ITLP99 != 30 {
		t.Errorf("percentiles %+v", lv)
	}
}

// TestRunServingCancel checks that a cancelled run stops its clients and
// shuts its server down promptly, with the context's error.
func TestRunServingCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cfg := ServingConfig{
		Home: t.TempDir(), Size: builtin.SizeTiny, Threads: 1, MaxRunning: 4,
		Concurrency: []int{4}, PromptLen: 16, MaxTokens: 400, Requests: 100000,
	}
	time.AfterFunc(300*time.Millisecond, cancel)
	start := time.Now()
	_, err := RunServing(ctx, cfg, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Fatalf("err %v, want a cancelled context", err)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("a cancelled run took %v to return", d)
	}
}
