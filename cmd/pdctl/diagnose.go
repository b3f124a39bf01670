package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/diag"
	"github.com/spf13/cobra"
)

type diagnoseOptions struct {
	f        *factory
	Attach   *attachOptions
	Window   time.Duration
	Interval time.Duration
	JSON     bool
	Config   diag.Config
	// Canaries is how many canaries to send during the window (0: none,
	// diagnose stays read-only); CanarySeed generates their prompts (0:
	// from the clock).
	Canaries   int
	CanarySeed uint64
	// Rehash asks every server to rehash its whole model file first.
	Rehash bool
	// SaveWindow is a file to write the sampled window to, as JSON (the
	// rules' input); empty: none.
	SaveWindow string
}

func newCmdDiagnose(f *factory, runF func(context.Context, *diagnoseOptions) error) *cobra.Command {
	opts := &diagnoseOptions{f: f, Attach: &f.attach, Config: diag.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "diagnose",
		Short: "Sample the cluster over a window and report what is wrong, with evidence and remedy",
		Long: `Sample every server behind the router (or the --server ones) every --interval
over --window: each server's steps, collectives, requests and (prefill and
decode) PD queues and failure counters, from the debug API, and the
router's request outcomes from its /metrics (not with --server). Then run
the rules of package diag over the samples: a dead PD control loop, a PD
queue stuck, entries past their state's timeout, KV pages leaked, a peer
unreachable, a prefill's bootstrap registry listing a rank at an endpoint
other than the rank's own, ranks diverging, requests failing (by reason and
queue).

Each finding is printed with its severity, rule, server, rank, summary,
evidence and remedy: a block per finding on a terminal, one tab-separated
line per finding when piped (severity, rule, server, rank or "-" for the
whole server, summary, evidence, remedy), the findings array with --json
(rank null for the whole server). "healthy" when there are none.

With --canaries N, diagnose also sends N canary prompts during the window,
through the router (or the first colocated --server), one after another,
under whatever load the cluster has: each prompt (seeded by --canary-seed,
a few hundred tokens over several KV pages, so that the sparse indexer reads
its index keys) is sent once so that it is cached, its prefix is offloaded
to the host tier of every prefill and colocated server whose HiCache is on
(POST /admin/v1/hicache/offload, an admin call: --token), then it is sent
again (its KV loads back from host) and with no_cache (computed from
scratch). Each is greedy, ignores end-of-sequence and is 16 tokens long.
Greedy decoding in pdkit is batch-invariant, so any difference between
these outputs is corrupt KV, not noise: rule output-divergence names it,
with each server's index-K precision, HiCache state and fault switches on.
With HiCache off everywhere nothing loads back; the canaries still compare
a cache hit with no_cache, and stderr says so. Without --canaries nothing
is sent.

Each server is judged by the settings it publishes (GET /debug/v1/settings):
its PD timeouts, and its loop heartbeat, which raises --collective-wait and
the grace of the timeouts to twice the heartbeat on a server whose
heartbeat is longer. --bootstrap-timeout, --transfer-timeout,
--inflight-timeout and --abort-ack-timeout override what every server
publishes.

Exit status: 0 healthy (info findings, notes such as load shed at the
edge or a live switch under way, may be printed), 1 a warning or critical
finding, 2 could not run (bad flags, or no server answered at all).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.Window <= 0 || opts.Interval <= 0 {
				return newUsageError(cmd, "--window and --interval must be positive")
			}
			if opts.Interval > opts.Window {
				return newUsageError(cmd, "--interval %v is longer than --window %v", opts.Interval, opts.Window)
			}
			if opts.Canaries < 0 {
				return newUsageError(cmd, "--canaries must not be negative")
			}
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return diagnoseRun(cmd.Context(), opts)
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&opts.Window, "window", 5*time.Second, "how long to sample the cluster")
	fl.DurationVar(&opts.Interval, "interval", time.Second, "time between two samples")
	fl.BoolVar(&opts.JSON, "json", false, "print the findings as a JSON array")
	fl.StringVar(&opts.SaveWindow, "save-window", "", "also write the samples the rules judged to this file, as JSON: a record of what diagnose saw, which the rules can judge again")
	fl.BoolVar(&opts.Rehash, "rehash", false, "first have every server rehash its whole model file (an admin call; it reads the file, so it is for when the sampled check is not enough): model-identity then names a file changed between the samples, and servers whose files differ")
	fl.IntVar(&opts.Canaries, "canaries", 0, "send this many canary prompts during the window and compare their outputs from the cache (loaded back from host) and without it (0: send nothing)")
	fl.Uint64Var(&opts.CanarySeed, "canary-seed", 0, "seed of the canary prompts, to repeat a run (0: from the clock)")
	o := &opts.Config.Overrides
	const published = " instead of the one each server publishes (0: the server's)"
	fl.DurationVar(&o.Bootstrap, "bootstrap-timeout", 0, "judge prefill bootstrap and decode prealloc entries by this PD bootstrap timeout"+published)
	fl.DurationVar(&o.Transfer, "transfer-timeout", 0, "judge decode transfer entries by this PD transfer timeout"+published)
	fl.DurationVar(&o.Inflight, "inflight-timeout", 0, "judge prefill inflight entries by this PD inflight timeout"+published)
	fl.DurationVar(&o.AbortAck, "abort-ack-timeout", 0, "judge decode aborting entries by this PD abort-ack timeout"+published)
	fl.DurationVar(&opts.Config.CollectiveWait, "collective-wait", opts.Config.CollectiveWait, "longest a rank may wait in a collective while a peer is elsewhere before rank-divergence names it (at least twice the server's loop heartbeat)")
	return cmd
}

// findingsResult is how a command that reports findings ends: with a
// findingsError (exit 1) when one is a warning or worse; with notes only
// (info: a live switch under way, load shed at the edge), healthy, and
// stderr says how many notes it printed.
func findingsResult(f *factory, command string, findings []diag.Finding) error {
	for _, fd := range findings {
		if fd.Severity > diag.Info {
			return &findingsError{command: command, findings: findings}
		}
	}
	if len(findings) > 0 {
		fmt.Fprintf(f.ErrOut, "pdctl: %s: healthy, with %s\n", command, pluralf(len(findings), "note (info)", "notes (info)"))
	}
	return nil
}

// findingsError reports, after the output, that diagnose found problems.
type findingsError struct {
	command  string // the command that found them: diagnose, top
	findings []diag.Finding
}

func (e *findingsError) Error() string {
	n := map[diag.Severity]int{}
	for _, f := range e.findings {
		n[f.Severity]++
	}
	var parts []string
	for _, s := range []diag.Severity{diag.Critical, diag.Warning, diag.Info} {
		if n[s] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n[s], s))
		}
	}
	return e.command + ": " + pluralf(len(e.findings), "finding", "findings") + " (" + strings.Join(parts, ", ") + ")"
}

// cannotRunError reports that a command could not look at the cluster at
// all: the router and every server were unreachable.
type cannotRunError struct{ err error }

func (e *cannotRunError) Error() string { return e.err.Error() }
func (e *cannotRunError) Unwrap() error { return e.err }

// attachAll resolves the targets; a router that cannot be reached means the
// command cannot run.
func attachAll(ctx context.Context, f *factory, o *attachOptions) ([]*target, error) {
	targets, err := o.targets(ctx, f)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &cannotRunError{err: err}
	}
	return targets, nil
}

func diagnoseRun(ctx context.Context, opts *diagnoseOptions) error {
	f := opts.f
	targets, err := attachAll(ctx, f, opts.Attach)
	var kept *discovery
	if err != nil && len(opts.Attach.Servers) == 0 && ctx.Err() == nil {
		// The router does not answer: reach its servers directly, as
		// pdctl last discovered them, and name the router.
		if d, lerr := loadDiscovery(f, opts.Attach.Router); lerr == nil {
			fmt.Fprintf(f.ErrOut, "the router does not answer (%v); sampling its servers as discovered %v ago\n", err, time.Since(d.Taken).Round(time.Second))
			targets, kept, err = opts.Attach.clusterTargets(f, d.Servers), d, nil
		}
	}
	if err != nil {
		return err
	}
	p := probe{targets: targets, router: opts.Attach.routerClient(f)}
	if opts.Canaries > 0 {
		if p.canaries, err = newCanaryProbe(opts.Attach, targets, opts.Canaries, opts.CanarySeed); err != nil {
			return err
		}
	}
	if opts.Rehash {
		rehash(ctx, f, targets)
	}
	fmt.Fprintf(f.ErrOut, "sampling %s every %v for %v…\n", pluralf(len(targets), "server", "servers"), opts.Interval, opts.Window)
	findings, w, err := diagnose(ctx, p, opts.Window, opts.Interval, opts.Config, kept)
	if err != nil {
		return err
	}
	fmt.Fprintf(f.ErrOut, "%s over %v\n", pluralf(len(w.Samples), "sample", "samples"), w.Span().Round(time.Millisecond))
	if opts.SaveWindow != "" {
		if err := saveWindow(opts.SaveWindow, w); err != nil {
			return err
		}
	}
	if w.Canaries != nil {
		io.WriteString(f.ErrOut, canaryReport(w.Canaries))
	}
	if f.maskVolatile {
		for i := range findings {
			findings[i].Seen = "*" // times of day differ from run to run
		}
	}
	if opts.JSON {
		err = writeJSON(f.Out, findings)
	} else {
		err = printFindings(f.Out, findings, f.OutTTY)
	}
	if err != nil {
		return err
	}
	return findingsResult(f, "diagnose", findings)
}

// probe is what one sample reads: the servers, and the router when pdctl
// found them through one.
type probe struct {
	targets []*target
	router  *client.Client // nil: the servers were named with --server
	// canaries, when set, run beside the samples (diagnose --canaries).
	canaries *canaryProbe
}

// diagnose samples p over window, runs its canaries beside (when it has
// any: they may outlast the window) and runs the rules of cfg. It is an
// error (cannot run) when no server answered in any sample.
// kept, when set, is the discovery the targets came from, the router not
// answering.
func diagnose(ctx context.Context, p probe, window, interval time.Duration, cfg diag.Config, kept *discovery) ([]diag.Finding, diag.Window, error) {
	var canaries *diag.Canaries
	var wg sync.WaitGroup
	if p.canaries != nil {
		wg.Go(func() { canaries = p.canaries.run(ctx, window) })
	}
	w, err := sampleWindow(ctx, p, window, interval)
	wg.Wait()
	w.Canaries = canaries
	if kept != nil {
		w.DiscoveredAt = &kept.Taken
	}
	if err != nil {
		return nil, w, err
	}
	reachable := false
	for _, s := range w.Samples {
		for _, ss := range s.Servers {
			reachable = reachable || ss.Reachable
		}
	}
	if !reachable {
		msg := "no server answered"
		if len(w.Samples) > 0 && len(w.Samples[0].Servers) > 0 {
			msg += ": " + w.Samples[0].Servers[0].Error
		}
		return nil, w, &cannotRunError{err: fmt.Errorf("%s", msg)}
	}
	findings := diag.RunRules(diag.RulesWith(cfg), w)
	if findings == nil {
		findings = []diag.Finding{}
	}
	return findings, w, nil
}

// sampleWindow samples p at once, every interval, until window has
// passed: window/interval+1 samples, the first at once. Each sample starts
// on time whatever the last one waits for, and reads every server in
// parallel, each bounded by sampleBound: a frozen server is unreachable in
// every sample, and the window ends within window+sampleBound, not a bound
// per sample later.
func sampleWindow(ctx context.Context, p probe, window, interval time.Duration) (diag.Window, error) {
	n := int(window/interval) + 1
	w := diag.Window{Samples: make([]diag.Sample, n)}
	bound := sampleBound(interval)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		if i > 0 {
			select {
			case <-ctx.Done():
				wg.Wait()
				w.Samples = w.Samples[:i]
				return w, ctx.Err()
			case <-time.After(time.Until(start.Add(time.Duration(i) * interval))):
			}
		}
		wg.Go(func() { w.Samples[i] = sampleOnce(ctx, p, bound) })
	}
	wg.Wait()
	return w, ctx.Err()
}

// sampleBound is how long one server may take to answer a sample: an
// interval, and no less than 2 s (a busy server's debug API may be slow to
// answer, which is not a fault).
func sampleBound(interval time.Duration) time.Duration { return max(interval, 2*time.Second) }

// sampleOnce reads every target, and the router, at once.
func sampleOnce(ctx context.Context, p probe, bound time.Duration) diag.Sample {
	s := diag.Sample{Taken: time.Now(), Servers: make([]diag.ServerSample, len(p.targets))}
	var wg sync.WaitGroup
	for i, t := range p.targets {
		wg.Go(func() { s.Servers[i] = sampleServer(ctx, t, bound) })
	}
	if p.router != nil {
		wg.Go(func() { s.Router = sampleRouter(ctx, p.router, bound) })
	}
	wg.Wait()
	return s
}

// The router's metrics that diag reads (internal/router's metrics.go).
const (
	routerRequestsMetric       = "pdkit_router_requests_total"        // by outcome
	routerUpstreamErrorsMetric = "pdkit_router_upstream_errors_total" // by role and server
	routerPausedMetric         = "pdkit_router_paused"                // 1 while an operator paused admission
	routerCanariesMetric       = "pdkit_router_canaries_total"        // the router's own canaries, by prefill and result
)

// sampleRouter reads the router's request outcome and upstream error
// counters from its /metrics.
func sampleRouter(ctx context.Context, c *client.Client, bound time.Duration) *diag.RouterSample {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	r := &diag.RouterSample{URL: c.BaseURL, Outcomes: map[string]uint64{}, UpstreamErrors: map[string]uint64{}}
	text, err := c.Metrics(ctx)
	var ms []client.MetricSample
	if err == nil {
		ms, err = client.ParseMetrics(text, routerRequestsMetric, routerUpstreamErrorsMetric, routerPausedMetric, routerCanariesMetric)
	}
	if err != nil {
		r.Error = strings.ReplaceAll(err.Error(), "\n", "; ")
		return r
	}
	r.Reachable = true
	if rd, err := c.RouterReady(ctx); err == nil {
		r.Ready = &rd
	}
	for _, m := range ms {
		switch m.Name {
		case routerRequestsMetric:
			r.Outcomes[m.Labels["outcome"]] += uint64(m.Value)
		case routerUpstreamErrorsMetric:
			r.UpstreamErrors[m.Labels["server"]] += uint64(m.Value)
		case routerPausedMetric:
			r.Paused = m.Value == 1
		case routerCanariesMetric:
			if r.Canaries == nil {
				r.Canaries = map[string]map[string]uint64{}
			}
			p := m.Labels["prefill"]
			if r.Canaries[p] == nil {
				r.Canaries[p] = map[string]uint64{}
			}
			r.Canaries[p][m.Labels["result"]] += uint64(m.Value)
		}
	}
	return r
}

// sampleServer reads one server's info, steps, collectives, requests, PD
// state, fault switches and settings. A server that fails any of them is
// unreachable in the sample, with the first error; a colocated server has
// no PD state, and a server that publishes no settings (404) none.
func sampleServer(ctx context.Context, t *target, bound time.Duration) diag.ServerSample {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	s := diag.ServerSample{Server: diag.Server{URL: t.URL, Role: t.Role, TPSize: t.TPSize}}
	var (
		wg    sync.WaitGroup
		info  pdproto.ServerInfo
		steps debug.StepsResponse
		colls debug.CollectivesResponse
		reqs  debug.RequestsResponse
		pd    debug.PDResponse
		flts  debug.FaultsResponse
		sets  debug.Settings
		errs  [7]error
	)
	start := time.Now()
	wg.Go(func() { info, errs[0] = t.c.Info(ctx) })
	wg.Go(func() { steps, errs[1] = t.c.Steps(ctx) })
	wg.Go(func() { colls, errs[2] = t.c.Collectives(ctx) })
	wg.Go(func() { reqs, errs[3] = t.c.Requests(ctx, "") })
	wg.Go(func() { pd, errs[4] = t.c.PD(ctx, "") })
	wg.Go(func() { flts, errs[5] = t.c.Faults(ctx) })
	wg.Go(func() { sets, errs[6] = t.c.Settings(ctx) })
	wg.Wait()
	s.TookMS = float64(time.Since(start).Microseconds()) / 1000
	if errs[0] == nil {
		s.Role, s.TPSize = info.Role, info.TPSize
	}
	hasPD := true
	if errs[4] != nil && client.StatusOf(errs[4]) == 404 && !isPD(s.Role) {
		errs[4], hasPD = nil, false
	}
	hasSettings := true
	if client.StatusOf(errs[6]) == 404 {
		errs[6], hasSettings = nil, false
	}
	for _, err := range errs {
		if err != nil {
			s.Error = strings.ReplaceAll(err.Error(), "\n", "; ")
			return s
		}
	}
	s.Reachable = true
	s.Steps, s.Collectives, s.Requests, s.Faults = &steps, &colls, &reqs, &flts
	if info.Role == pdproto.RolePrefill && info.BootstrapURL != "" {
		s.Registry = lookupRegistry(ctx, info.BootstrapURL)
	}
	if hasPD {
		s.PD = &pd
	}
	if hasSettings {
		s.Settings = &sets
	}
	return s
}

// lookupRegistry reads a prefill server's bootstrap registry once, as a
// decode would look it up; nil unless it answers a whole group.
func lookupRegistry(ctx context.Context, bootstrapURL string) *pdproto.LookupResponse {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(bootstrapURL, "/")+pdproto.BootstrapRanksPath, nil)
	if err != nil {
		return nil
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var lr pdproto.LookupResponse
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&lr) != nil || !lr.Complete {
		return nil
	}
	return &lr
}

// printFindings writes the findings for a terminal (a block each, a blank
// line between two) or a pipe (one tab-separated line each), "healthy"
// when there are none.
func printFindings(w io.Writer, findings []diag.Finding, tty bool) error {
	if len(findings) == 0 {
		_, err := io.WriteString(w, "healthy\n")
		return err
	}
	var b strings.Builder
	for i, fd := range findings {
		if tty {
			if i > 0 {
				b.WriteString("\n")
			}
			b.WriteString(fd.String())
			continue
		}
		rank := "-"
		if fd.Rank != nil {
			rank = itoa(*fd.Rank)
		}
		var ev []string
		for _, e := range fd.Evidence {
			ev = append(ev, e.Key+"="+e.Value)
		}
		if fd.Seen != "" {
			ev = append(ev, "seen="+fd.Seen)
		}
		cells := []string{fd.Severity.String(), fd.Rule, fd.Server, rank, fd.Summary, strings.Join(ev, "; "), fd.Remedy}
		for j := range cells {
			cells[j] = cell(cells[j])
		}
		b.WriteString(strings.Join(cells, "\t") + "\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// saveWindow writes w to path as indented JSON, the form the rules'
// golden fixtures take, so that a window seen once can be judged again.
func saveWindow(path string, w diag.Window) error {
	b, err := json.MarshalIndent(w, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("--save-window: %w", err)
	}
	return nil
}

// rehash has every target rehash its whole model file (an admin call) and
// says on stderr what each found; the rules then read the outcome in the
// servers' settings (model_file), a changed file included.
func rehash(ctx context.Context, f *factory, targets []*target) {
	for _, t := range targets {
		if t.c == nil {
			continue
		}
		v, err := t.c.VerifyModel(ctx)
		switch {
		case err != nil:
			fmt.Fprintf(f.ErrOut, "rehash of %s: %v\n", t.URL, err)
		case v.First:
			fmt.Fprintf(f.ErrOut, "rehash of %s: %s (%s, its baseline from now on)\n", t.URL, v.SHA256, time.Duration(v.TookMS*float64(time.Millisecond)).Round(time.Millisecond))
		case v.Matches:
			fmt.Fprintf(f.ErrOut, "rehash of %s: %s, as at load (%s)\n", t.URL, v.SHA256, time.Duration(v.TookMS*float64(time.Millisecond)).Round(time.Millisecond))
		default:
			fmt.Fprintf(f.ErrOut, "rehash of %s: %s, changed since load (%s then; %s)\n", t.URL, v.SHA256, v.Baseline, time.Duration(v.TookMS*float64(time.Millisecond)).Round(time.Millisecond))
		}
	}
}
