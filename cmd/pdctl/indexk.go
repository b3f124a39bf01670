package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/spf13/cobra"
)

func newCmdIndexK(f *factory) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "indexk <command>",
		Short: "Show and switch the servers' index-K precision (the sparse indexer's keys)",
		Long: `A model with a sparse indexer (llama-dsa, deepseek2-dsa) stores an index key per token, in
one of two precisions: fp8 (e4m3 with a scale per token) or bf16. "indexk
status" shows every server's precision, whether its model has an indexer,
and the live switches it has done. "indexk set fp8|bf16" switches the whole
cluster live through the admin API (with --token when the servers require
one): each server drains (it stops admitting, lets the requests in flight
finish for at most --drain, then aborts what is left), drops the prefixes
it cached in the old precision and resumes in the new one.

The two sides of a PD pair must run the same precision: the handshake
refuses a prefill's KV in another one. So "indexk set" first pauses the
router (POST /admin/v1/pause): new requests wait at its edge, queued, and
the requests in flight finish (for at most --drain). Once none is left, no
pair can meet mid-switch, and every server switches at once; then the
router resumes and the requests that waited are served. A request still in
flight past --drain ends as an abort (finish_reason "abort"), never as an
error. With --server (no router to pause), or a router that cannot be
paused, it switches every prefill server first, then every decode server,
and requests routed between the two rounds fail, naming the precisions.`,
		Args: needsCommand("status, set or ab"),
		RunE: func(cmd *cobra.Command, args []string) error { return nil },
	}
	cmd.AddCommand(newCmdIndexKStatus(f, nil))
	cmd.AddCommand(newCmdIndexKSet(f, nil))
	cmd.AddCommand(newCmdIndexKAB(f, nil))
	return cmd
}

type indexkStatusOptions struct {
	f      *factory
	Attach *attachOptions
	JSON   bool
}

func newCmdIndexKStatus(f *factory, runF func(context.Context, *indexkStatusOptions) error) *cobra.Command {
	opts := &indexkStatusOptions{f: f, Attach: &f.attach}
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show every server's index-K precision, whether its model has an indexer, and its switches",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return indexkStatusRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

// serverIndexK is one server in the output of indexk status.
type serverIndexK struct {
	serverRow
	// IndexK is the precision the server stores index keys in now; it
	// matters only with Indexer.
	IndexK  string `json:"index_k,omitempty"`
	Indexer bool   `json:"indexer"`
	// Switches counts the live switches the server has done.
	Switches uint64 `json:"switches"`
	// SwitchingTo is the precision of a switch under way; empty when none.
	SwitchingTo string `json:"switching_to,omitempty"`
}

func indexkStatusRun(ctx context.Context, opts *indexkStatusOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	rows, answers := readServers(targets, func(t *target) (debug.StateResponse, error) { return t.c.State(ctx) })
	out := struct {
		Servers []serverIndexK `json:"servers"`
	}{Servers: make([]serverIndexK, len(targets))}
	tab := newTable([]string{"SERVER", "ROLE", "INDEX-K", "INDEXER", "SWITCHES"})
	for i, row := range rows {
		s := &out.Servers[i]
		s.serverRow = row
		if row.Error != "" {
			tab.addUnreachable(row)
			continue
		}
		st := answers[i]
		s.IndexK, s.Indexer, s.SwitchingTo = st.Settings.IndexK, st.Settings.Indexer, st.Settings.IndexKSwitch
		if st.Snapshot != nil {
			s.Switches = st.Snapshot.Totals.IndexKSwitches
		}
		if !s.Indexer {
			tab.add(row.URL, row.Role, "n/a: "+noIndexer, "no", fmt.Sprint(s.Switches))
			continue
		}
		tab.add(row.URL, row.Role, indexKCell(s.IndexK, s.SwitchingTo), "yes", fmt.Sprint(s.Switches))
	}
	return printListing(f, opts.JSON, out, tab, rows)
}

// indexKCell names a server's precision, and the one a switch under way
// goes to: "fp8", "fp8 (switching to bf16)".
func indexKCell(now, to string) string {
	if to == "" || to == now {
		return now
	}
	return now + " (switching to " + to + ")"
}

type indexkSetOptions struct {
	f      *factory
	Attach *attachOptions
	To     string
	Drain  time.Duration
	JSON   bool
}

func newCmdIndexKSet(f *factory, runF func(context.Context, *indexkSetOptions) error) *cobra.Command {
	opts := &indexkSetOptions{f: f, Attach: &f.attach}
	cmd := &cobra.Command{
		Use:   "set fp8|bf16",
		Short: "Switch the index-K precision of the whole cluster, the router paused so that no request meets two precisions",
		Long: `Switches every server to the precision given (through POST
/admin/v1/indexk/fp8 or /bf16). The router is paused first (POST
/admin/v1/pause, with a lease after which it resumes by itself): new
requests wait at its edge, and the call waits up to --drain for those in
flight. Once they have ended, every server switches at once, with what is
left of --drain for requests that did not come through the router; then the
router resumes (POST /admin/v1/resume).

Without a router to pause (--server), or when the pause fails or the
requests in flight outlast --drain, it switches every prefill and colocated
server first, then, once every prefill server runs the new precision,
every decode server: a decode switched before its prefill servers would
refuse their KV. So when a prefill server does not switch (it refused,
could not be reached, or was still draining when it answered), the decode
servers are left as they are, and so they are when a server that could not
be reached has no known role.

Each server drains for at most the drain given: the requests in flight
finish, or are aborted once it has passed; new requests wait, queued, until
the switch is done. One row for the router (how long it was paused, how many
requests waited), then one per server, in the order they were switched: its
precision before and after, how long it paused (did not admit), the
requests the drain bound aborted, and the result: switched, already (it ran
that precision), pending (still draining when it answered; GET
/debug/v1/settings shows index_k once done), skipped (no sparse indexer;
or a decode server left alone), refused or unreachable. A server that did
not switch makes the exit status 1, and the message says which servers run
which precision now: the cluster may be mixed.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 || (args[0] != debug.IndexKFP8 && args[0] != debug.IndexKBF16) {
				return newUsageError(cmd, "indexk set takes one precision, fp8 or bf16, got %q", args)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.Drain < 0 {
				return newUsageError(cmd, "--drain %v: want a non-negative duration", opts.Drain)
			}
			opts.To = args[0]
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return indexkSetRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().DurationVar(&opts.Drain, "drain", debug.IndexKDefaultDrain, "how long each server lets its requests in flight finish before it aborts them")
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

// The results of a server's row in indexk set.
const (
	indexKSwitched    = "switched"
	indexKAlready     = "already"
	indexKPending     = "pending"
	indexKSkipped     = "skipped"
	indexKRefused     = "refused"
	indexKUnreachable = "unreachable"
)

// indexKRow is one server's row of indexk set (JSON as shown).
type indexKRow struct {
	URL  string `json:"url"`
	Role string `json:"role"`
	// Result is switched, already, pending, skipped, refused or
	// unreachable; Detail says why for the last three (and pending).
	Result string `json:"result"`
	Detail string `json:"detail,omitempty"`
	// From and To are the precisions before and after the switch, as the
	// server answered; From alone when the server was not switched.
	From     string  `json:"from,omitempty"`
	To       string  `json:"to,omitempty"`
	PausedMS float64 `json:"paused_ms"`
	Aborted  int     `json:"aborted"`
	// IndexK is the precision the server reported once every switch was
	// answered; empty when it did not answer (or has no indexer).
	IndexK string `json:"index_k,omitempty"`

	indexer bool
}

// failed says the server should run the new precision and may not.
func (r *indexKRow) failed() bool {
	return r.Result == indexKPending || r.Result == indexKRefused || r.Result == indexKUnreachable
}

// indexKRound is the round a server of role switches in: decode servers
// last.
func indexKRound(role string) int {
	if role == pdproto.RoleDecode {
		return 2
	}
	return 1
}

// switchIndexK switches the servers of targets to precision to, prefill
// and colocated servers first, then, when every prefill server runs to,
// the decode servers, each draining for at most drain; it returns one row
// per server in that order, with the precision each reports afterwards.
func switchIndexK(ctx context.Context, targets []*target, to string, drain time.Duration) []indexKRow {
	roundOf := indexKRound
	rows := make([]indexKRow, len(targets))
	for i, t := range targets {
		rows[i] = indexKRow{URL: t.URL, Role: t.Role}
	}
	// fail fills in the row of a call that failed: refused or unreachable.
	fail := func(r *indexKRow, err error) (string, switchOutcome) {
		text, o := switchFailure(err)
		r.Result, r.Detail, _ = strings.Cut(text, ": ")
		return text, o
	}
	// What each runs now, and whether it has an indexer.
	results, _ := applyAll(ctx, targets, func(ctx context.Context, i int, t *target) (string, switchOutcome) {
		st, err := t.c.Settings(ctx)
		if err != nil {
			return fail(&rows[i], err)
		}
		rows[i].indexer, rows[i].From = st.Indexer, st.IndexK
		if !st.Indexer {
			rows[i].Result, rows[i].Detail, rows[i].From = indexKSkipped, noIndexer, ""
		}
		return "", switchDone
	})
	for i, t := range targets {
		if t.Err != nil {
			rows[i].Result, rows[i].Detail, _ = strings.Cut(results[i], ": ")
		}
	}
	apply := func(ctx context.Context, i int, t *target) (string, switchOutcome) {
		r := &rows[i]
		res, err := t.c.SetIndexK(ctx, to, drain)
		if err != nil {
			return fail(r, err)
		}
		r.From, r.To, r.PausedMS, r.Aborted = res.From, res.To, res.PausedMS, res.Aborted
		switch {
		case res.Pending:
			r.Result = indexKPending
			r.Detail = fmt.Sprintf("still draining when it answered; GET %s shows index_k %s once done", debug.SettingsPath, to)
		case !res.Changed:
			r.Result = indexKAlready
		default:
			r.Result = indexKSwitched
		}
		return r.Result, switchDone
	}
	// round runs apply on the servers of round n still to switch.
	round := func(n int) {
		var sub []*target
		var idx []int
		for i, t := range targets {
			if rows[i].Result == "" && roundOf(t.Role) == n {
				sub, idx = append(sub, t), append(idx, i)
			}
		}
		applyAll(ctx, sub, func(ctx context.Context, j int, t *target) (string, switchOutcome) { return apply(ctx, idx[j], t) })
	}
	round(1)
	// The decode servers wait for every prefill server, and for every
	// server whose role is not known (it could not be reached).
	var held []string
	for i, t := range targets {
		if rows[i].failed() && t.Role != pdproto.RoleColocated && roundOf(t.Role) == 1 {
			held = append(held, t.URL)
		}
	}
	if len(held) > 0 {
		for i, t := range targets {
			if rows[i].Result == "" && roundOf(t.Role) == 2 {
				rows[i].Result = indexKSkipped
				rows[i].Detail = "left as it is: not every prefill server switched (" + strings.Join(held, ", ") + ")"
			}
		}
	}
	round(2)
	// What every server runs now.
	applyAll(ctx, targets, func(ctx context.Context, i int, t *target) (string, switchOutcome) {
		if st, err := t.c.Settings(ctx); err == nil && st.Indexer {
			rows[i].IndexK = st.IndexK
		}
		return "", switchDone
	})
	slices.SortStableFunc(rows, func(a, b indexKRow) int { return indexKRound(a.Role) - indexKRound(b.Role) })
	return rows
}

// noIndexer is the detail of a server skipped because its model has no
// sparse indexer.
const noIndexer = "no sparse indexer"

// indexKSwitchError is the failure of a cluster switch to precision to:
// nil when every server with an indexer runs it now; else which servers do
// not, and which run which precision: the cluster may be mixed.
func indexKSwitchError(rows []indexKRow, to string) error {
	var failed []string
	by := map[string][]string{}
	indexers := 0
	for _, r := range rows {
		if r.Result == indexKSkipped && r.Detail == noIndexer {
			continue
		}
		indexers++
		k := r.IndexK
		if k == "" {
			k = "unknown"
		}
		by[k] = append(by[k], r.URL)
		if k != to || r.failed() {
			failed = append(failed, r.URL)
		}
	}
	if indexers == 0 {
		return errorf("no server's model has a sparse indexer, so none has an index-K precision to switch")
	}
	if len(failed) == 0 {
		return nil
	}
	other := debug.IndexKFP8
	if to == debug.IndexKFP8 {
		other = debug.IndexKBF16
	}
	var parts []string
	for _, k := range []string{to, other, "unknown"} {
		if urls := by[k]; len(urls) > 0 {
			parts = append(parts, k+" on "+strings.Join(urls, ", "))
		}
	}
	return errorf("the switch to %s did not take on %s (%s); the cluster may be mixed: %s",
		to, pluralf(len(failed), "server", "servers"), strings.Join(failed, ", "), strings.Join(parts, "; "))
}

func indexkSetRun(ctx context.Context, opts *indexkSetOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	// The router forms no new pair while the servers switch.
	rp := pauseRouter(ctx, opts.Attach.routerClient(f), opts.Drain)
	rows := switchIndexK(ctx, targets, opts.To, opts.Drain)
	rp.resume(ctx)
	if opts.JSON {
		err = writeJSON(f.Out, struct {
			To      string          `json:"to"`
			DrainMS float64         `json:"drain_ms"`
			Router  *routerPauseRow `json:"router,omitempty"`
			Servers []indexKRow     `json:"servers"`
		}{opts.To, float64(opts.Drain) / float64(time.Millisecond), rp, rows})
	} else {
		tab := newTable([]string{"SERVER", "ROLE", "FROM", "TO", "PAUSED", "ABORTED", "RESULT"}, "PAUSED")
		if rp != nil {
			paused := ""
			if rp.paused {
				paused = fmtMS(rp.PausedMS)
			}
			tab.add(rp.URL, pdproto.RoleRouter, "", "", paused, "", rp.Result)
		}
		for _, r := range rows {
			paused, aborted := "", ""
			if r.Result == indexKSwitched || r.Result == indexKPending {
				paused, aborted = fmtMS(r.PausedMS), itoa(r.Aborted)
			}
			if r.Result == indexKAlready {
				aborted = "0"
			}
			result := r.Result
			if r.Detail != "" {
				result += ": " + r.Detail
			}
			tab.add(r.URL, r.Role, r.From, r.To, paused, aborted, result)
		}
		err = tab.print(f)
	}
	if err != nil {
		return err
	}
	return indexKSwitchError(rows, opts.To)
}

// routerPauseRow is the router's part of indexk set: it pauses admission
// while the servers switch (JSON as shown).
type routerPauseRow struct {
	URL string `json:"url"`
	// Result says how the pause went: "paused, N requests waited", or
	// why the router was not paused (the servers then switch in two
	// rounds, and requests routed between them may fail).
	Result string `json:"result"`
	// WaitedMS is how long the router's requests in flight took to end;
	// PausedMS how long it admitted nothing; Held the requests that
	// waited at its edge meanwhile.
	WaitedMS float64 `json:"waited_ms"`
	PausedMS float64 `json:"paused_ms"`
	Held     uint64  `json:"held"`

	c      *client.Client
	paused bool
}

// pauseLease bounds a pause for a switch with drain: the router's drain,
// each server's own drain and answer margin, and room to spare. A pdctl
// that dies mid-switch leaves the router paused no longer than this.
func pauseLease(drain time.Duration) time.Duration {
	return 2*drain + 2*debug.IndexKSwitchMargin + 30*time.Second
}

// pauseRouter pauses the router of rc for a switch (nil without a
// router: the servers were named with --server), waiting up to drain for
// its requests in flight to end.
func pauseRouter(ctx context.Context, rc *client.Client, drain time.Duration) *routerPauseRow {
	if rc == nil {
		return nil
	}
	rp := &routerPauseRow{URL: rc.BaseURL, c: rc}
	res, err := rc.Pause(ctx, drain, pauseLease(drain))
	if err != nil {
		rp.Result = "not paused: " + err.Error() + "; the servers switch prefill first, and requests routed between the two rounds may fail"
		return rp
	}
	rp.paused, rp.WaitedMS = true, res.WaitedMS
	if !res.Drained {
		rp.Result = fmt.Sprintf("paused; %s still in flight after --drain", pluralf(res.InFlight, "request", "requests"))
	}
	return rp
}

// resume resumes the router paused by pauseRouter, even when ctx has
// ended (an operator's ^C must not leave the cluster closed until the
// lease ends).
func (rp *routerPauseRow) resume(ctx context.Context) {
	if rp == nil || !rp.paused {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	res, err := rp.c.Resume(ctx)
	if err != nil {
		rp.Result = "paused, and the resume failed: " + err.Error() + "; it resumes by itself when its lease ends"
		return
	}
	rp.PausedMS, rp.Held = res.PausedMS, res.Held
	waited := pluralf(int(res.Held), "request", "requests") + " waited"
	if rp.Result == "" {
		rp.Result = "paused: " + waited
	} else {
		rp.Result += "; " + waited
	}
}
