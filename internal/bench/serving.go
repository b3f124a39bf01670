package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// ServingConfig chooses what the serving benchmark measures. Zero values
// take the defaults noted per field.
type ServingConfig struct {
	Home        string        // cache folder for the built-in models
	Arch        string        // built-in architecture (default llama)
	Size        string        // built-in size (default small)
	Type        kernels.DType // weight type (the zero value is F32)
	Threads     int           // kernel threads of the engine (default: every CPU)
	MaxRunning  int           // requests the engine admits at once (default 64)
	Concurrency []int         // client concurrency levels (default 1, 8, 32, 64)
	PromptLen   int           // prompt tokens per request (default 128)
	MaxTokens   int           // tokens generated per request, EOS ignored (default 64)
	// Requests is the number of requests per level (default max(2×C, 8)).
	Requests int
	// RequestTimeout bounds each request, from sending it to the end of
	// its stream (default 10 minutes).
	RequestTimeout time.Duration
	// Seed chooses the prompts (default 1).
	Seed uint64
}

// ServingLevel is the outcome of one concurrency level.
type ServingLevel struct {
	Concurrency  int
	Requests     int           // requests completed
	OutputTokens int           // completion tokens, as counted by each request's usage
	Chunks       int           // streamed chunks that carried text
	Elapsed      time.Duration // from the first request sent to the last stream's end
	ReqPerSec    float64
	TokPerSec    float64 // output tokens per second over all clients
	// Latencies in milliseconds. TTFT runs from sending the request to its
	// first text chunk; ITL is the gap between successive text chunks of a
	// request (a token that completes no text, such as a partial UTF-8
	// character or an end-of-generation token, rides with the next chunk).
	TTFTP50, TTFTP99 float64
	ITLP50, ITLP99   float64
	// DecodeTokPerSec is the engine's aggregate decode rate: tokens of its
	// decode-only iterations over those iterations' wall time (scheduling,
	// forward, sampling and streaming included; prefill and mixed steps
	// excluded), the serving counterpart of a batched benchmark's decode
	// figure. DecodeBatch is the mean batch of those iterations.
	DecodeTokPerSec float64
	DecodeBatch     float64
}

// decodeTally adds up the engine's decode-only iterations; it is the
// engine's Observer during a run.
type decodeTally struct {
	mu     sync.Mutex
	tokens int
	steps  int
	busy   time.Duration
}

func (d *decodeTally) TokenEmitted(uint64, int, time.Duration) {}
func (d *decodeTally) RequestFinished(uint64, serve.Finish)    {}
func (d *decodeTally) StepFinished(rec serve.StepRecord) {
	if rec.Phase != "decode" {
		return
	}
	d.mu.Lock()
	d.tokens += rec.BatchTokens
	d.steps++
	d.busy += rec.End.Sub(rec.Start)
	d.mu.Unlock()
}

// take returns the tally so far and starts a new one.
func (d *decodeTally) take() (tokens, steps int, busy time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	tokens, steps, busy = d.tokens, d.steps, d.busy
	d.tokens, d.steps, d.busy = 0, 0, 0
	return
}

// ServingReport is a whole serving run.
type ServingReport struct {
	Config    ServingConfig // with its defaults filled in
	Model     model.Config
	ModelFile string
	Levels    []ServingLevel
}

// Speedup is the aggregate output tokens/s at concurrency c over that at
// concurrency 1; false when either level was not run.
func (r *ServingReport) Speedup(c int) (float64, bool) {
	return r.ratio(c, func(l ServingLevel) float64 { return l.TokPerSec })
}

// DecodeSpeedup is the engine's aggregate decode tokens/s at concurrency c
// over that at concurrency 1.
func (r *ServingReport) DecodeSpeedup(c int) (float64, bool) {
	return r.ratio(c, func(l ServingLevel) float64 { return l.DecodeTokPerSec })
}

func (r *ServingReport) ratio(c int, f func(ServingLevel) float64) (float64, bool) {
	var one, at float64
	var haveOne, haveAt bool
	for _, l := range r.Levels {
		if l.Concurrency == 1 {
			one, haveOne = f(l), true
		}
		if l.Concurrency == c {
			at, haveAt = f(l), true
		}
	}
	if !haveOne || !haveAt || one <= 0 {
		return 0, false
	}
	return at / one, true
}

func (c *ServingConfig) setDefaults() {
	setDefault(&c.Arch, model.ArchLlama)
	setDefault(&c.Size, builtin.SizeSmall)
	setDefault(&c.Threads, runtime.NumCPU())
	setDefault(&c.MaxRunning, 64)
	if len(c.Concurrency) == 0 {
		c.Concurrency = []int{1, 8, 32, 64}
	}
	setDefault(&c.PromptLen, 128)
	setDefault(&c.MaxTokens, 64)
	setDefault(&c.RequestTimeout, 10*time.Minute)
	setDefault(&c.Seed, 1)
}

// requestsAt is the number of requests run at concurrency conc.
func (c *ServingConfig) requestsAt(conc int) int {
	if c.Requests > 0 {
		return c.Requests
	}
	return max(2*conc, 8)
}

// RunServing starts an in-process server (a serve.Engine behind
// internal/server on a loopback listener) over a built-in model and, for
// each concurrency level, has that many clients issue streamed POST
// /v1/completions requests (token-id prompts, temperature 0, ignore_eos)
// until the level's requests are done. One untimed warm-up request runs
// first. The server and the engine are shut down before it returns.
func RunServing(ctx context.Context, cfg ServingConfig, progress io.Writer) (rep ServingReport, err error) {
	cfg.setDefaults()
	m, path, err := openWorkload(cfg.Home, builtin.Spec{Arch: cfg.Arch, Size: cfg.Size, Seed: builtin.DefaultSeed, Type: cfg.Type}, cfg.Concurrency, cfg.PromptLen, cfg.MaxTokens)
	if err != nil {
		return rep, err
	}
	defer m.Close()
	rep = ServingReport{Config: cfg, Model: m.Config, ModelFile: path}

	tally := &decodeTally{}
	eng, err := serve.New(m, serve.Config{Backend: cpuBackends(cfg.Threads), MaxRunning: cfg.MaxRunning, PageSize: pageSize, KVTokens: kvTokens(cfg.MaxRunning, cfg.PromptLen+cfg.MaxTokens), Observer: tally})
	if err != nil {
		return rep, err
	}
	defer eng.Close()

	log := warnLog(progress)
	h := server.New(eng, m, server.Options{ModelPath: path, Logger: log})
	base, stop, err := listen(h, eng, log)
	if err != nil {
		return rep, err
	}
	defer func() {
		if serr := stop(); serr != nil && err == nil {
			err = serr
		}
	}()

	cl := newClient(base, h.ModelName(), slices.Max(cfg.Concurrency), cfg.MaxTokens, cfg.RequestTimeout)
	defer cl.http.CloseIdleConnections()

	fmt.Fprintf(progress, "serving %s (%v, %d thread(s)) on %s\n", h.ModelName(), cfg.Type, cfg.Threads, base)
	prompts := promptSource{seed: cfg.Seed, n: cfg.PromptLen, vocab: m.Config.VocabSize}
	if _, err := cl.do(ctx, prompts.at(0, 0)); err != nil {
		return rep, fmt.Errorf("bench: warm-up request: %w", err)
	}
	for li, conc := range cfg.Concurrency {
		tally.take()
		lv, err := runLevel(ctx, cl, conc, cfg.requestsAt(conc), func(i int) []int { return prompts.at(li+1, i) })
		if err != nil {
			return rep, fmt.Errorf("bench: concurrency %d: %w", conc, err)
		}
		if tokens, steps, busy := tally.take(); steps > 0 && busy > 0 {
			lv.DecodeTokPerSec = float64(tokens) / busy.Seconds()
			lv.DecodeBatch = float64(tokens) / float64(steps)
		}
		rep.Levels = append(rep.Levels, lv)
		fmt.Fprintf(progress, "c=%d: %d requests in %.1fs, %.1f req/s, %.1f output tok/s, TTFT p50 %.1f ms, ITL p50 %.1f ms\n",
			conc, lv.Requests, lv.Elapsed.Seconds(), lv.ReqPerSec, lv.TokPerSec, lv.TTFTP50, lv.ITLP50)
	}
	return rep, nil
}

// listen serves h on a loopback port. stop shuts the server down, closes
// the engine (which ends the streams of handlers the shutdown cut off) and
// waits for every handler, so that the model can be closed after.
func listen(h http.Handler, eng *serve.Engine, log *slog.Logger) (base string, stop func() error, err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	var inflight sync.WaitGroup
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inflight.Add(1)
		defer inflight.Done()
		h.ServeHTTP(w, r)
	})
	srv := &http.Server{Handler: counted, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	stop = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			srv.Close() // cuts the connections; their handlers see their contexts end and abort
		}
		serr := <-done
		cerr := eng.Close()
		inflight.Wait()
		if errors.Is(serr, http.ErrServerClosed) {
			serr = nil
		}
		return errors.Join(serr, cerr)
	}
	return "http://" + ln.Addr().String(), stop, nil
}

// promptSource makes deterministic prompts: request i of level l always
// gets the same token ids.
type promptSource struct {
	seed     uint64
	n, vocab int
}

func (p promptSource) at(level, i int) []int {
	rng := rand.New(rand.NewPCG(p.seed, uint64(level)<<32|uint64(i)))
	ids := make([]int, p.n)
	for k := range ids {
		ids[k] = 3 + rng.IntN(p.vocab-3) // skip the control tokens
	}
	return ids
}

// result is what one streamed request measured.
type result struct {
	start, first, end time.Time
	itl               []time.Duration
	chunks            int
	tokens            int
}

// runLevel runs n requests with conc clients and summarizes them.
func runLevel(ctx context.Context, cl *client, conc, n int, prompt func(int) []int) (ServingLevel, error) {
	samples, err := runSamples(ctx, cl, conc, n, prompt)
	if err != nil {
		return ServingLevel{}, err
	}
	return summarize(conc, samples), nil
}

// runSamples runs n requests with conc clients and returns what each
// measured; the first failure cancels the rest.
func runSamples(ctx context.Context, cl *client, conc, n int, prompt func(int) []int) ([]result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	samples := make([]result, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	var errOnce sync.Once
	var firstErr error
	for range conc {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				s, err := cl.do(ctx, prompt(i))
				if err != nil {
					errOnce.Do(func() { firstErr = fmt.Errorf("request %d: %w", i, err) })
					cancel()
					return
				}
				samples[i] = s
			}
		})
	}
	wg.Wait() // every request is bounded by the client's timeout
	if firstErr != nil {
		return nil, firstErr
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return samples, nil
}

// summarize turns the samples of a level into its figures.
func summarize(conc int, samples []result) ServingLevel {
	lv := ServingLevel{Concurrency: conc, Requests: len(samples)}
	if len(samples) == 0 {
		return lv
	}
	first, last := samples[0].start, samples[0].end
	var ttft, itl []float64
	for _, s := range samples {
		if s.start.Before(first) {
			first = s.start
		}
		if s.end.After(last) {
			last = s.end
		}
		lv.OutputTokens += s.tokens
		lv.Chunks += s.chunks
		ttft = append(ttft, ms(s.first.Sub(s.start)))
		for _, d := range s.itl {
			itl = append(itl, ms(d))
		}
	}
	lv.Elapsed = last.Sub(first)
	if sec := lv.Elapsed.Seconds(); sec > 0 {
		lv.ReqPerSec = float64(lv.Requests) / sec
		lv.TokPerSec = float64(lv.OutputTokens) / sec
	}
	slices.Sort(ttft)
	slices.Sort(itl)
	lv.TTFTP50, lv.TTFTP99 = percentile(ttft, 50), percentile(ttft, 99)
	lv.ITLP50, lv.ITLP99 = percentile(itl, 50), percentile(itl, 99)
	return lv
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// percentile is the nearest-rank p-th percentile (0 < p ≤ 100) of sorted
// values: the smallest value with at least p% of the values at or below
// it. It is 0 for no values.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	k := int(math.Ceil(p / 100 * float64(len(sorted))))
	return sorted[min(max(k, 1), len(sorted))-1]
}

// statusError is a request answered with another status than 200.
type statusError struct {
	code         int
	status, body string
	retryAfter   string
}

func (e *statusError) Error() string { return fmt.Sprintf("status %s: %s", e.status, e.body) }

// client issues the benchmark's requests.
type client struct {
	http      *http.Client
	url       string
	model     string
	maxTokens int
	timeout   time.Duration
}

// streamEvent is any event of a completion stream: a chunk or an error.
type streamEvent struct {
	openai.CompletionChunk
	Error *openai.ErrorDetail `json:"error"`
}

// do sends one streamed completion and reads its stream to the end.
func (c *client) do(ctx context.Context, prompt []int) (result, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	zero, maxTok := 0.0, c.maxTokens
	body, err := json.Marshal(openai.CompletionRequest{
		Model: c.model, Prompt: openai.Prompt{Tokens: prompt}, MaxTokens: &maxTok, Temperature: &zero,
		Stream: true, StreamOptions: &openai.StreamOptions{IncludeUsage: true}, IgnoreEOS: true,
	})
	if err != nil {
		return result{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, bytes.NewReader(body))
	if err != nil {
		return result{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	s := result{start: time.Now()}
	resp, err := c.http.Do(req)
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return s, &statusError{code: resp.StatusCode, status: resp.Status, body: strings.TrimSpace(string(b)), retryAfter: resp.Header.Get("Retry-After")}
	}
	var prev time.Time
	finish, usage, done := "", false, false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for !done && sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue // blank separators
		}
		now := time.Now()
		if data == "[DONE]" {
			done = true
			break
		}
		var ev streamEvent
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return s, fmt.Errorf("bad stream event %q: %w", data, err)
		}
		if ev.Error != nil {
			return s, fmt.Errorf("stream error: %s", ev.Error.Message)
		}
		if ev.Usage != nil {
			s.tokens, usage = ev.Usage.CompletionTokens, true
		}
		for _, ch := range ev.Choices {
			if ch.Text != "" {
				s.chunks++
				if prev.IsZero() {
					s.first = now
				} else {
					s.itl = append(s.itl, now.Sub(prev))
				}
				prev = now
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
				if s.first.IsZero() {
					s.first = now // no text at all: the finish is the first answer
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return s, err
	}
	s.end = time.Now()
	switch {
	case !done:
		return s, errors.New("stream ended without [DONE]")
	case !usage:
		return s, errors.New("stream carried no usage")
	case finish != openai.FinishLength:
		return s, fmt.Errorf("finish reason %q, want %q", finish, openai.FinishLength)
	}
	return s, nil
}

// Print writes the report as a table.
func (r *ServingReport) Print(w io.Writer) {
	c, mc := r.Config, r.Model
	fmt.Fprintf(w, "\nserving: built-in %s %s model, %v (dim %d, %d layers, vocab %d), %d engine thread(s), max %d running; %d-token prompts, %d output tokens each (ignore_eos, temperature 0), streamed /v1/completions\n\n",
		c.Arch, c.Size, c.Type, mc.Dim, mc.Layers, mc.VocabSize, c.Threads, c.MaxRunning, c.PromptLen, c.MaxTokens)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "concurrency\trequests\treq/s\toutput tok/s\tvs c=1\tdecode tok/s\tdecode batch\tvs c=1\tTTFT p50 ms\tTTFT p99 ms\tITL p50 ms\tITL p99 ms\t\n")
	ratio := func(s float64, ok bool) string {
		if !ok {
			return "-"
		}
		return fmt.Sprintf("%.1fx", s)
	}
	for _, l := range r.Levels {
		vs := ratio(r.Speedup(l.Concurrency))
		dvs := ratio(r.DecodeSpeedup(l.Concurrency))
		fmt.Fprintf(tw, "%d\t%d\t%.2f\t%.1f\t%s\t%.1f\t%.1f\t%s\t%.1f\t%.1f\t%.1f\t%.1f\t\n",
			l.Concurrency, l.Requests, l.ReqPerSec, l.TokPerSec, vs, l.DecodeTokPerSec, l.DecodeBatch, dvs, l.TTFTP50, l.TTFTP99, l.ITLP50, l.ITLP99)
	}
	tw.Flush()
	fmt.Fprintln(w)
	if s, ok := r.Speedup(32); ok {
		fmt.Fprintf(w, "aggregate output tok/s at concurrency 32 is %.1fx that at concurrency 1\n", s)
	}
	if s, ok := r.DecodeSpeedup(32); ok {
		fmt.Fprintf(w, "aggregate decode tok/s at concurrency 32 is %.1fx the single-stream decode rate\n", s)
	}
	fmt.Fprintln(w, "decode tok/s: tokens of the engine's decode-only iterations over their wall time (scheduling, forward, sampling, streaming)")
	fmt.Fprintln(w, "TTFT: request sent to first text chunk; ITL: between successive text chunks of a request; rates over each level's wall time")
}

// cpuBackends gives each rank of an engine a cpu backend of threads threads.
func cpuBackends(threads int) func(int) kernels.Backend {
	return func(int) kernels.Backend { return cpu.New(threads) }
}
