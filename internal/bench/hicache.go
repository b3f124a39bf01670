package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"slices"
	"sort"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
)

// HiCacheConfig chooses what the HiCache benchmark measures (`pdserve bench
// hicache`). Zero values take the defaults noted per field.
//
// The incident part reproduces production incident 3 (the HiCache index-K
// race): Sessions concurrent multi-turn sessions over one shared system
// prefix, scripted histories, greedy decoding, a device KV pool sized from
// the prompts so small that prefixes go to the host tier and come back. Its
// cells are index-K precision × fault switch. The speed part measures a host
// hit against recomputing the same prefix, and the loader's copy rate against
// a plain copy.
type HiCacheConfig struct {
	Home string // cache folder for the built-in models
	// Arch is the built-in architecture, one with the sparse indexer
	// (default llama-dsa; deepseek2-dsa is the seed's model family).
	Arch string
	Size string        // built-in size (default small)
	Type kernels.DType // weight type (the zero value is F32)
	// KVType is the element type the pools store K and V (or the latent)
	// in: F32 (the zero value), BF16 or F16.
	KVType  kernels.DType
	TP      int // tensor-parallel ranks (default 1)
	Threads int // kernel threads per rank (default: every CPU / TP, at least 1)
	// PageSize is the KV page size in tokens (default 16).
	PageSize int
	// MaxTokens is the greedy tokens generated per request, EOS ignored
	// (default 8).
	MaxTokens int
	// RequestTimeout bounds each request, queueing included (default 5
	// minutes); one that runs out counts as a timeout.
	RequestTimeout time.Duration
	// Policy is the host tier's write policy (default write-through).
	Policy prefix.Policy
	// Seed chooses every prompt (default 1).
	Seed uint64

	// SkipIncident leaves the incident part out.
	SkipIncident bool
	// Sessions is the number of concurrent sessions (default 60).
	Sessions int
	// RequestsPerCell is the requests of each run of a cell (default 1000):
	// conversations of Turns turns, handed out to the sessions in turn.
	RequestsPerCell int
	// Runs is the number of runs of each fault-on cell (default 3).
	Runs int
	// Turns is the turns of one conversation (default 6).
	Turns int
	// System is the shared system prefix in tokens (default the model's
	// indexer top-k + 32, so that the indexer reads index-K from the first
	// turn on).
	System int
	// MaxRunning is the requests the engine admits at once (default 8).
	MaxRunning int
	// Precisions are the index-K precisions (default fp8 and bf16).
	Precisions []kernels.IndexKDType
	// Fault adds the fault-on cells (hicache-indexk-ungated). It is
	// refused in a binary built with the race detector: the fault is a data
	// race by design.
	Fault bool
	// LoadBandwidths are the loader pacings of the incident cells,
	// bytes/second per rank (0: unlimited); every precision and fault runs
	// at each (default unlimited only).
	LoadBandwidths []int64

	// SkipSpeed leaves the speed part out.
	SkipSpeed bool
	// Prefix is each speed session's own prefix in tokens (default 1024).
	Prefix int
	// SpeedSessions is the speed part's sessions, taking turns (default 4).
	SpeedSessions int
	// SpeedTurns is the measured turns of each speed session (default 8).
	SpeedTurns int

	// SkipPolicies leaves the write-policy part out.
	SkipPolicies bool
	// Policies are the write policies the policy part compares, each
	// against HiCache off (default all three).
	Policies []prefix.Policy
	// PolicyPrompts distinct prompts of PolicyPrompt tokens are each sent
	// PolicyRounds times, in rounds, MaxRunning at a time, on a device
	// pool of two such prompts (defaults 12, 249 and 3).
	PolicyPrompts, PolicyPrompt, PolicyRounds int
	// PolicyTokens is the greedy tokens of each of its requests, the
	// decode that the backups run beside (default 32).
	PolicyTokens int
}

// The speed part's goals.
const (
	// HiCacheTTFTGoal: a host hit's TTFT p50 at most this share of
	// recomputing the prefix.
	HiCacheTTFTGoal = 0.5
	// HiCacheCopyGoal: the loader's copy rate at least this share of a
	// plain copy of the same bytes.
	HiCacheCopyGoal = 0.5
)

// speedMsg is the tokens of each turn's user message in the speed part.
const speedMsg = 16

func (c *HiCacheConfig) setDefaults(mc model.Config) {
	setDefault(&c.Size, builtin.SizeSmall)
	setDefault(&c.TP, 1)
	setDefault(&c.Threads, max(1, runtime.NumCPU()/c.TP))
	setDefault(&c.PageSize, 16)
	setDefault(&c.MaxTokens, 8)
	setDefault(&c.RequestTimeout, 5*time.Minute)
	setDefault(&c.Seed, 1)
	setDefault(&c.Sessions, 60)
	setDefault(&c.RequestsPerCell, 1000)
	setDefault(&c.Runs, 3)
	setDefault(&c.Turns, 6)
	if mc.Indexer != nil {
		setDefault(&c.System, mc.Indexer.TopK+32)
	}
	setDefault(&c.MaxRunning, 8)
	if len(c.Precisions) == 0 {
		c.Precisions = []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16}
	}
	if len(c.LoadBandwidths) == 0 {
		c.LoadBandwidths = []int64{0}
	}
	setDefault(&c.Prefix, 1024)
	setDefault(&c.SpeedSessions, 4)
	setDefault(&c.SpeedTurns, 8)
	if len(c.Policies) == 0 {
		c.Policies = slices.Clone(prefix.Policies)
	}
	setDefault(&c.PolicyPrompts, 12)
	setDefault(&c.PolicyPrompt, 249)
	setDefault(&c.PolicyRounds, 3)
	setDefault(&c.PolicyTokens, 32)
}

// HiCacheRun is one run of the incident workload on a fresh engine.
type HiCacheRun struct {
	Requests  int // submitted
	Compared  int // ended with every token and compared with their reference
	Differ    int // of those, outputs that differ from the reference
	Timeouts  int
	Errors    int            // ended otherwise (abort, error)
	ErrorKind map[string]int // finish reasons of the errors
	// The host tier's totals, rank 0 (hits are agreed by every rank).
	HostHits, HitTokens uint64
	Loads, LoadBytes    uint64
	LoadSeconds         float64
	// Seconds the forward pass waited at the KV and index-K gates (rank 0,
	// every layer).
	WaitKV, WaitIndexK float64
	// Steps and StepSeconds are rank 0's forward steps and their time.
	Steps       int
	StepSeconds float64
	Elapsed     time.Duration
	// FirstDiffer is the first differing request: conversation, turn.
	FirstDiffer string
}

// Share is the share of compared outputs that differ.
func (r HiCacheRun) Share() float64 {
	return ratio(float64(r.Differ), float64(r.Compared))
}

// LoadPerStep is a load's mean duration (pacing included) over a forward
// step's: the copy-to-compute ratio the run had.
func (r HiCacheRun) LoadPerStep() float64 {
	if r.Loads == 0 || r.Steps == 0 || r.StepSeconds == 0 {
		return 0
	}
	return (r.LoadSeconds / float64(r.Loads)) / (r.StepSeconds / float64(r.Steps))
}

// HiCacheCell is one cell: an index-K precision with the fault off or on,
// at a loader pacing, over one or more runs.
type HiCacheCell struct {
	IndexK        kernels.IndexKDType
	Fault         bool
	LoadBandwidth int64 // bytes/s per rank, 0 unlimited
	Runs          []HiCacheRun
}

// Shares is the mean, min and max share of differing outputs over the runs.
func (c HiCacheCell) Shares() (mean, lo, hi float64) {
	if len(c.Runs) == 0 {
		return 0, 0, 0
	}
	lo, hi = c.Runs[0].Share(), c.Runs[0].Share()
	for _, r := range c.Runs {
		s := r.Share()
		mean += s
		lo, hi = min(lo, s), max(hi, s)
	}
	return mean / float64(len(c.Runs)), lo, hi
}

// sum adds up the runs' counts.
func (c HiCacheCell) sum() (t HiCacheRun) {
	for _, r := range c.Runs {
		t.Requests += r.Requests
		t.Compared += r.Compared
		t.Differ += r.Differ
		t.Timeouts += r.Timeouts
		t.Errors += r.Errors
		t.HostHits += r.HostHits
		t.HitTokens += r.HitTokens
		t.Loads += r.Loads
		t.LoadSeconds += r.LoadSeconds
		t.WaitIndexK += r.WaitIndexK
		t.Steps += r.Steps
		t.StepSeconds += r.StepSeconds
		t.Elapsed += r.Elapsed
	}
	return t
}

// HiCacheSpeed is the speed part's figures. Latencies in milliseconds.
type HiCacheSpeed struct {
	PoolTokens int // the device pool, tokens per rank
	// Measured is the measured turns of each setup; Hits how many of the
	// HiCache-on ones were host hits (only those count in HitP50/P99).
	Measured, Hits int
	// HitTokens is the mean tokens a measured host hit loaded back.
	HitTokens float64
	// Computed is the mean prompt tokens computed per measured request:
	// with the tier (hits) and without it (recompute).
	HitComputed, RecomputeComputed float64
	HitP50, HitP99                 float64
	RecomputeP50, RecomputeP99     float64
	// The loader at unlimited pacing, rank 0: loads, bytes and seconds over
	// the HiCache-on run, and its rate; CopyMBs is a plain Go copy of the
	// same bytes in the same run.
	Loads       uint64
	LoadBytes   uint64
	LoadSeconds float64
	LoaderMBs   float64
	CopyMBs     float64
}

// TTFTRatio is a host hit's TTFT p50 over recompute's.
func (s HiCacheSpeed) TTFTRatio() float64 {
	return ratio(s.HitP50, s.RecomputeP50)
}

// CopyRatio is the loader's rate over the plain copy's.
func (s HiCacheSpeed) CopyRatio() float64 {
	return ratio(s.LoaderMBs, s.CopyMBs)
}

// HiCacheReport is a whole HiCache benchmark run.
type HiCacheReport struct {
	Config    HiCacheConfig // with its defaults filled in
	Model     model.Config
	ModelFile string
	// The incident part's shape: prompt lengths and the pools.
	PromptMin, PromptMax, PromptMean int
	PoolTokens                       int     // device pool, tokens per rank
	HostRatio                        float64 // host pool / device pool
	RefSeconds                       float64 // computing the references, all precisions
	Cells                            []HiCacheCell
	Speed                            *HiCacheSpeed
	Policies                         *HiCachePolicies
}

// FaultOffDiffer is the differing outputs over every fault-off cell.
func (r *HiCacheReport) FaultOffDiffer() int {
	n := 0
	for _, c := range r.Cells {
		if !c.Fault {
			n += c.sum().Differ
		}
	}
	return n
}

// ErrRaceDetector: the fault-on cells do not run under the race detector.
var ErrRaceDetector = errors.New("bench: the hicache-indexk-ungated fault is a data race by design: build the benchmark without -race to run it")

// RunHiCache runs the benchmark on a built-in model with a sparse-attention
// indexer (llama-dsa by default) in process.
func RunHiCache(ctx context.Context, cfg HiCacheConfig, progress io.Writer) (rep HiCacheReport, err error) {
	setDefault(&cfg.Arch, model.ArchLlamaDSA)
	setDefault(&cfg.Size, builtin.SizeSmall)
	mc, err := builtin.Shape(cfg.Arch, cfg.Size)
	if err != nil {
		return rep, err
	}
	if mc.Indexer == nil {
		return rep, fmt.Errorf("bench: architecture %s has no sparse indexer: the HiCache benchmark needs one (llama-dsa or deepseek2-dsa)", cfg.Arch)
	}
	cfg.setDefaults(mc)
	if cfg.Fault && raceDetector {
		return rep, ErrRaceDetector
	}
	if err := mc.CheckShards(cfg.TP); err != nil {
		return rep, fmt.Errorf("bench: tp %d: %w", cfg.TP, err)
	}
	if cfg.System <= mc.Indexer.TopK {
		return rep, fmt.Errorf("bench: a system prefix of %d tokens is within the indexer's top-k %d: the indexer would never read index-K", cfg.System, mc.Indexer.TopK)
	}
	if n := cfg.Prefix + (2+cfg.SpeedTurns)*speedMsg + cfg.MaxTokens; !cfg.SkipSpeed && n > mc.ContextLen {
		return rep, fmt.Errorf("bench: the speed part's prompts (%d-token prefix, %d turns of %d tokens) plus %d to generate exceed the context length %d", cfg.Prefix, 2+cfg.SpeedTurns, speedMsg, cfg.MaxTokens, mc.ContextLen)
	}
	m, path, err := openBuiltin(cfg.Home, builtin.Spec{Arch: cfg.Arch, Size: cfg.Size, Seed: builtin.DefaultSeed, Type: cfg.Type})
	if err != nil {
		return rep, err
	}
	defer m.Close()
	rep = HiCacheReport{Config: cfg, Model: m.Config, ModelFile: path}
	log := warnLog(progress)
	fmt.Fprintf(progress, "hicache bench: %s %s (%v, KV %s), TP %d, %d thread(s) per rank\n", cfg.Arch, cfg.Size, cfg.Type, kernels.KVName(cfg.KVType), cfg.TP, cfg.Threads)
	if !cfg.SkipIncident {
		if err := runIncident(ctx, m, &rep, log, progress); err != nil {
			return rep, err
		}
	}
	if !cfg.SkipSpeed {
		sp, err := runHiCacheSpeed(ctx, m, cfg, log, progress)
		if err != nil {
			return rep, err
		}
		rep.Speed = &sp
	}
	if !cfg.SkipPolicies {
		pp, err := runHiCachePolicies(ctx, m, cfg, log, progress)
		if err != nil {
			return rep, err
		}
		rep.Policies = &pp
	}
	return rep, nil
}

// hcScript is the incident's workload: conversations over one system
// prefix, each turn's prompt the previous one plus a scripted reply and a
// new user message (never the model's own output, so that every prompt is
// known up front).
type hcScript struct {
	convs [][][]int32 // conversation → turn → prompt
}

func newScript(seed uint64, sysLen, requests, turns, vocab int) hcScript {
	sys := randTokens(rand.New(rand.NewPCG(seed, 0)), sysLen, vocab)
	var s hcScript
	for c := 0; requests > 0; c++ {
		rng := rand.New(rand.NewPCG(seed, uint64(c)+1))
		prompt := slices.Clone(sys)
		var conv [][]int32
		for t := 0; t < turns && requests > 0; t++ {
			if t > 0 {
				prompt = append(prompt, randTokens(rng, 8+rng.IntN(17), vocab)...) // the scripted reply
			}
			prompt = append(prompt, randTokens(rng, 6+rng.IntN(9), vocab)...) // the user's message
			conv = append(conv, slices.Clone(prompt))
			requests--
		}
		s.convs = append(s.convs, conv)
	}
	return s
}

func (s hcScript) lengths() (lo, hi, mean int) {
	lo, n, sum := 1<<30, 0, 0
	for _, c := range s.convs {
		for _, p := range c {
			lo, hi = min(lo, len(p)), max(hi, len(p))
			sum += len(p)
			n++
		}
	}
	return lo, hi, sum / max(n, 1)
}

// hcOutcome is one request's end.
type hcOutcome struct {
	tokens []int32
	reason string // the finish reason; "timeout" when the request ran out of time
	ttft   time.Duration
}

// hcDo runs one greedy request to its end.
func hcDo(ctx context.Context, e *serve.Engine, prompt []int32, maxTok int, timeout time.Duration) (hcOutcome, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	st, err := e.Submit(ctx, serve.Request{Prompt: prompt, MaxTokens: maxTok, IgnoreEOS: true})
	if err != nil {
		return hcOutcome{}, err
	}
	var o hcOutcome
	for ev := range st.Events { // ctx ending aborts the request, which ends the stream
		if ev.Finish != nil {
			o.reason = ev.Finish.Reason
			break
		}
		if o.tokens == nil {
			o.ttft = time.Since(start)
		}
		o.tokens = append(o.tokens, ev.Token)
	}
	if o.reason != "length" && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		o.reason = "timeout"
	}
	return o, nil
}

// hcEngineConfig is what every engine of the benchmark shares.
func hcEngineConfig(cfg HiCacheConfig, log *slog.Logger) serve.Config {
	return serve.Config{TP: cfg.TP, Backend: cpuBackends(cfg.Threads), PageSize: cfg.PageSize, KVType: cfg.KVType,
		RequestTimeout: cfg.RequestTimeout, Name: "bench-hicache", Logger: log}
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// runIncident computes the references and runs every cell.
func runIncident(ctx context.Context, m *model.Model, rep *HiCacheReport, log *slog.Logger, progress io.Writer) error {
	cfg := rep.Config
	script := newScript(cfg.Seed, cfg.System, cfg.RequestsPerCell, cfg.Turns, m.Config.VocabSize)
	rep.PromptMin, rep.PromptMax, rep.PromptMean = script.lengths()
	if n := rep.PromptMax + cfg.MaxTokens; n > m.Config.ContextLen {
		return fmt.Errorf("bench: the longest prompt (%d tokens) plus %d to generate exceeds the context length %d", rep.PromptMax, cfg.MaxTokens, m.Config.ContextLen)
	}
	// The device pool: room for MaxRunning requests of the longest
	// prompt, so that everything runs, and nothing more: the sessions'
	// histories (Sessions × the mean prompt) are many times that, so they
	// leave the device between a session's turns. The host pool holds
	// every session's history.
	perReq := roundUp(rep.PromptMax+cfg.MaxTokens, cfg.PageSize)
	rep.PoolTokens = cfg.MaxRunning * perReq
	rep.HostRatio = float64(2 + (cfg.Sessions*perReq)/rep.PoolTokens)
	fmt.Fprintf(progress, "incident: %d sessions, %d requests per run (%d conversations of up to %d turns), prompts %d–%d tokens over a %d-token system prefix; device pool %d tokens per rank, host pool %.0f× that\n",
		cfg.Sessions, cfg.RequestsPerCell, len(script.convs), cfg.Turns, rep.PromptMin, rep.PromptMax, cfg.System, rep.PoolTokens, rep.HostRatio)

	for _, ik := range cfg.Precisions {
		start := time.Now()
		refs, err := hcReferences(ctx, m, cfg, ik, script, perReq, log, progress)
		if err != nil {
			return err
		}
		rep.RefSeconds += time.Since(start).Seconds()
		fmt.Fprintf(progress, "%v: %d references in %.1fs\n", ik, cfg.RequestsPerCell, time.Since(start).Seconds())
		faults := []bool{false}
		if cfg.Fault {
			faults = append(faults, true)
		}
		for _, bw := range cfg.LoadBandwidths {
			for _, fault := range faults {
				cell := HiCacheCell{IndexK: ik, Fault: fault, LoadBandwidth: bw}
				runs := 1
				if fault {
					runs = cfg.Runs
				}
				for i := range runs {
					r, err := hcIncidentRun(ctx, m, cfg, rep, ik, bw, fault, script, refs, log)
					if err != nil {
						return err
					}
					cell.Runs = append(cell.Runs, r)
					fmt.Fprintf(progress, "%v, fault %s, loader %s, run %d: %d of %d outputs differ (%.1f%%), %d timeouts, %d errors; %d host hits, %d hit tokens; load/step %.2f; %.1fs\n",
						ik, onOff(fault), rateString(bw), i+1, r.Differ, r.Compared, 100*r.Share(), r.Timeouts, r.Errors, r.HostHits, r.HitTokens, r.LoadPerStep(), r.Elapsed.Seconds())
				}
				rep.Cells = append(rep.Cells, cell)
			}
		}
	}
	return nil
}

// hcReferences runs every prompt of the script alone (one request at a
// time) on an engine with the prefix cache and HiCache off.
func hcReferences(ctx context.Context, m *model.Model, cfg HiCacheConfig, ik kernels.IndexKDType, script hcScript, perReq int, log *slog.Logger, progress io.Writer) ([][][]int32, error) {
	ec := hcEngineConfig(cfg, log)
	ec.IndexK, ec.DisablePrefixCache, ec.MaxRunning, ec.KVTokens = ik, true, 1, perReq
	ec.Name = "bench-hicache-ref"
	e, err := serve.New(m, ec)
	if err != nil {
		return nil, fmt.Errorf("bench: reference engine: %w", err)
	}
	defer e.Close()
	refs := make([][][]int32, len(script.convs))
	done, total := 0, 0
	for _, c := range script.convs {
		total += len(c)
	}
	last := time.Now()
	for ci, c := range script.convs {
		refs[ci] = make([][]int32, len(c))
		for t, p := range c {
			o, err := hcDo(ctx, e, p, cfg.MaxTokens, cfg.RequestTimeout)
			if err != nil {
				return nil, fmt.Errorf("bench: reference %d/%d: %w", ci, t, err)
			}
			if o.reason != "length" {
				return nil, fmt.Errorf("bench: reference %d/%d ended %q (engine: %s)", ci, t, o.reason, e.View().Snapshot().Err)
			}
			refs[ci][t] = o.tokens
			done++
			if time.Since(last) > 30*time.Second {
				fmt.Fprintf(progress, "%v: %d of %d references\n", ik, done, total)
				last = time.Now()
			}
		}
	}
	return refs, ctx.Err()
}

// hcIncidentRun runs the workload once on a fresh engine with HiCache on:
// every session runs its conversations turn after turn, all sessions at
// once, and every output is compared with its reference.
func hcIncidentRun(ctx context.Context, m *model.Model, cfg HiCacheConfig, rep *HiCacheReport, ik kernels.IndexKDType, bw int64, fault bool, script hcScript, refs [][][]int32, log *slog.Logger) (HiCacheRun, error) {
	steps := &stepTally{}
	ec := hcEngineConfig(cfg, log)
	ec.IndexK, ec.MaxRunning, ec.KVTokens, ec.Observer = ik, cfg.MaxRunning, rep.PoolTokens, steps
	ec.HiCache = serve.HiCacheConfig{Enabled: true, Ratio: rep.HostRatio, Policy: cfg.Policy, LoadBandwidth: bw}
	if fault {
		ec.Faults = []string{serve.FaultHiCacheIndexKUngated}
	}
	e, err := serve.New(m, ec)
	if err != nil {
		return HiCacheRun{}, fmt.Errorf("bench: hicache engine: %w", err)
	}
	defer e.Close()
	out := make([][]hcOutcome, len(script.convs))
	for ci, c := range script.convs {
		out[ci] = make([]hcOutcome, len(c))
	}
	var wg sync.WaitGroup
	var errOnce sync.Once
	var firstErr error
	start := time.Now()
	for s := range cfg.Sessions {
		wg.Go(func() {
			for ci := s; ci < len(script.convs); ci += cfg.Sessions {
				for t, p := range script.convs[ci] {
					o, err := hcDo(ctx, e, p, cfg.MaxTokens, cfg.RequestTimeout)
					if err != nil {
						errOnce.Do(func() { firstErr = fmt.Errorf("bench: conversation %d turn %d: %w", ci, t, err) })
						return
					}
					out[ci][t] = o
				}
			}
		})
	}
	wg.Wait()
	r := HiCacheRun{Elapsed: time.Since(start), ErrorKind: map[string]int{}}
	if firstErr != nil {
		return r, firstErr
	}
	if err := ctx.Err(); err != nil {
		return r, err
	}
	for ci, c := range out {
		for t, o := range c {
			r.Requests++
			switch o.reason {
			case "length":
				r.Compared++
				if !slices.Equal(o.tokens, refs[ci][t]) {
					if r.Differ == 0 {
						r.FirstDiffer = fmt.Sprintf("conversation %d turn %d", ci, t)
					}
					r.Differ++
				}
			case "timeout":
				r.Timeouts++
			default:
				r.Errors++
				r.ErrorKind[o.reason]++
			}
		}
	}
	ts, err := quietTier(ctx, e, uint64(r.Requests))
	if err != nil {
		return r, err
	}
	t := ts.Totals
	r.HostHits, r.HitTokens, r.Loads, r.LoadBytes, r.LoadSeconds = t.HostHits, t.HitTokens, t.Loads, t.LoadBytes, t.LoadSeconds
	for i := range ts.WaitKVSeconds {
		r.WaitKV += ts.WaitKVSeconds[i]
		r.WaitIndexK += ts.WaitIndexKSeconds[i]
	}
	n, busy := steps.take()
	r.Steps, r.StepSeconds = n, busy.Seconds()
	return r, nil
}

// stepTally adds up rank 0's forward steps; it is a run's engine Observer.
type stepTally struct {
	mu    sync.Mutex
	steps int
	busy  time.Duration
}

func (d *stepTally) TokenEmitted(uint64, int, time.Duration) {}
func (d *stepTally) RequestFinished(uint64, serve.Finish)    {}
func (d *stepTally) StepFinished(rec serve.StepRecord) {
	d.mu.Lock()
	d.steps++
	d.busy += rec.End.Sub(rec.Start)
	d.mu.Unlock()
}

func (d *stepTally) take() (steps int, busy time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.steps, d.busy
}

// quietTier waits until the engine published the end of its finished
// requests (n in all) and has no load in flight, and returns rank 0's tier
// snapshot of then. Rank 0 publishes its tier before its engine snapshot,
// so a snapshot that counts every request comes after the tier that did.
func quietTier(ctx context.Context, e *serve.Engine, n uint64) (serve.TierSnapshot, error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		snap := e.View().Snapshot()
		if snap.Err != "" {
			return serve.TierSnapshot{}, fmt.Errorf("bench: the engine stopped: %s", snap.Err)
		}
		if tiers := e.View().HiCache(); snap.Totals.Finished >= n && len(tiers) > 0 && len(tiers[0].Loads) == 0 {
			return tiers[0], nil
		}
		if time.Now().After(deadline) {
			return serve.TierSnapshot{}, fmt.Errorf("bench: the engine did not publish its %d finished requests within 30s", n)
		}
		select {
		case <-ctx.Done():
			return serve.TierSnapshot{}, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// runHiCacheSpeed measures a host hit against recomputing the prefix.
// SpeedSessions sessions, each over its own Prefix-token prefix, take turns
// one request at a time on a device pool that holds one session's prompt,
// so each session's prefix has left the device by its next turn. First
// every session runs two turns back to back (the second one reuses the
// first's prefix on the device, which backs it up under write-through),
// then SpeedTurns rounds of one turn per session are measured: with HiCache
// on, host hits; with it off, the same pool recomputes the prefix.
func runHiCacheSpeed(ctx context.Context, m *model.Model, cfg HiCacheConfig, log *slog.Logger, progress io.Writer) (HiCacheSpeed, error) {
	turns := 2 + cfg.SpeedTurns
	prompts := make([][][]int32, cfg.SpeedSessions) // session → turn → prompt
	for s := range prompts {
		rng := rand.New(rand.NewPCG(cfg.Seed, 1<<32|uint64(s)))
		p := randTokens(rng, cfg.Prefix, m.Config.VocabSize)
		for range turns {
			p = append(p, randTokens(rng, speedMsg, m.Config.VocabSize)...)
			prompts[s] = append(prompts[s], slices.Clone(p))
		}
	}
	var sp HiCacheSpeed
	sp.PoolTokens = roundUp(cfg.Prefix+turns*speedMsg+cfg.MaxTokens, cfg.PageSize) + cfg.PageSize
	fmt.Fprintf(progress, "speed: %d sessions over their own %d-token prefixes, device pool %d tokens per rank; %d measured turns per setup\n",
		cfg.SpeedSessions, cfg.Prefix, sp.PoolTokens, cfg.SpeedSessions*cfg.SpeedTurns)

	type measured struct {
		ttft          time.Duration
		computed, hit int // prompt tokens computed, loaded back from host
	}
	run := func(on bool) ([]measured, serve.TierSnapshot, error) {
		ec := hcEngineConfig(cfg, log)
		ec.MaxRunning, ec.KVTokens = 1, sp.PoolTokens
		if on {
			// The host pool holds every session's prompt.
			ec.HiCache = serve.HiCacheConfig{Enabled: true, Ratio: float64(2 + cfg.SpeedSessions), Policy: cfg.Policy}
		}
		e, err := serve.New(m, ec)
		if err != nil {
			return nil, serve.TierSnapshot{}, fmt.Errorf("bench: speed engine: %w", err)
		}
		defer e.Close()
		var n uint64
		var got []measured
		one := func(p []int32) (measured, error) {
			var before serve.TierSnapshot
			if tiers := e.View().HiCache(); len(tiers) > 0 {
				before = tiers[0]
			}
			snap0 := e.View().Snapshot().Totals
			o, err := hcDo(ctx, e, p, cfg.MaxTokens, cfg.RequestTimeout)
			if err != nil {
				return measured{}, err
			}
			if o.reason != "length" {
				return measured{}, fmt.Errorf("bench: speed request ended %q (engine: %s)", o.reason, e.View().Snapshot().Err)
			}
			n++
			ts, err := quietTier(ctx, e, n)
			if err != nil {
				return measured{}, err
			}
			snap1 := e.View().Snapshot().Totals
			cached := int(snap1.CachedTokens - snap0.CachedTokens)
			return measured{ttft: o.ttft, computed: len(p) - cached, hit: int(ts.Totals.HitTokens - before.Totals.HitTokens)}, nil
		}
		for t := range turns {
			if t == 1 {
				continue // run right after turn 0, below
			}
			for s := range prompts {
				mr, err := one(prompts[s][t])
				if err != nil {
					return nil, serve.TierSnapshot{}, err
				}
				if t == 0 {
					if _, err := one(prompts[s][1]); err != nil {
						return nil, serve.TierSnapshot{}, err
					}
					continue
				}
				got = append(got, mr)
			}
		}
		var ts serve.TierSnapshot
		if on {
			if ts, err = quietTier(ctx, e, n); err != nil {
				return nil, ts, err
			}
		}
		return got, ts, nil
	}
	off, _, err := run(false)
	if err != nil {
		return sp, err
	}
	on, ts, err := run(true)
	if err != nil {
		return sp, err
	}
	sp.Measured = len(on)
	var hitT, recT []float64
	var hitTok, hitComp, recComp int
	for _, mr := range on {
		if mr.hit > 0 {
			sp.Hits++
			hitT = append(hitT, ms(mr.ttft))
			hitTok += mr.hit
			hitComp += mr.computed
		}
	}
	for _, mr := range off {
		recT = append(recT, ms(mr.ttft))
		recComp += mr.computed
	}
	slices.Sort(hitT)
	slices.Sort(recT)
	sp.HitP50, sp.HitP99 = percentile(hitT, 50), percentile(hitT, 99)
	sp.RecomputeP50, sp.RecomputeP99 = percentile(recT, 50), percentile(recT, 99)
	if sp.Hits > 0 {
		sp.HitTokens = float64(hitTok) / float64(sp.Hits)
		sp.HitComputed = float64(hitComp) / float64(sp.Hits)
	}
	if len(off) > 0 {
		sp.RecomputeComputed = float64(recComp) / float64(len(off))
	}
	t := ts.Totals
	sp.Loads, sp.LoadBytes, sp.LoadSeconds = t.Loads, t.LoadBytes, t.LoadSeconds
	if t.LoadSeconds > 0 {
		sp.LoaderMBs = float64(t.LoadBytes) / t.LoadSeconds / 1e6
	}
	sp.CopyMBs = copyRate(int64(t.LoadBytes)) / 1e6
	fmt.Fprintf(progress, "speed: host hit TTFT p50 %.1f ms (%d hits), recompute %.1f ms (%.2fx); loader %.0f MB/s, plain copy %.0f MB/s (%.2f)\n",
		sp.HitP50, sp.Hits, sp.RecomputeP50, sp.TTFTRatio(), sp.LoaderMBs, sp.CopyMBs, sp.CopyRatio())
	return sp, nil
}

// copyRate is the bytes/second of a plain Go copy of n bytes from one
// buffer to another (both written first, so that no page is faulted in
// while timed), the loader's bound: the same bytes the loader moved, in one
// copy, as cold in the caches as a host pool larger than them is (buffers
// beyond copyMax are copied from again, in passes).
func copyRate(n int64) float64 {
	if n <= 0 {
		return 0
	}
	size := min(n, copyMax)
	src, dst := make([]byte, size), make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src)
	start := time.Now()
	for left := n; left > 0; left -= size {
		k := min(left, size)
		copy(dst[:k], src[:k])
	}
	return float64(n) / time.Since(start).Seconds()
}

// copyMax bounds copyRate's buffers.
const copyMax = 1 << 30

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// rateString writes a loader pacing: "unlimited" or bytes/second.
func rateString(bps int64) string {
	if bps <= 0 {
		return "unlimited"
	}
	switch {
	case bps%(1<<30) == 0:
		return fmt.Sprintf("%dGiB/s", bps>>30)
	case bps%(1<<20) == 0:
		return fmt.Sprintf("%dMiB/s", bps>>20)
	case bps%(1<<10) == 0:
		return fmt.Sprintf("%dKiB/s", bps>>10)
	}
	return fmt.Sprintf("%.1fMB/s", float64(bps)/1e6)
}

// Print writes the report.
func (r *HiCacheReport) Print(w io.Writer) {
	c, mc := r.Config, r.Model
	fmt.Fprintf(w, "\nhicache: built-in %s %s model, %v (dim %d, %d layers, indexer top-k %d), KV %s, TP %d, %d thread(s) per rank, page %d tokens, write policy %v, %d greedy tokens per request\n",
		c.Arch, c.Size, c.Type, mc.Dim, mc.Layers, mc.Indexer.TopK, kernels.KVName(c.KVType), c.TP, c.Threads, c.PageSize, c.Policy, c.MaxTokens)
	fmt.Fprintf(w, "bytes per token and layer, one rank: %s\n", tokenBytes(mc, c.TP, c.KVType))
	if !c.SkipIncident {
		fmt.Fprintf(w, "\nincident (HiCache index-K race): %d concurrent sessions, %d requests per run, conversations of %d turns over a %d-token system prefix, prompts %d–%d tokens (mean %d); device pool %d tokens per rank (max %d running), host pool %.0f× it; references: every prompt alone, prefix cache and HiCache off (%.0fs)\n\n",
			c.Sessions, c.RequestsPerCell, c.Turns, c.System, r.PromptMin, r.PromptMax, r.PromptMean, r.PoolTokens, c.MaxRunning, r.HostRatio, r.RefSeconds)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "index-K\tloader pacing\tfault\truns\trequests/run\tdiffer mean\tmin\tmax\tdiffer\ttimeouts\terrors\thost hits/run\thit tokens/run\tload ms\tstep ms\tload/step\tindex-K wait s/run\ts/run\t\n")
		for _, cell := range r.Cells {
			mean, lo, hi := cell.Shares()
			t := cell.sum()
			n := max(len(cell.Runs), 1)
			fmt.Fprintf(tw, "%v\t%s\t%s\t%d\t%d\t%.2f%%\t%.2f%%\t%.2f%%\t%d\t%d\t%d\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t\n",
				cell.IndexK, rateString(cell.LoadBandwidth), onOff(cell.Fault), len(cell.Runs), t.Requests/n, 100*mean, 100*lo, 100*hi,
				t.Differ, t.Timeouts, t.Errors, t.HostHits/uint64(n), t.HitTokens/uint64(n),
				1000*ratio(t.LoadSeconds, float64(t.Loads)), 1000*ratio(t.StepSeconds, float64(t.Steps)), t.LoadPerStep(),
				t.WaitIndexK/float64(n), t.Elapsed.Seconds()/float64(n))
		}
		tw.Flush()
		for _, cell := range r.Cells {
			for i, run := range cell.Runs {
				if run.Differ > 0 {
					fmt.Fprintf(w, "%v, loader %s, fault %s, run %d: first differing output: %s\n", cell.IndexK, rateString(cell.LoadBandwidth), onOff(cell.Fault), i+1, run.FirstDiffer)
				}
				kinds := make([]string, 0, len(run.ErrorKind))
				for k := range run.ErrorKind {
					kinds = append(kinds, k)
				}
				sort.Strings(kinds)
				for _, k := range kinds {
					fmt.Fprintf(w, "%v, loader %s, fault %s, run %d: %d× %s\n", cell.IndexK, rateString(cell.LoadBandwidth), onOff(cell.Fault), i+1, run.ErrorKind[k], k)
				}
			}
		}
		fmt.Fprintln(w, "\ndiffer: share of completed outputs whose greedy tokens differ from the prompt's reference (mean, min and max over the runs); fault: hicache-indexk-ungated (each layer of a loading prefix waits once, as it begins, for its KV alone, and the indexer then reads index-K without waiting for it)")
		fmt.Fprintln(w, "loader pacing: each rank's loads back from host paced to that many bytes per second (unlimited: as fast as the loader copies); load ms: a load's mean duration, pacing included; step ms: a forward step's mean duration (rank 0); load/step: their ratio, the copy-to-compute ratio of the run")
		fmt.Fprintln(w, "index-K wait: seconds the forward pass waited at the index-K gates (0 with the fault on: it does not wait); a request that read stale index-K computes its new tokens' KV from a wrong top-k, and that KV enters the prefix cache, so later turns of its conversation can differ too")
		if n := r.FaultOffDiffer(); n > 0 {
			fmt.Fprintf(w, "FAIL: %d outputs differ with the fault off: HiCache changed what was generated\n", n)
		}
	}
	if p := r.Policies; p != nil {
		p.print(w, c)
	}
	if s := r.Speed; s != nil {
		fmt.Fprintf(w, "\nspeed: %d sessions over their own %d-token prefixes, taking turns one request at a time on a device pool of %d tokens per rank (one session's prompt); %d measured turns per setup, loader pacing unlimited\n\n",
			c.SpeedSessions, c.Prefix, s.PoolTokens, s.Measured)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "setup\trequests\tloaded tokens/req\tcomputed tokens/req\tTTFT p50 ms\tTTFT p99 ms\t\n")
		fmt.Fprintf(tw, "host hit (HiCache on)\t%d\t%.0f\t%.0f\t%.1f\t%.1f\t\n", s.Hits, s.HitTokens, s.HitComputed, s.HitP50, s.HitP99)
		fmt.Fprintf(tw, "recompute (HiCache off)\t%d\t0\t%.0f\t%.1f\t%.1f\t\n", s.Measured, s.RecomputeComputed, s.RecomputeP50, s.RecomputeP99)
		tw.Flush()
		fmt.Fprintln(w)
		fmt.Fprintf(w, "host hit TTFT p50 / recompute p50: %.2f (goal ≤ %.1f: %s); p99: %.2f\n", s.TTFTRatio(), HiCacheTTFTGoal, met(s.TTFTRatio() > 0 && s.TTFTRatio() <= HiCacheTTFTGoal), ratio(s.HitP99, s.RecomputeP99))
		fmt.Fprintf(w, "loader copy rate: %.0f MB/s (%d loads, %.1f MB in %.3fs), plain Go copy of the same bytes: %.0f MB/s; ratio %.2f (goal ≥ %.1f: %s)\n",
			s.LoaderMBs, s.Loads, float64(s.LoadBytes)/1e6, s.LoadSeconds, s.CopyMBs, s.CopyRatio(), HiCacheCopyGoal, met(s.CopyRatio() >= HiCacheCopyGoal))
		if s.Hits < s.Measured {
			fmt.Fprintf(w, "%d of %d measured turns with HiCache on were no host hit and are left out of its TTFT\n", s.Measured-s.Hits, s.Measured)
		}
		fmt.Fprintln(w, "TTFT: submission to the first token; loader copy rate: the engine's HiCache totals, LoadBytes / LoadSeconds (rank 0), while the forward pass runs beside it")
	}
}

// tokenBytes says what one token's KV costs per layer on one rank of tp:
// its K and V rows (or its latent and RoPE key), and index-K in each
// precision with its share of the layer's bytes. The share is the race's
// window: the ungated read overlaps a load of index-K, whose copy time is
// its bytes at the loader's pace.
func tokenBytes(mc model.Config, tp int, kv kernels.DType) string {
	eb := kernels.KVElemBytes(kv)
	var kvBytes int
	var what string
	if ml := mc.MLA; ml != nil {
		kvBytes = (ml.KVRank + mc.RopeDim) * eb
		what = fmt.Sprintf("latent %d B + RoPE key %d B", ml.KVRank*eb, mc.RopeDim*eb)
	} else {
		kvBytes = 2 * mc.RankKVDim(tp) * eb
		what = fmt.Sprintf("K %d B + V %d B", kvBytes/2, kvBytes/2)
	}
	out := what
	if ix := mc.Indexer; ix != nil {
		for _, p := range []struct {
			name  string
			bytes int
		}{{"fp8", ix.Dim + 4}, {"bf16", 2 * ix.Dim}} {
			out += fmt.Sprintf("; index-K %s %d B (%.1f%% of the layer)", p.name, p.bytes, 100*float64(p.bytes)/float64(p.bytes+kvBytes))
		}
	}
	return out
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "not met"
}
