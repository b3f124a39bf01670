package main

import (
	"context"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/tui"
	"github.com/spf13/cobra"
)

type topOptions struct {
	f        *factory
	Attach   *attachOptions
	Interval time.Duration
	Window   time.Duration
	Once     bool
	JSON     bool
	Config   diag.Config
}

func newCmdTop(f *factory, runF func(context.Context, *topOptions) error) *cobra.Command {
	opts := &topOptions{f: f, Attach: &f.attach, Config: diag.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Watch every rank live: steps, phases, collectives, PD queues, index-K, host tier and the diag findings",
		Long: `A live view of the cluster (Bubble Tea): the router and the servers with
their request queues, the requests each failed since it started (FAILED,
with "(+N)" for those failed over --window: a router's failed outcomes, a
PD server's failures), the index-K precision (INDEX-K: fp8 or bf16, "n/a"
without a sparse indexer, "fp8 (switching to bf16)" while a live switch
drains), the host tier (HICACHE: "off", or "on" with the host tokens
used/total of every rank, "n/a" without a prefix cache) and the fault
switches that are on.

Then a ranks panel per server, titled "in step" or "DIVERGED:" with the
ranks that parted (the rank in no collective while its peers wait first),
one line per rank: a mark ("!": named by rank-divergence, behind its group,
waiting in a collective past --collective-wait, or in no collective while a
peer waits past it), its rank, its loop (LOOP: "-" while the server
publishes none), phase, step, Δ (its step less the highest of its server:
-1 is a rank caught mid-iteration, lower is divergence, marked), the
collective it waits in with its communicator (WAITS IN: "control seq 41
Broadcast", or "not in control seq 41" for the rank its peers wait for)
and for how long (FOR), its step rate (STEPS/S) and a sparkline of it over
the last 20 samples (LAST 20: "·" is a sample with no step finished), the
age of its last step, its sequence numbers on the two communicators of its
TP group (CTRL SEQ: the loop's control agreements; FWD SEQ: the model's
forward collectives), its PD queues and KV pages; then the findings of the
diag rules over the samples of the last --window. On a narrow screen the
KV, PD, seq, age and loop columns go first, then the sparkline narrows and
goes, then the rate and the phase; the mark, rank, step, Δ, WAITS IN and
FOR stay. On a short one the findings are cut (the first kept), then the
servers' table goes.

Keys: ` + tui.DefaultKeyMap.HelpText() + `.

When stdout is not a terminal, or with --once, it samples once and prints
the servers, the ranks and the findings as tables (tab-separated when
piped; --json prints the sample and the findings).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.Interval <= 0 || opts.Window <= 0 {
				return newUsageError(cmd, "--interval and --window must be positive")
			}
			if opts.JSON && !opts.Once && opts.f.OutTTY {
				return newUsageError(cmd, "--json needs --once (or stdout not a terminal)")
			}
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return topRun(cmd.Context(), opts)
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&opts.Interval, "interval", time.Second, "time between two samples")
	fl.DurationVar(&opts.Window, "window", 5*time.Second, "how far back the samples the rules judge go")
	fl.BoolVar(&opts.Once, "once", false, "sample once, print the tables and exit")
	fl.BoolVar(&opts.JSON, "json", false, "with --once: print the sample and the findings as JSON")
	fl.DurationVar(&opts.Config.CollectiveWait, "collective-wait", opts.Config.CollectiveWait, "a rank waiting in a collective longer than this is marked (at least twice its server's loop heartbeat, as rank-divergence judges it)")
	return cmd
}

// topOutput is the JSON of a one-shot top: the sample (with each server's
// host tier beside it, "hicache" by URL) and the findings.
type topOutput struct {
	Sample   tui.Sample     `json:"sample"`
	Findings []diag.Finding `json:"findings"`
}

func topRun(ctx context.Context, opts *topOptions) error {
	f := opts.f
	targets, err := attachAll(ctx, f, opts.Attach)
	if err != nil {
		return err
	}
	source := opts.Attach.Router
	if len(opts.Attach.Servers) > 0 {
		source = pluralf(len(targets), "server", "servers")
	}
	bound := max(opts.Interval, 2*time.Second)
	fetch := func(ctx context.Context) (tui.Sample, error) {
		var s tui.Sample
		var hc []*debug.HiCacheResponse
		var wg sync.WaitGroup
		wg.Go(func() {
			s.Sample = sampleOnce(ctx, probe{targets: targets, router: opts.Attach.routerClient(f)}, bound)
		})
		wg.Go(func() { hc = readHiCache(ctx, targets, bound) })
		wg.Wait()
		for i, h := range hc {
			if h != nil {
				if s.HiCache == nil {
					s.HiCache = map[string]*debug.HiCacheResponse{}
				}
				s.HiCache[targets[i].URL] = h
			}
		}
		return s, ctx.Err()
	}
	if opts.Once || !f.OutTTY {
		return topOnce(ctx, opts, fetch)
	}
	return tui.Run(ctx, f.In, f.Out, tui.Options{Fetch: fetch, Interval: opts.Interval, Window: opts.Window,
		Source: source, Config: opts.Config, Width: f.screen.width, Height: f.screen.height})
}

// readHiCache reads every reachable target's host tier at once, each
// within bound; nil for a target that did not answer.
func readHiCache(ctx context.Context, targets []*target, bound time.Duration) []*debug.HiCacheResponse {
	out := make([]*debug.HiCacheResponse, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		if t.Err != nil {
			continue
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, bound)
			defer cancel()
			if h, err := t.c.HiCache(ctx); err == nil {
				out[i] = &h
			}
		})
	}
	wg.Wait()
	return out
}

// topOnce prints one sample's tables and findings.
func topOnce(ctx context.Context, opts *topOptions, fetch func(context.Context) (tui.Sample, error)) error {
	f := opts.f
	s, err := fetch(ctx)
	if err != nil {
		return err
	}
	findings := diag.RunRules(diag.RulesWith(opts.Config), diag.Window{Samples: []diag.Sample{s.Sample}})
	if findings == nil {
		findings = []diag.Finding{}
	}
	if opts.JSON {
		err = writeJSON(f.Out, topOutput{Sample: s, Findings: findings})
	} else {
		servers, ranks := tui.Rows(s, opts.Config, s.Taken)
		tabs := []*table{fromRows(servers), fromRows(ranks, "STEP", "Δ", "AGE", "CTRL SEQ", "FWD SEQ", "COLLECTIVE")}
		ft := newTable([]string{"SEVERITY", "RULE", "SERVER", "RANK", "SUMMARY"})
		for _, fd := range findings {
			rank := ""
			if fd.Rank != nil {
				rank = itoa(*fd.Rank)
			}
			ft.add(fd.Severity.String(), fd.Rule, fd.Server, rank, fd.Summary)
		}
		err = printTables(f, append(tabs, ft)...)
	}
	if err != nil {
		return err
	}
	unreachable := 0
	for _, sv := range s.Servers {
		if !sv.Reachable {
			unreachable++
		}
	}
	switch {
	case unreachable > 0:
		return &unreachableError{n: unreachable, of: len(s.Servers)}
	}
	return findingsResult(f, "top", findings)
}

// fromRows makes a table of rows whose first row is the header; volatile
// names the columns that change from run to run.
func fromRows(rows [][]string, volatile ...string) *table {
	if len(rows) == 0 {
		panic("fromRows: no header") // tui.Rows always gives one
	}
	t := newTable(rows[0], volatile...)
	for _, r := range rows[1:] {
		t.add(r...)
	}
	return t
}
