package main

import (
	"context"
	"fmt"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/spf13/cobra"
)

func newCmdHiCache(f *factory) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hicache <command>",
		Short: "Show and switch the servers' host-memory KV tier (HiCache)",
		Long: `HiCache is a host-memory tier under each rank's prefix cache: prefix pages are
backed up to host memory and loaded back layer by layer when a prompt needs
them. "hicache status" shows every server's ranks (GET /debug/v1/hicache):
on or off, write policy, the host pool's tokens used and in all, the load
pacing, host hits and loads. "hicache on" and "hicache off" switch the tier
live on every server through the admin API (with --token when the servers
require one); a server without a prefix cache is reported as skipped, and
any server that refuses the switch or cannot be reached makes the exit
status 1.`,
		Args: needsCommand("status, on or off"),
		RunE: func(cmd *cobra.Command, args []string) error { return nil },
	}
	cmd.AddCommand(newCmdHiCacheStatus(f, nil))
	cmd.AddCommand(newCmdHiCacheSet(f, true, nil))
	cmd.AddCommand(newCmdHiCacheSet(f, false, nil))
	return cmd
}

type hicacheStatusOptions struct {
	f      *factory
	Attach *attachOptions
	JSON   bool
}

func newCmdHiCacheStatus(f *factory, runF func(context.Context, *hicacheStatusOptions) error) *cobra.Command {
	opts := &hicacheStatusOptions{f: f, Attach: &f.attach}
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show every server's host tier, rank by rank",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return hicacheStatusRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

// serverHiCache is one server in the output of hicache status.
type serverHiCache struct {
	serverRow
	HiCache *debug.HiCacheResponse `json:"hicache,omitempty"`
}

func hicacheStatusRun(ctx context.Context, opts *hicacheStatusOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	rows, answers := readServers(targets, func(t *target) (debug.HiCacheResponse, error) { return t.c.HiCache(ctx) })
	out := struct {
		Servers []serverHiCache `json:"servers"`
	}{Servers: make([]serverHiCache, len(targets))}
	tab := newTable([]string{"SERVER", "ROLE", "RANK", "STATE", "POLICY", "HOST TOKENS USED/TOTAL", "LOAD BANDWIDTH", "HOST HITS", "HIT TOKENS", "LOADS", "BACKUPS"})
	for i, row := range rows {
		s := &out.Servers[i]
		s.serverRow = row
		if row.Error != "" {
			tab.addUnreachable(row)
			continue
		}
		s.HiCache = &answers[i]
		if !s.HiCache.PrefixCache {
			tab.add(row.URL, row.Role, "", "n/a: no prefix cache")
			continue
		}
		if s.HiCache.NoTier != "" {
			tab.add(row.URL, row.Role, "", "n/a: "+tierlessRole(row.Role))
			continue
		}
		for _, r := range s.HiCache.Ranks {
			bw := "unlimited"
			if r.LoadBandwidthBytesPerSecond > 0 {
				bw = fmtRate(r.LoadBandwidthBytesPerSecond)
			}
			t := r.Totals
			tab.add(row.URL, row.Role, itoa(r.Rank), onOff(r.On), r.Policy, fmt.Sprintf("%d/%d", r.HostTokensUsed, r.HostTokens), bw,
				fmt.Sprint(t.HostHits), fmt.Sprint(t.HitTokens), fmt.Sprint(t.Loads), fmt.Sprint(t.Backups))
		}
	}
	return printListing(f, opts.JSON, out, tab, rows)
}

// fmtRate writes bytes per second in the largest decimal unit that keeps a
// number of at least 1: "2GB/s", "1.5MB/s", "512B/s".
func fmtRate(bps int64) string {
	v, unit := float64(bps), "B/s"
	for _, u := range []string{"kB/s", "MB/s", "GB/s", "TB/s"} {
		if v < 1000 {
			break
		}
		v, unit = v/1000, u
	}
	return fmt.Sprintf("%.4g%s", v, unit)
}

type hicacheSetOptions struct {
	f      *factory
	Attach *attachOptions
	On     bool
}

func newCmdHiCacheSet(f *factory, on bool, runF func(context.Context, *hicacheSetOptions) error) *cobra.Command {
	opts := &hicacheSetOptions{f: f, Attach: &f.attach, On: on}
	verb, short := "off", "Switch the host tier off on every server (loads in flight finish, the host pool is freed)"
	if on {
		verb, short = "on", "Switch the host tier on on every server (sized by each server's --hicache-size or --hicache-ratio)"
	}
	cmd := &cobra.Command{
		Use:   verb,
		Short: short,
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return hicacheSetRun(cmd.Context(), opts)
		},
	}
	return cmd
}

// hicacheSetRun switches the tier on every server and prints one row per
// server: the new state ("already" when it was so, "pending" when the
// server's loops had not taken it when it answered), "skipped" on a server
// without a prefix cache, or the error. It fails when a server refused the
// switch or could not be reached, or when no server has a prefix cache.
func hicacheSetRun(ctx context.Context, opts *hicacheSetOptions) error {
	state := onOff(opts.On)
	return serverSwitch{
		apply: func(ctx context.Context, t *target) (string, switchOutcome) {
			h, err := t.c.HiCache(ctx)
			if err != nil {
				return switchFailure(err)
			}
			if !h.PrefixCache {
				return "skipped: no prefix cache on this server", switchSkipped
			}
			if h.NoTier != "" {
				return "skipped: " + tierlessRole(t.Role), switchSkipped
			}
			r, err := t.c.SetHiCache(ctx, opts.On)
			switch {
			case err != nil:
				return switchFailure(err)
			case r.Pending:
				return state + " (pending: not yet taken by every rank)", switchDone
			case !r.Changed:
				return state + " (already)", switchDone
			}
			return state, switchDone
		},
		none: errorf("no server has a host tier to switch %s (it needs the prefix cache, and a decode server keeps none)", state),
	}.run(ctx, opts.f, opts.Attach)
}

// tierlessRole is the short reason a server of role has no host tier, for
// a table cell.
func tierlessRole(role string) string {
	if role == "decode" {
		return "a decode server keeps no host tier (its prompt KV comes from the prefill)"
	}
	return "no host tier on this server"
}
