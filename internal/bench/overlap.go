package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

// OverlapConfig chooses what the overlap benchmark measures: the serving
// benchmark's workload (ServingConfig) run on a lock-step and an overlap
// engine side by side. Zero values take the defaults noted per field.
type OverlapConfig struct {
	Home        string        // cache folder for the built-in models
	Arch        string        // built-in architecture (default llama)
	Size        string        // built-in size (default small)
	Type        kernels.DType // weight type (the zero value is F32)
	Threads     []int         // kernel thread counts, one pair of engines each; 0 is every CPU (default 0, 1)
	MaxRunning  int           // requests each engine admits at once (default 64)
	Concurrency []int         // client concurrency levels (default 1, 8, 32, 64)
	PromptLen   int           // prompt tokens per request (default 128)
	MaxTokens   int           // tokens generated per request, EOS ignored (default 64)
	// Requests is the number of requests per level, per round and loop
	// (default max(2×C, 8)).
	Requests int
	// Rounds is how many times each level runs on each loop (default 4).
	// Rounds alternate which loop goes first (lock-step, overlap; then
	// overlap, lock-step; ...), so that a drift of the machine's speed
	// weighs on both alike.
	Rounds int
	// RequestTimeout bounds each request (default 10 minutes).
	RequestTimeout time.Duration
	// Seed chooses the prompts (default 1).
	Seed uint64
}

func (c *OverlapConfig) setDefaults() {
	setDefault(&c.Arch, model.ArchLlama)
	setDefault(&c.Size, builtin.SizeSmall)
	if len(c.Threads) == 0 {
		c.Threads = []int{0, 1}
	}
	c.Threads = slices.Clone(c.Threads)
	for i, th := range c.Threads {
		if th <= 0 {
			c.Threads[i] = runtime.NumCPU()
		}
	}
	setDefault(&c.MaxRunning, 64)
	if len(c.Concurrency) == 0 {
		c.Concurrency = []int{1, 8, 32, 64}
	}
	setDefault(&c.PromptLen, 128)
	setDefault(&c.MaxTokens, 64)
	setDefault(&c.Rounds, 4)
	setDefault(&c.RequestTimeout, 10*time.Minute)
	setDefault(&c.Seed, 1)
}

// requestsAt is the number of requests of one round of concurrency conc.
func (c *OverlapConfig) requestsAt(conc int) int {
	if c.Requests > 0 {
		return c.Requests
	}
	return max(2*conc, 8)
}

// LoopFigures is what one loop measured at one level, over every round.
type LoopFigures struct {
	Requests     int
	OutputTokens int
	Elapsed      time.Duration // the rounds' wall times added up
	TokPerSec    float64       // output tokens over Elapsed
	// ITL in milliseconds, as the serving benchmark measures it: the gaps
	// between successive text chunks a client reads, over every round.
	ITLP50, ITLP99 float64
	// EngineITL in milliseconds: the gaps between successive tokens of a
	// request as the engine emits them (Observer.TokenEmitted), without
	// the HTTP stream in between.
	EngineITLP50, EngineITLP99 float64
	Steps                      StepFigures
}

// StepFigures dissect the engine's decode iterations from rank 0's step
// records. A pair is two decode-only steps in a row (step numbers N and
// N+1); its period is the time from step N's forward pass's start to step
// N+1's, the cadence of the forward passes whichever loop runs them, and
// Forward is step N's forward pass (the records' ForwardStart..ForwardEnd:
// the model's forward and the greedy choice found with its output
// projection).
type StepFigures struct {
	Pairs   int
	Batch   float64       // mean tokens of step N
	Period  time.Duration // mean period
	Forward time.Duration // mean forward pass of step N
	// Before is the mean time from step N's iteration start to its forward
	// pass (the step input, the votes, admissions, room, plan and the
	// batch's preparation); After, from its forward pass's end to step
	// N+1's iteration start (sampling, the results broadcast, streaming
	// and finishing). Under lock-step, Period is Before + Forward + After;
	// under overlap an iteration starts while the step before flies, so
	// they do not add up.
	Before, After time.Duration
}

// Outside is the mean time of a decode iteration spent outside the
// forward pass: scheduling, sampling, streaming, the collectives.
func (s StepFigures) Outside() time.Duration { return s.Period - s.Forward }

// OverlapLevel is one concurrency level on both loops.
type OverlapLevel struct {
	Concurrency       int
	Lockstep, Overlap LoopFigures
	// RoundRatios are overlap's output tok/s over lock-step's in each
	// round, the two loops' runs of a round back to back: their spread is
	// the run's noise, against which TokRatio's distance from 1 is read.
	RoundRatios []float64
}

// RoundSpread is the lowest, median and highest of RoundRatios.
func (l OverlapLevel) RoundSpread() (lo, med, hi float64) {
	r := slices.Sorted(slices.Values(l.RoundRatios))
	if len(r) == 0 {
		return 0, 0, 0
	}
	return r[0], r[len(r)/2], r[len(r)-1]
}

// UpperBound is the one-sided 95% upper confidence bound of the level's
// round ratio (upperBound95 of RoundRatios): below 1, overlap was slower
// than lock-step beyond the run's own noise; at or above 1, a ratio below
// 1 is within it. With fewer than two rounds it is the one ratio.
func (l OverlapLevel) UpperBound() float64 {
	if len(l.RoundRatios) < 2 {
		return l.TokRatio()
	}
	return upperBound95(l.RoundRatios)
}

// upperBound95 is the one-sided 95% upper confidence bound of the mean of
// ratios (at least two), as a ratio: a t bound on their logarithms, so
// that a ratio and its inverse weigh alike.
func upperBound95(ratios []float64) float64 {
	n := len(ratios)
	var mean, ss float64
	for _, r := range ratios {
		mean += math.Log(r)
	}
	mean /= float64(n)
	for _, r := range ratios {
		d := math.Log(r) - mean
		ss += d * d
	}
	sd := math.Sqrt(ss / float64(n-1))
	return math.Exp(mean + tQuantile95(n-1)*sd/math.Sqrt(float64(n)))
}

// tQuantile95 is Student's t distribution's 95th percentile at df degrees
// of freedom (the normal's past 30, slightly narrower than t's).
func tQuantile95(df int) float64 {
	t := [...]float64{6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
		1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
		1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697}
	if df >= 1 && df <= len(t) {
		return t[df-1]
	}
	return 1.645
}

// TokRatio is overlap's output tokens/s over lock-step's: above 1 is faster.
func (l OverlapLevel) TokRatio() float64 { return div(l.Overlap.TokPerSec, l.Lockstep.TokPerSec) }

// ITLRatios are overlap's client inter-token p50 and p99 over lock-step's:
// below 1 is faster.
func (l OverlapLevel) ITLRatios() (p50, p99 float64) {
	return div(l.Overlap.ITLP50, l.Lockstep.ITLP50), div(l.Overlap.ITLP99, l.Lockstep.ITLP99)
}

// EngineITLRatios are the same ratios of the engine's token gaps.
func (l OverlapLevel) EngineITLRatios() (p50, p99 float64) {
	return div(l.Overlap.EngineITLP50, l.Lockstep.EngineITLP50), div(l.Overlap.EngineITLP99, l.Lockstep.EngineITLP99)
}

// OutsideShare is the share of a lock-step decode iteration's wall time
// spent outside the forward pass.
func (l OverlapLevel) OutsideShare() float64 {
	s := l.Lockstep.Steps
	return div(s.Outside().Seconds(), s.Period.Seconds())
}

// Hidden is the share of lock-step's time outside the forward pass that
// the overlap loop took off the decode period, each loop's outside time
// against its own forward pass: 1 − (overlap period − overlap forward) /
// (lock-step period − lock-step forward). 1 is all of it; below 0,
// overlap spent the longer outside. (Comparing the two periods directly
// would weigh the two runs' forward passes, which differ by more than the
// 1 to 2% the outside time is of a step on a busy machine.)
func (l OverlapLevel) Hidden() float64 {
	ls, ov := l.Lockstep.Steps, l.Overlap.Steps
	if ls.Outside() <= 0 {
		return 0
	}
	return 1 - div(ov.Outside().Seconds(), ls.Outside().Seconds())
}

func div(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// OverlapRun is every level at one thread count.
type OverlapRun struct {
	Threads int
	Levels  []OverlapLevel
}

// OverlapReport is a whole overlap benchmark.
type OverlapReport struct {
	Config    OverlapConfig // with its defaults filled in
	Model     model.Config
	ModelFile string
	Runs      []OverlapRun
	// CPUs is what --schedule auto weighs a run's threads against
	// (runtime.GOMAXPROCS when the run began).
	CPUs int
	Took time.Duration
}

// AutoPicks is the loop --schedule auto runs at threads kernel threads
// (one rank) on the report's CPUs.
func (r *OverlapReport) AutoPicks(threads int) string {
	return serve.ResolveSchedule(serve.ScheduleAuto, threads, r.CPUs)
}

// Goal is one of issue 14's speed goals and whether the run met it.
type Goal struct {
	Name   string
	Met    bool
	Detail string
}

// Goals judges the run against the speed goals: overlap's output rate at
// least lock-step's at every level and thread count; the same for the
// loop --schedule auto picks (the default), where it picks overlap; and
// at one thread and concurrency 32 at least 70% of the time outside the
// forward pass hidden. A goal whose level did not run is left out.
func (r *OverlapReport) Goals() []Goal {
	var goals []Goal
	every := func(int) bool { return true }
	if worst, at, ok := r.lowestRatio(every); ok {
		bound, boundAt, _ := r.lowestBound(every)
		goals = append(goals, Goal{Name: "overlap never slower than lock-step (at every level, the 95% upper bound of its round ratios ≥ 1)",
			Met: bound >= 1, Detail: fmt.Sprintf("lowest ratio %.3f (%s), lowest bound %.3f (%s)", worst, at, bound, boundAt)})
	}
	if len(r.Runs) > 0 {
		g := Goal{Name: "the default, --schedule auto, never slower than lock-step (the same, wherever auto picks overlap)", Met: true}
		var picks []string
		for _, run := range r.Runs {
			picks = append(picks, fmt.Sprintf("%s at threads %d", r.AutoPicks(run.Threads), run.Threads))
		}
		g.Detail = fmt.Sprintf("%d CPUs: auto runs %s", r.CPUs, strings.Join(picks, ", "))
		if worst, at, ok := r.lowestRatio(r.autoOverlaps); ok {
			bound, boundAt, _ := r.lowestBound(r.autoOverlaps)
			g.Met = bound >= 1
			g.Detail += fmt.Sprintf("; where it runs overlap, lowest ratio %.3f (%s), lowest bound %.3f (%s)", worst, at, bound, boundAt)
		}
		goals = append(goals, g)
	}
	for _, run := range r.Runs {
		if run.Threads != 1 {
			continue
		}
		for _, l := range run.Levels {
			if l.Concurrency == 32 {
				h := l.Hidden()
				goals = append(goals, Goal{
					Name: "threads 1, concurrency 32: overlap hides ≥ 70% of the time outside the forward pass",
					Met:  h >= 0.7, Detail: fmt.Sprintf("hid %.0f%% of a %.0f%% share", 100*h, 100*l.OutsideShare()),
				})
			}
		}
	}
	return goals
}

// autoOverlaps says whether auto runs overlap at threads.
func (r *OverlapReport) autoOverlaps(threads int) bool {
	return r.AutoPicks(threads) == serve.ScheduleOverlap
}

// lowestRatio is the lowest tok/s ratio over the levels of the runs whose
// thread count counts, and where it was; ok is false when none counts.
func (r *OverlapReport) lowestRatio(counts func(threads int) bool) (worst float64, at string, ok bool) {
	return r.lowest(counts, OverlapLevel.TokRatio)
}

// lowestBound is lowestRatio for the levels' UpperBound.
func (r *OverlapReport) lowestBound(counts func(threads int) bool) (worst float64, at string, ok bool) {
	return r.lowest(counts, OverlapLevel.UpperBound)
}

func (r *OverlapReport) lowest(counts func(threads int) bool, of func(OverlapLevel) float64) (worst float64, at string, ok bool) {
	for _, run := range r.Runs {
		if !counts(run.Threads) {
			continue
		}
		for _, l := range run.Levels {
			if x := of(l); !ok || x < worst {
				worst, at, ok = x, fmt.Sprintf("threads %d, concurrency %d", run.Threads, l.Concurrency), true
			}
		}
	}
	return worst, at, ok
}

// DefaultOK says whether the run supports the default, --schedule auto:
// overlap not slower than lock-step beyond the run's noise wherever auto
// picks it (where it picks lock-step, the default is lock-step itself).
func (r *OverlapReport) DefaultOK() bool {
	bound, _, any := r.lowestBound(r.autoOverlaps)
	return !any || bound >= 1
}

// RunOverlap measures the overlap loop against the lock-step loop on the
// serving benchmark's workload. For each thread count it starts two
// in-process servers over one built-in model, identical but for
// serve.Config.Schedule, warms each with one request, and runs every
// concurrency level Rounds times on each, interleaved: a round runs the
// level on one loop and then the other, with the same prompts (each
// engine has its own prefix cache, so both see fresh prompts), and the
// next round swaps the order. Every figure is over all rounds.
func RunOverlap(ctx context.Context, cfg OverlapConfig, progress io.Writer) (rep OverlapReport, err error) {
	began := time.Now()
	cfg.setDefaults()
	m, path, err := openWorkload(cfg.Home, builtin.Spec{Arch: cfg.Arch, Size: cfg.Size, Seed: builtin.DefaultSeed, Type: cfg.Type}, cfg.Concurrency, cfg.PromptLen, cfg.MaxTokens)
	if err != nil {
		return rep, err
	}
	defer m.Close()
	rep = OverlapReport{Config: cfg, Model: m.Config, ModelFile: path, CPUs: runtime.GOMAXPROCS(0)}
	for _, th := range cfg.Threads {
		run, err := runOverlapThreads(ctx, cfg, m, path, th, progress)
		if err != nil {
			return rep, err
		}
		rep.Runs = append(rep.Runs, run)
	}
	rep.Took = time.Since(began)
	return rep, nil
}

// loopSide is one of a pair of engines, behind its own server.
type loopSide struct {
	schedule string
	probe    *stepProbe
	cl       *client
	stop     func() error
}

// startSide starts an engine on schedule with threads kernel threads, and
// its server.
func startSide(cfg OverlapConfig, m *model.Model, path, schedule string, threads int, progress io.Writer) (*loopSide, error) {
	probe := &stepProbe{}
	eng, err := serve.New(m, serve.Config{
		Backend:    func(int) kernels.Backend { return cpu.New(threads) },
		MaxRunning: cfg.MaxRunning, PageSize: pageSize, KVTokens: kvTokens(cfg.MaxRunning, cfg.PromptLen+cfg.MaxTokens),
		Observer: probe, Schedule: schedule, Name: "bench-" + schedule,
	})
	if err != nil {
		return nil, err
	}
	log := warnLog(progress)
	h := server.New(eng, m, server.Options{ModelPath: path, Logger: log})
	base, stop, err := listen(h, eng, log)
	if err != nil {
		eng.Close()
		return nil, err
	}
	cl := newClient(base, h.ModelName(), slices.Max(cfg.Concurrency), cfg.MaxTokens, cfg.RequestTimeout)
	return &loopSide{schedule: schedule, probe: probe, cl: cl, stop: stop}, nil
}

func (s *loopSide) close() error {
	s.cl.http.CloseIdleConnections()
	return s.stop()
}

// sideTally adds up one loop's rounds at a level.
type sideTally struct {
	fig      LoopFigures
	itl, eng []float64
	steps    pairTally
}

func (t *sideTally) figures() LoopFigures {
	f := t.fig
	if sec := f.Elapsed.Seconds(); sec > 0 {
		f.TokPerSec = float64(f.OutputTokens) / sec
	}
	slices.Sort(t.itl)
	slices.Sort(t.eng)
	f.ITLP50, f.ITLP99 = percentile(t.itl, 50), percentile(t.itl, 99)
	f.EngineITLP50, f.EngineITLP99 = percentile(t.eng, 50), percentile(t.eng, 99)
	f.Steps = t.steps.figures()
	return f
}

func runOverlapThreads(ctx context.Context, cfg OverlapConfig, m *model.Model, path string, threads int, progress io.Writer) (run OverlapRun, err error) {
	run.Threads = threads
	var sides [2]*loopSide // lock-step, overlap
	defer func() {
		for _, s := range sides {
			if s == nil {
				continue
			}
			if cerr := s.close(); cerr != nil && err == nil {
				err = cerr
			}
		}
	}()
	for i, sch := range []string{serve.ScheduleLockstep, serve.ScheduleOverlap} {
		if sides[i], err = startSide(cfg, m, path, sch, threads, progress); err != nil {
			return run, err
		}
	}
	fmt.Fprintf(progress, "overlap vs lock-step: %s %s (%v), %d thread(s), %d round(s) per level\n", cfg.Arch, cfg.Size, cfg.Type, threads, cfg.Rounds)
	prompts := promptSource{seed: cfg.Seed, n: cfg.PromptLen, vocab: m.Config.VocabSize}
	for _, s := range sides {
		if _, err := s.cl.do(ctx, prompts.at(0, 0)); err != nil {
			return run, fmt.Errorf("bench: %s warm-up request: %w", s.schedule, err)
		}
	}
	for li, conc := range cfg.Concurrency {
		var tallies [2]sideTally
		var ratios []float64
		n := cfg.requestsAt(conc)
		for r := range cfg.Rounds {
			level := 1 + li*cfg.Rounds + r // the same prompts on both loops, fresh ones each round
			order := []int{0, 1}
			if r%2 == 1 {
				order = []int{1, 0}
			}
			var rate [2]float64
			for _, i := range order {
				s, t := sides[i], &tallies[i]
				s.probe.reset()
				samples, err := runSamples(ctx, s.cl, conc, n, func(k int) []int { return prompts.at(level, k) })
				if err != nil {
					return run, fmt.Errorf("bench: %s, concurrency %d: %w", s.schedule, conc, err)
				}
				lv := summarize(conc, samples)
				rate[i] = lv.TokPerSec
				t.fig.Requests += lv.Requests
				t.fig.OutputTokens += lv.OutputTokens
				t.fig.Elapsed += lv.Elapsed
				for _, smp := range samples {
					for _, d := range smp.itl {
						t.itl = append(t.itl, ms(d))
					}
				}
				st, gaps := s.probe.take()
				t.steps.add(st)
				for _, d := range gaps {
					t.eng = append(t.eng, ms(d))
				}
			}
			ratios = append(ratios, div(rate[1], rate[0]))
		}
		l := OverlapLevel{Concurrency: conc, Lockstep: tallies[0].figures(), Overlap: tallies[1].figures(), RoundRatios: ratios}
		run.Levels = append(run.Levels, l)
		fmt.Fprintf(progress, "threads %d, c=%d: lock-step %.1f tok/s, overlap %.1f tok/s (%.3fx); decode period %.2f → %.2f ms, forward %.2f ms, hid %.0f%% of a %.0f%% share\n",
			threads, conc, l.Lockstep.TokPerSec, l.Overlap.TokPerSec, l.TokRatio(),
			ms(l.Lockstep.Steps.Period), ms(l.Overlap.Steps.Period), ms(l.Lockstep.Steps.Forward), 100*l.Hidden(), 100*l.OutsideShare())
	}
	return run, nil
}

// pairTally adds up decode pairs.
type pairTally struct {
	pairs                          int
	tokens                         int
	period, forward, before, after time.Duration
}

func (t *pairTally) add(o pairTally) {
	t.pairs += o.pairs
	t.tokens += o.tokens
	t.period += o.period
	t.forward += o.forward
	t.before += o.before
	t.after += o.after
}

func (t pairTally) figures() StepFigures {
	if t.pairs == 0 {
		return StepFigures{}
	}
	n := time.Duration(t.pairs)
	return StepFigures{Pairs: t.pairs, Batch: float64(t.tokens) / float64(t.pairs), Period: t.period / n, Forward: t.forward / n, Before: t.before / n, After: t.after / n}
}

// stepProbe is an engine's Observer during the overlap benchmark: it
// pairs consecutive decode steps of rank 0 by their records, which carry
// when each step's forward pass ran.
type stepProbe struct {
	mu   sync.Mutex
	prev serve.StepRecord
	have bool
	t    pairTally
	gaps []time.Duration
}

func (p *stepProbe) TokenEmitted(_ uint64, gen int, since time.Duration) {
	if gen < 2 {
		return // the first token's gap runs from the submission
	}
	p.mu.Lock()
	p.gaps = append(p.gaps, since)
	p.mu.Unlock()
}

func (p *stepProbe) RequestFinished(uint64, serve.Finish) {}

func (p *stepProbe) StepFinished(rec serve.StepRecord) {
	p.mu.Lock()
	defer p.mu.Unlock()
	prev := p.prev
	if p.have && rec.Phase == "decode" && prev.Phase == "decode" && rec.Step == prev.Step+1 &&
		!rec.ForwardStart.IsZero() && !prev.ForwardStart.IsZero() {
		p.t.pairs++
		p.t.tokens += prev.BatchTokens
		p.t.period += rec.ForwardStart.Sub(prev.ForwardStart)
		p.t.forward += prev.ForwardEnd.Sub(prev.ForwardStart)
		p.t.before += prev.ForwardStart.Sub(prev.Start)
		p.t.after += rec.Start.Sub(prev.ForwardEnd)
	}
	p.prev, p.have = rec, true
}

// reset forgets the last step, so that no pair spans two runs.
func (p *stepProbe) reset() {
	p.mu.Lock()
	p.have = false
	p.mu.Unlock()
}

// take returns what was tallied since the last take and starts over.
func (p *stepProbe) take() (pairTally, []time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	t, g := p.t, p.gaps
	p.t, p.gaps, p.have = pairTally{}, nil, false
	return t, g
}

// Print writes the report: per thread count and level, both loops'
// figures and overlap's ratios, then the dissection of the decode
// iteration, then the goals.
func (r *OverlapReport) Print(w io.Writer) {
	c, mc := r.Config, r.Model
	fmt.Fprintf(w, "\noverlap vs lock-step: built-in %s %s model, %v (dim %d, %d layers, vocab %d), max %d running; %d-token prompts, %d output tokens each (ignore_eos, temperature 0), streamed /v1/completions; %d interleaved round(s) per level and loop; took %s\n\n",
		c.Arch, c.Size, c.Type, mc.Dim, mc.Layers, mc.VocabSize, c.MaxRunning, c.PromptLen, c.MaxTokens, c.Rounds, r.Took.Round(100*time.Millisecond))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "threads\tconcurrency\trequests\tlock-step tok/s\toverlap tok/s\ttok/s ratio\tper round (min med max)\t95%% bound\tITL p50 ratio\tITL p99 ratio\tengine ITL p50 ratio\tengine ITL p99 ratio\t\n")
	for _, run := range r.Runs {
		for _, l := range run.Levels {
			p50, p99 := l.ITLRatios()
			e50, e99 := l.EngineITLRatios()
			lo, med, hi := l.RoundSpread()
			fmt.Fprintf(tw, "%d\t%d\t%d\t%.1f\t%.1f\t%.3f\t%.3f %.3f %.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t\n",
				run.Threads, l.Concurrency, l.Lockstep.Requests, l.Lockstep.TokPerSec, l.Overlap.TokPerSec, l.TokRatio(), lo, med, hi, l.UpperBound(), p50, p99, e50, e99)
		}
	}
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "threads\tconcurrency\tdecode batch\tlock-step period ms\tforward ms\toutside ms\tbefore ms\tafter ms\toutside share\toverlap period ms\toverlap forward ms\thidden\t\n")
	for _, run := range r.Runs {
		for _, l := range run.Levels {
			ls, ov := l.Lockstep.Steps, l.Overlap.Steps
			fmt.Fprintf(tw, "%d\t%d\t%.1f/%.1f\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.0f%%\t%.3f\t%.3f\t%.0f%%\t\n",
				run.Threads, l.Concurrency, ls.Batch, ov.Batch, ms(ls.Period), ms(ls.Forward), ms(ls.Outside()), ms(ls.Before), ms(ls.After), 100*l.OutsideShare(),
				ms(ov.Period), ms(ov.Forward), 100*l.Hidden())
		}
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(w, "ratios: overlap over lock-step, in the same run; tok/s above 1 and ITL below 1 favour overlap; per round: each round's ratio, its two runs back to back")
	fmt.Fprintln(w, "95% bound: the one-sided upper bound of the rounds' mean ratio (t, on logarithms); below 1, overlap was slower beyond the run's noise")
	fmt.Fprintln(w, "ITL: between successive text chunks a client reads; engine ITL: between successive tokens of a request as the engine emits them")
	fmt.Fprintln(w, "period: from a decode step's forward pass's start to the next decode step's (mean over pairs of decode-only steps, rank 0); decode batch: lock-step/overlap")
	fmt.Fprintln(w, "forward: a step's forward pass on rank 0 (the model and the greedy choice found with its output projection); outside = lock-step period − forward (scheduling, sampling, streaming, collectives)")
	fmt.Fprintln(w, "before/after (lock-step): outside split at the forward pass: the step input, votes, admissions, plan and batch before it; sampling, results, streaming and the next input after")
	fmt.Fprintln(w, "hidden: 1 − overlap's outside / lock-step's outside (each loop's period less its own forward pass)")
	fmt.Fprintln(w)
	for _, g := range r.Goals() {
		met := "met"
		if !g.Met {
			met = "NOT met"
		}
		fmt.Fprintf(w, "goal %s: %s (%s)\n", met, g.Name, g.Detail)
	}
	switch goals := r.Goals(); {
	case !r.DefaultOK():
		fmt.Fprintln(w, "verdict: auto picked overlap where it was slower than lock-step beyond the noise: serve.ResolveSchedule's rule needs revisiting")
	case len(goals) > 0 && goals[0].Met:
		fmt.Fprintln(w, "verdict: overlap was nowhere slower than lock-step beyond the noise; auto, the default, runs it where the forward pass leaves a CPU free")
	default:
		fmt.Fprintln(w, "verdict: overlap was slower beyond the noise only where auto, the default, runs lock-step")
	}
}
