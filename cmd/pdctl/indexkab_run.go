package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/abtest"
	"github.com/pdkit/pdkit/internal/config"
)

// How long indexk ab waits for the servers beyond what each call bounds
// itself: a HiCache switch to be taken by every rank (or another one
// pending to clear), an index-K switch past its drain, the restore at the
// end once the command was interrupted.
const (
	abSwitchWithin  = 60 * time.Second
	abIndexKMargin  = 60 * time.Second
	abRestoreWithin = 3 * time.Minute
	abPollEvery     = 100 * time.Millisecond
	abProgressEvery = 30 * time.Second
)

// abServer is a server indexk ab switches: what it reported when found.
type abServer struct {
	t        *target
	settings debug.Settings
	tier     debug.HiCacheResponse
	context  int // the model's context length
	found    abServerState
}

// tiered says the server has a host tier to switch (a prefix cache, and
// not a decode, which keeps none).
func (s *abServer) tiered() bool {
	return s.settings.HiCache != nil && s.tier.PrefixCache && s.tier.NoTier == ""
}

// computes says the server computes prompts: its prefix cache is the one
// the workload must spill.
func (s *abServer) computes() bool { return s.t.Role != pdproto.RoleDecode }

// abRun is one run of indexk ab.
type abRun struct {
	opts    *indexkABOptions
	f       *factory
	servers []*abServer // prefill servers first, then colocated, then decode
}

func indexkABRun(ctx context.Context, opts *indexkABOptions) error {
	f := opts.f
	targets, err := attachAll(ctx, f, opts.Attach)
	if err != nil {
		return err
	}
	ab, err := newABRun(ctx, opts, targets)
	if err != nil {
		return err
	}
	script, work, err := opts.script(ab.pool())
	if err != nil {
		return &cannotRunError{err: err}
	}
	rep := &abReport{Router: opts.Attach.Router, Workload: work, Servers: []abServerState{}, References: []abReferences{}, Cells: []abtest.Cell{}}
	if opts.SetBandwidth {
		bps := int64(opts.LoadBandwidth)
		rep.LoadBandwidthBytesPerSecond = &bps
	}
	for _, s := range ab.servers {
		rep.Servers = append(rep.Servers, s.found)
	}
	ab.describe(script, rep)

	runErr := ab.run(ctx, script, rep)
	rep.RestoreErrors = ab.restore(ctx)
	rep.Restored = len(rep.RestoreErrors) == 0
	if rep.Restored {
		ab.progressf("indexk ab: restored the settings found on %s", pluralf(len(ab.servers), "server", "servers"))
	}
	for _, c := range rep.Cells {
		if c.Corrupt > 0 {
			rep.CorruptCells++
		}
	}
	if runErr == nil || len(rep.Cells) > 0 {
		if err := rep.print(f, opts.JSON); err != nil {
			return err
		}
	}
	switch {
	case runErr != nil:
		return runErr
	case rep.CorruptCells > 0:
		return ab.corruption(rep)
	case !rep.Restored:
		return fmt.Errorf("the settings found could not be restored: %s", strings.Join(rep.RestoreErrors, "; "))
	}
	for _, c := range rep.Cells {
		if c.Compared == 0 {
			return &cannotRunError{err: fmt.Errorf("%s with hicache %s compared no output (%d timeouts, %d errors; first: %s)", c.IndexK, c.HiCache, c.Timeouts, c.Errors, c.FirstError)}
		}
	}
	compared := 0
	for _, c := range rep.Cells {
		compared += c.Compared
	}
	ab.progressf("indexk ab: no corrupt output in %s (%d outputs compared with their references)", pluralf(len(rep.Cells), "cell", "cells"), compared)
	return nil
}

// newABRun reads every server's settings, host tier and context length,
// and checks that the run can switch what it needs.
func newABRun(ctx context.Context, opts *indexkABOptions, targets []*target) (*abRun, error) {
	type answer struct {
		settings debug.Settings
		tier     debug.HiCacheResponse
		context  int
	}
	rows, answers := readServers(targets, func(t *target) (answer, error) {
		var a answer
		var err error
		if a.settings, err = t.c.Settings(ctx); err != nil {
			return a, err
		}
		st, err := t.c.State(ctx)
		if err != nil {
			return a, err
		}
		a.context = st.ContextTokens
		if a.settings.HiCache != nil {
			if a.tier, err = t.c.HiCache(ctx); err != nil {
				return a, err
			}
		}
		return a, nil
	})
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	ab := &abRun{opts: opts, f: opts.f}
	for i, row := range rows {
		if row.Error != "" {
			if row.Role == "" {
				return nil, &cannotRunError{err: fmt.Errorf("%s: %s", row.URL, row.Error)}
			}
			return nil, &cannotRunError{err: fmt.Errorf("%s (%s): %s", row.URL, row.Role, row.Error)}
		}
		a := answers[i]
		s := &abServer{t: targets[i], settings: a.settings, tier: a.tier, context: a.context}
		s.found = abServerState{URL: row.URL, Role: row.Role, FaultsOn: slices.Clone(a.settings.FaultsOn)}
		if s.found.FaultsOn == nil {
			s.found.FaultsOn = []string{}
		}
		if a.settings.Indexer {
			s.found.IndexK = a.settings.IndexK
		}
		if s.tiered() {
			s.found.HiCache = onOff(a.tier.On)
			s.found.LoadBandwidthBytesPerSecond = a.settings.HiCache.LoadBandwidthBytesPerSecond
		}
		if to := a.settings.IndexKSwitch; to != "" {
			return nil, &cannotRunError{err: fmt.Errorf("%s (%s): an index-K switch to %s is under way", row.URL, row.Role, to)}
		}
		ab.servers = append(ab.servers, s)
	}
	rank := func(s *abServer) int {
		switch s.t.Role {
		case pdproto.RolePrefill:
			return 0
		case pdproto.RoleDecode:
			return 2
		}
		return 1
	}
	slices.SortStableFunc(ab.servers, func(a, b *abServer) int { return rank(a) - rank(b) })
	if !slices.ContainsFunc(ab.servers, func(s *abServer) bool { return s.settings.Indexer }) {
		return nil, &cannotRunError{err: errors.New("the servers' model has no sparse indexer: it stores no index keys, so there is no index-K precision to A/B")}
	}
	if slices.Contains(opts.HiCache, "on") && !slices.ContainsFunc(ab.servers, (*abServer).tiered) {
		return nil, &cannotRunError{err: errors.New("no server has a prefix cache, so none has a host tier to switch on (run with --hicache off)")}
	}
	if !slices.ContainsFunc(ab.servers, (*abServer).computes) {
		return nil, &cannotRunError{err: errors.New("no prefill or colocated server: nothing computes the prompts")}
	}
	return ab, nil
}

// pool is the KV the workload must spill: the smallest device pool of
// the servers that compute prompts, and its host tier (its size when the
// tier is on, else as its settings size it; 0 when not known).
func (ab *abRun) pool() abtest.Pool {
	var p abtest.Pool
	for _, s := range ab.servers {
		if s.context > 0 && (p.ContextTokens == 0 || s.context < p.ContextTokens) {
			p.ContextTokens = s.context
		}
		if !s.computes() || (p.DeviceTokens != 0 && s.settings.KVTokens >= p.DeviceTokens) {
			continue
		}
		p.DeviceTokens, p.PageSize, p.HostTokens = s.settings.KVTokens, s.settings.PageSize, 0
		switch h := s.settings.HiCache; {
		case !s.tiered():
		case len(s.tier.Ranks) > 0 && s.tier.Ranks[0].HostTokens > 0:
			p.HostTokens = s.tier.Ranks[0].HostTokens
		case h.SizeBytes == 0:
			p.HostTokens = int(h.Ratio*float64(s.settings.KVPages)) * s.settings.PageSize
		}
	}
	return p
}

// progressf writes a line of progress to stderr.
func (ab *abRun) progressf(format string, a ...any) {
	fmt.Fprintf(ab.f.ErrOut, format+"\n", a...)
}

// vol is a value that changes from run to run, "*" in tests of exact
// output.
func (ab *abRun) vol(format string, a ...any) string {
	if ab.f.maskVolatile {
		return "*"
	}
	return fmt.Sprintf(format, a...)
}

// describe says on stderr what the run will do.
func (ab *abRun) describe(s abtest.Script, rep *abReport) {
	w := rep.Workload
	prompts := "their own prompts"
	if w.PromptTokensMax > 0 {
		prompts = fmt.Sprintf("prompts of %d to %d tokens (mean %d)", w.PromptTokensMin, w.PromptTokensMax, w.PromptTokensMean)
	}
	if w.SystemTokens > 0 {
		prompts += fmt.Sprintf(" over a %d-token shared prefix, %d tokens more each turn", w.SystemTokens, w.PerTurnTokens)
	}
	ab.progressf("indexk ab: %d sessions, %d requests per cell (%s of up to %s), %s, %s each",
		w.Sessions, w.Requests, pluralf(w.Conversations, "conversation", "conversations"), pluralf(w.MaxTurns, "turn", "turns"),
		prompts, pluralf(w.MaxTokens, "greedy token", "greedy tokens"))
	if w.WorkingSetTokens > 0 {
		host := "a host tier of unknown size"
		if w.HostTokens > 0 {
			host = fmt.Sprintf("a host tier of %d", w.HostTokens)
		}
		verdict := "do not fit the device pool: they spill to the host tier and come back"
		switch {
		case w.WorkingSetTokens <= w.DeviceTokens:
			verdict = "fit the device pool: few prefixes will come back from host (raise --sessions)"
		case w.HostTokens > 0 && w.WorkingSetTokens > w.HostTokens:
			verdict = "exceed the host tier too: some are dropped from host before they come back"
		}
		ab.progressf("indexk ab: a device KV pool of %d tokens per rank and %s; the sessions' histories (about %d tokens) %s",
			w.DeviceTokens, host, w.WorkingSetTokens, verdict)
	}
	ab.progressf("indexk ab: %s", ab.switchesOn(rep))
}

// switchesOn names the switches on that the run does not set: the fault
// switches of every server, and the load pacing.
func (ab *abRun) switchesOn(rep *abReport) string {
	var parts []string
	faults := map[string][]string{}
	var names []string
	for _, s := range rep.Servers {
		for _, n := range s.FaultsOn {
			if _, ok := faults[n]; !ok {
				names = append(names, n)
			}
			faults[n] = append(faults[n], s.Role+" "+s.URL)
		}
	}
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("fault %s on (%s)", n, strings.Join(faults[n], ", ")))
	}
	if len(parts) == 0 {
		parts = append(parts, "no fault switch on")
	}
	if bps := rep.LoadBandwidthBytesPerSecond; bps != nil {
		if *bps == 0 {
			parts = append(parts, "loads back from host unpaced")
		} else {
			parts = append(parts, "loads back from host paced to "+config.FormatRate(*bps)+" per rank")
		}
	}
	return strings.Join(parts, ", ")
}

// corruption is the failure of a run with corrupt cells: which, and the
// switches on.
func (ab *abRun) corruption(rep *abReport) error {
	var cells []string
	for _, c := range rep.Cells {
		if c.Corrupt > 0 {
			cells = append(cells, fmt.Sprintf("%s with hicache %s %d of %d (%.1f%%, first %s)", c.IndexK, c.HiCache, c.Corrupt, c.Compared, 100*c.CorruptShare, c.FirstCorrupt))
		}
	}
	return fmt.Errorf("corrupt outputs in %d of %d cells: %s; %s", rep.CorruptCells, len(rep.Cells), strings.Join(cells, ", "), ab.switchesOn(rep))
}

// run computes the references and runs every cell, appending to rep.
func (ab *abRun) run(ctx context.Context, script abtest.Script, rep *abReport) error {
	opts := ab.opts
	hc := abtest.NewHTTP(opts.Sessions)
	defer hc.CloseIdleConnections()
	c := &abtest.Client{URL: strings.TrimRight(opts.Attach.Router, "/"), HTTP: hc, Timeout: opts.RequestTimeout, MaxTokens: opts.MaxTokens}
	if opts.SetBandwidth {
		if err := ab.setBandwidth(ctx, int64(opts.LoadBandwidth)); err != nil {
			return ab.failed(ctx, err)
		}
	}
	for _, prec := range opts.Precisions {
		if err := ab.setIndexK(ctx, prec); err != nil {
			return ab.failed(ctx, err)
		}
		if err := ab.setHiCache(ctx, false); err != nil {
			return ab.failed(ctx, err)
		}
		start := time.Now()
		refs := ab.runScript(ctx, c, script, 1, true, prec+" references")
		if err := ctx.Err(); err != nil {
			return err
		}
		for ci, conv := range refs {
			for t, o := range conv {
				if o.Failed() {
					what := o.Kind
					if o.Timeout {
						what = "timed out"
					}
					return &cannotRunError{err: fmt.Errorf("%s reference of conversation %d turn %d (alone, no_cache, hicache off): %s: %s", prec, ci+1, t+1, what, o.Err)}
				}
			}
		}
		secs := time.Since(start).Seconds()
		rep.References = append(rep.References, abReferences{IndexK: prec, Requests: script.Requests(), Seconds: secs})
		ab.progressf("%s: %d references in %s", prec, script.Requests(), ab.vol("%.1fs", secs))

		for _, state := range opts.HiCache {
			if err := ab.setHiCache(ctx, state == "on"); err != nil {
				return ab.failed(ctx, err)
			}
			hits0, tokens0, err := ab.hits(ctx)
			if err != nil {
				return ab.failed(ctx, err)
			}
			start := time.Now()
			outs := ab.runScript(ctx, c, script, opts.Sessions, false, prec+" with hicache "+state)
			secs := time.Since(start).Seconds()
			if err := ctx.Err(); err != nil {
				return err
			}
			hits1, tokens1, err := ab.hits(ctx)
			if err != nil {
				return ab.failed(ctx, err)
			}
			cell := abtest.Compare(abtest.Cell{IndexK: prec, HiCache: state, Seconds: secs,
				HostHits: hits1 - hits0, HitTokens: tokens1 - tokens0}, outs, refs)
			rep.Cells = append(rep.Cells, cell)
			ab.progressf("%s with hicache %s: %d of %d outputs corrupt, %d timeouts, %d errors, %s host hits loading %s tokens, %s",
				prec, state, cell.Corrupt, cell.Compared, cell.Timeouts, cell.Errors,
				ab.vol("%d", cell.HostHits), ab.vol("%d", cell.HitTokens), ab.vol("%.1fs", secs))
			if cell.FirstError != "" {
				ab.progressf("%s with hicache %s: first failure: %s", prec, state, cell.FirstError)
			}
		}
	}
	return nil
}

// failed is a switch or read that failed during the run: the command
// could not run (unless it was interrupted).
func (ab *abRun) failed(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return &cannotRunError{err: err}
}

// runScript runs script, saying every abProgressEvery how far it got.
func (ab *abRun) runScript(ctx context.Context, c *abtest.Client, script abtest.Script, sessions int, noCache bool, what string) [][]abtest.Outcome {
	var done atomic.Int64
	stop := make(chan struct{})
	ticked := make(chan struct{})
	go func() {
		defer close(ticked)
		tick := time.NewTicker(abProgressEvery)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				ab.progressf("%s: %d of %d requests", what, done.Load(), script.Requests())
			}
		}
	}()
	outs := abtest.Run(ctx, c, script, sessions, noCache, func(int, int, abtest.Outcome) { done.Add(1) })
	close(stop)
	<-ticked
	return outs
}

// hits sums the host hits and their tokens of every server's rank 0 (the
// ranks of a server agree on them).
func (ab *abRun) hits(ctx context.Context) (hits, tokens uint64, err error) {
	for _, s := range ab.servers {
		if !s.tiered() {
			continue
		}
		h, err := s.t.c.HiCache(ctx)
		if err != nil {
			return 0, 0, fmt.Errorf("%s (%s): reading the host tier: %w", s.t.URL, s.t.Role, err)
		}
		if len(h.Ranks) > 0 {
			hits += h.Ranks[0].Totals.HostHits
			tokens += h.Ranks[0].Totals.HitTokens
		}
	}
	return hits, tokens, nil
}

// setIndexK switches every server with an indexer to prec, prefill
// servers first, then colocated, then decode ones, each once the one
// before is done, so that a PD pair runs one precision again.
func (ab *abRun) setIndexK(ctx context.Context, prec string) error {
	for _, s := range ab.servers {
		if !s.settings.Indexer {
			continue
		}
		if err := ab.indexKOn(ctx, s, prec); err != nil {
			return err
		}
	}
	return nil
}

// indexKOn switches one server to prec and waits until its settings show
// it: a switch already under way (409) is waited out first.
func (ab *abRun) indexKOn(ctx context.Context, s *abServer, prec string) error {
	within := ab.opts.Drain + debug.IndexKSwitchMargin + abIndexKMargin
	deadline := time.Now().Add(within)
	for {
		r, err := s.t.c.SetIndexK(ctx, prec, ab.opts.Drain)
		switch {
		case err == nil:
			if r.Changed {
				ab.progressf("%s (%s): index-K %s → %s, admission paused %s", s.t.URL, s.t.Role, r.From, r.To, ab.vol("%.0fms", r.PausedMS))
			}
			if r.Aborted > 0 {
				ab.progressf("%s (%s): the drain bound aborted %s in flight", s.t.URL, s.t.Role, pluralf(r.Aborted, "request", "requests"))
			}
			if !r.Pending {
				return nil
			}
			return pollUntil(ctx, deadline, fmt.Sprintf("%s (%s): index-K %s not done within %v", s.t.URL, s.t.Role, prec, within), func() (bool, error) {
				st, err := s.t.c.Settings(ctx)
				return err == nil && st.IndexK == prec && st.IndexKSwitch == "", nil
			})
		case client.StatusOf(err) == 409 && time.Now().Before(deadline):
			if err := sleepCtx(ctx, abPollEvery); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s (%s): switching index-K to %s: %w", s.t.URL, s.t.Role, prec, err)
		}
	}
}

// setHiCache switches every server's host tier on or off and waits until
// every rank shows it.
func (ab *abRun) setHiCache(ctx context.Context, on bool) error {
	for _, s := range ab.servers {
		if !s.tiered() {
			continue
		}
		if err := ab.hicacheOn(ctx, s, on); err != nil {
			return err
		}
	}
	return nil
}

func (ab *abRun) hicacheOn(ctx context.Context, s *abServer, on bool) error {
	deadline := time.Now().Add(abSwitchWithin)
	for {
		r, err := s.t.c.SetHiCache(ctx, on)
		switch {
		case err == nil:
			if !r.Pending && allRanks(r.HiCacheResponse, on) {
				return nil
			}
			return pollUntil(ctx, deadline, fmt.Sprintf("%s (%s): hicache %s not taken by every rank within %v", s.t.URL, s.t.Role, onOff(on), abSwitchWithin), func() (bool, error) {
				h, err := s.t.c.HiCache(ctx)
				return err == nil && allRanks(h, on), nil
			})
		case client.StatusOf(err) == 409 && strings.Contains(err.Error(), "pending") && time.Now().Before(deadline):
			if err := sleepCtx(ctx, abPollEvery); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s (%s): switching hicache %s: %w", s.t.URL, s.t.Role, onOff(on), err)
		}
	}
}

// allRanks says every rank's tier is as asked.
func allRanks(h debug.HiCacheResponse, on bool) bool {
	for _, r := range h.Ranks {
		if r.On != on {
			return false
		}
	}
	return len(h.Ranks) > 0
}

// setBandwidth paces every server's loads back from host.
func (ab *abRun) setBandwidth(ctx context.Context, bps int64) error {
	for _, s := range ab.servers {
		if !s.tiered() {
			continue
		}
		if _, err := s.t.c.SetHiCacheBandwidth(ctx, bps); err != nil {
			return fmt.Errorf("%s (%s): pacing the loads to %s: %w", s.t.URL, s.t.Role, config.FormatRate(bps), err)
		}
	}
	return nil
}

// restore puts every server back as it was found: index-K (prefill
// servers first), the host tier on or off, the load pacing when the run
// set it. It runs even when ctx has ended, within abRestoreWithin, and
// returns what it could not restore.
func (ab *abRun) restore(ctx context.Context) []string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ab.opts.Drain+abRestoreWithin)
	defer cancel()
	var errs []string
	for _, s := range ab.servers {
		if s.found.IndexK == "" {
			continue
		}
		if err := ab.indexKOn(ctx, s, s.found.IndexK); err != nil {
			errs = append(errs, err.Error())
		}
	}
	for _, s := range ab.servers {
		if !s.tiered() {
			continue
		}
		if ab.opts.SetBandwidth {
			if _, err := s.t.c.SetHiCacheBandwidth(ctx, s.found.LoadBandwidthBytesPerSecond); err != nil {
				errs = append(errs, fmt.Sprintf("%s (%s): pacing the loads back to %s: %v", s.t.URL, s.t.Role, config.FormatRate(s.found.LoadBandwidthBytesPerSecond), err))
			}
		}
		if err := ab.hicacheOn(ctx, s, s.found.HiCache == "on"); err != nil {
			errs = append(errs, err.Error())
		}
	}
	return errs
}

// pollUntil calls cond every abPollEvery until it holds, fails, ctx ends
// or deadline passes (the failure is then timeout).
func pollUntil(ctx context.Context, deadline time.Time, timeout string, cond func() (bool, error)) error {
	for {
		ok, err := cond()
		switch {
		case err != nil:
			return err
		case ok:
			return nil
		case time.Now().After(deadline):
			return errors.New(timeout)
		}
		if err := sleepCtx(ctx, abPollEvery); err != nil {
			return err
		}
	}
}

// sleepCtx waits d, or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
