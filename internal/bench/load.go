package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// LoadConfig is one load run against a live cluster through its router:
// Sessions streamed completions sent at once, each of MaxTokens tokens.
type LoadConfig struct {
	URL       string // the router's base URL
	Model     string // the model name the router serves
	Vocab     int    // the model's vocabulary, for the random prompts
	Sessions  int    // concurrent sessions (default 200)
	PromptLen int    // prompt tokens per session (default 64)
	MaxTokens int    // tokens generated per session, EOS ignored (default 400)
	// Timeout bounds each session, from sending it to the end of its
	// stream (default 15 minutes: queued sessions wait their turn).
	Timeout time.Duration
	Seed    uint64
	// Servers are the cluster's servers whose queue time (their
	// pdkit_queue_time_seconds histogram) the report gives, by name.
	Servers []LoadServer
}

// LoadServer is a server of the cluster under load.
type LoadServer struct{ Name, URL string }

// QueueTime is one server's queue wait over a run, estimated from its
// histogram's buckets as Prometheus's histogram_quantile does.
type QueueTime struct {
	Server   string
	P50, P99 float64 // milliseconds
	Requests int
}

func (c *LoadConfig) setDefaults() {
	if c.Sessions == 0 {
		c.Sessions = 200
	}
	if c.PromptLen == 0 {
		c.PromptLen = 64
	}
	if c.MaxTokens == 0 {
		c.MaxTokens = 400
	}
	if c.Timeout == 0 {
		c.Timeout = 15 * time.Minute
	}
	if c.Seed == 0 {
		c.Seed = 1
	}
}

// LoadReport is what a load run measured. Latencies are in milliseconds.
type LoadReport struct {
	Config    LoadConfig
	Completed int // sessions whose stream ended with every token
	// Refused counts sessions the router turned away at the edge (429 or
	// 503 with Retry-After), RefusedP99 how long that answer took.
	Refused    int
	RefusedP99 float64
	// Failed counts the other sessions, Errors their first errors by kind.
	Failed  int
	Errors  map[string]int
	Elapsed time.Duration // first session sent to the last stream's end
	Queue   []QueueTime
	// TokPerSec is the completed sessions' output tokens per second.
	TokPerSec        float64
	TTFTP50, TTFTP99 float64 // session sent to its first text chunk
	E2EP50, E2EP99   float64 // session sent to the end of its stream
}

// refusal is a session the router refused at the edge.
type refusal struct {
	code       int
	retryAfter string
	took       time.Duration
}

func (r *refusal) Error() string {
	return fmt.Sprintf("refused: %d (Retry-After %q)", r.code, r.retryAfter)
}

// RunLoad sends every session at once and waits for all of them.
func RunLoad(ctx context.Context, cfg LoadConfig, progress io.Writer) (LoadReport, error) {
	cfg.setDefaults()
	rep := LoadReport{Config: cfg, Errors: map[string]int{}}
	if cfg.URL == "" || cfg.Vocab < 4 {
		return rep, errors.New("bench: load needs the router's URL and the model's vocabulary")
	}
	tr := &http.Transport{MaxIdleConns: cfg.Sessions + 1, MaxIdleConnsPerHost: cfg.Sessions + 1, DisableCompression: true}
	defer tr.CloseIdleConnections()
	cl := &client{http: &http.Client{Transport: tr}, url: strings.TrimSuffix(cfg.URL, "/") + "/v1/completions",
		model: cfg.Model, maxTokens: cfg.MaxTokens, timeout: cfg.Timeout}
	prompts := promptSource{seed: cfg.Seed, n: cfg.PromptLen, vocab: cfg.Vocab}
	fmt.Fprintf(progress, "load: %d sessions at once × %d tokens against %s\n", cfg.Sessions, cfg.MaxTokens, cfg.URL)

	const queueHist = "pdkit_queue_time_seconds"
	before := make([]buckets, len(cfg.Servers))
	for i, sv := range cfg.Servers {
		b, err := scrapeHistogram(ctx, sv.URL, queueHist)
		if err != nil {
			return rep, err
		}
		before[i] = b
	}
	type outcome struct {
		res     result
		err     error
		refused *refusal
	}
	outs := make([]outcome, cfg.Sessions)
	var wg sync.WaitGroup
	for i := range cfg.Sessions {
		wg.Go(func() {
			res, err := cl.do(ctx, prompts.at(0, i))
			o := outcome{res: res, err: err}
			var se *statusError
			if errors.As(err, &se) && (se.code == http.StatusTooManyRequests || se.code == http.StatusServiceUnavailable) && se.retryAfter != "" {
				o.refused = &refusal{code: se.code, retryAfter: se.retryAfter, took: time.Since(res.start)}
			}
			outs[i] = o
		})
	}
	wg.Wait() // each session is bounded by cfg.Timeout
	var ttft, e2e, refusedMS []float64
	var first, last time.Time
	tokens := 0
	for _, o := range outs {
		switch {
		case o.refused != nil:
			rep.Refused++
			refusedMS = append(refusedMS, ms(o.refused.took))
			continue
		case o.err != nil:
			rep.Failed++
			rep.Errors[errorKind(o.err)]++
			continue
		}
		rep.Completed++
		tokens += o.res.tokens
		ttft = append(ttft, ms(o.res.first.Sub(o.res.start)))
		e2e = append(e2e, ms(o.res.end.Sub(o.res.start)))
		if first.IsZero() || o.res.start.Before(first) {
			first = o.res.start
		}
		if o.res.end.After(last) {
			last = o.res.end
		}
	}
	if rep.Completed > 0 {
		rep.Elapsed = last.Sub(first)
		rep.TokPerSec = float64(tokens) / rep.Elapsed.Seconds()
	}
	for _, v := range [][]float64{ttft, e2e, refusedMS} {
		slices.Sort(v)
	}
	rep.TTFTP50, rep.TTFTP99 = percentile(ttft, 50), percentile(ttft, 99)
	rep.E2EP50, rep.E2EP99 = percentile(e2e, 50), percentile(e2e, 99)
	rep.RefusedP99 = percentile(refusedMS, 99)
	for i, sv := range cfg.Servers {
		after, err := scrapeHistogram(ctx, sv.URL, queueHist)
		if err != nil {
			return rep, err
		}
		inf := math.Inf(1)
		rep.Queue = append(rep.Queue, QueueTime{Server: sv.Name, Requests: int(after[inf] - before[i][inf]),
			P50: 1000 * quantile(before[i], after, 0.50), P99: 1000 * quantile(before[i], after, 0.99)})
	}
	return rep, ctx.Err()
}

// errorKind names an error by its first words, so that a report groups
// the same failure of many sessions.
func errorKind(err error) string {
	s := err.Error()
	if len(s) > 80 {
		s = s[:80] + "…"
	}
	return s
}

// Print writes the report.
func (r *LoadReport) Print(w io.Writer, title string) {
	c := r.Config
	fmt.Fprintf(w, "\n%s: %d sessions at once, %d-token prompts, %d output tokens each (ignore_eos, temperature 0), streamed through the router\n\n",
		title, c.Sessions, c.PromptLen, c.MaxTokens)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "completed\trefused\tfailed\telapsed s\toutput tok/s\tTTFT p50 ms\tTTFT p99 ms\tE2E p50 ms\tE2E p99 ms\trefusal p99 ms\t\n")
	fmt.Fprintf(tw, "%d\t%d\t%d\t%.1f\t%.1f\t%.0f\t%.0f\t%.0f\t%.0f\t%.1f\t\n", r.Completed, r.Refused, r.Failed, r.Elapsed.Seconds(),
		r.TokPerSec, r.TTFTP50, r.TTFTP99, r.E2EP50, r.E2EP99, r.RefusedP99)
	tw.Flush()
	for _, q := range r.Queue {
		fmt.Fprintf(w, "queue time on %s: p50 %.0f ms, p99 %.0f ms over %d requests (from its pdkit_queue_time_seconds buckets)\n", q.Server, q.P50, q.P99, q.Requests)
	}
	kinds := make([]string, 0, len(r.Errors))
	for k := range r.Errors {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(w, "  %d× %s\n", r.Errors[k], k)
	}
}
