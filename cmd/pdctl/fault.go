package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/spf13/cobra"
)

func newCmdFault(f *factory) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fault <command>",
		Short: "List and switch the servers' named fault paths",
		Long: `A fault is a real code path, off by default, that reproduces a production
failure, or a generic chaos switch (drop or delay one message type, stall a
rank, end a receive loop); see GET /debug/v1/faults. "fault list" shows every
fault of every server (only those named, or only those on with --on);
"fault on NAME" and "fault off NAME" switch one live through the admin
API (with --token when the servers require one). A fault that does not apply
to a server's role is reported for that server and leaves it alone.`,
		Args: needsCommand("list, on or off"),
		RunE: func(cmd *cobra.Command, args []string) error { return nil },
	}
	cmd.AddCommand(newCmdFaultList(f, nil))
	cmd.AddCommand(newCmdFaultSet(f, true, nil))
	cmd.AddCommand(newCmdFaultSet(f, false, nil))
	return cmd
}

type faultListOptions struct {
	f      *factory
	Attach *attachOptions
	Names  []string // only these faults; empty: every fault
	OnOnly bool
	JSON   bool
}

func newCmdFaultList(f *factory, runF func(context.Context, *faultListOptions) error) *cobra.Command {
	opts := &faultListOptions{f: f, Attach: &f.attach}
	cmd := &cobra.Command{
		Use:   "list [NAME...]",
		Short: "List every server's fault switches and their state",
		RunE: func(cmd *cobra.Command, args []string) error {
			opts.Names = args
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return faultListRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().BoolVar(&opts.OnOnly, "on", false, "only the switches that are on")
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

// keep reports whether fault fl is in the listing of opts.
func (o *faultListOptions) keep(fl debug.Fault) bool {
	return (len(o.Names) == 0 || slices.Contains(o.Names, fl.Name)) && (!o.OnOnly || fl.On)
}

// serverFaults is one server in the output of fault list.
type serverFaults struct {
	serverRow
	Faults []debug.Fault `json:"faults,omitempty"`
}

func faultListRun(ctx context.Context, opts *faultListOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	rows, answers := readServers(targets, func(t *target) (debug.FaultsResponse, error) { return t.c.Faults(ctx) })
	out := struct {
		Servers []serverFaults `json:"servers"`
	}{Servers: make([]serverFaults, len(targets))}
	for i, row := range rows {
		s := &out.Servers[i]
		s.serverRow = row
		if row.Error != "" {
			continue
		}
		s.Faults = []debug.Fault{}
		for _, fl := range answers[i].Faults {
			if opts.keep(fl) {
				s.Faults = append(s.Faults, fl)
			}
		}
	}
	answered := slices.ContainsFunc(out.Servers, func(s serverFaults) bool { return s.Error == "" })
	for _, name := range opts.Names {
		known := false
		for _, s := range out.Servers {
			known = known || slices.ContainsFunc(s.Faults, func(fl debug.Fault) bool { return fl.Name == name })
		}
		if answered && !known && !opts.OnOnly {
			return fmt.Errorf("no server has a fault named %q", name)
		}
	}
	tab := newTable([]string{"SERVER", "ROLE", "FAULT", "STATE", "ROLES", "DOC"})
	for _, s := range out.Servers {
		if s.Error != "" {
			tab.addUnreachable(s.serverRow)
			continue
		}
		for _, fl := range s.Faults {
			state := "off"
			switch {
			case !slices.Contains(fl.Roles, s.Role):
				state = "n/a"
			case fl.On:
				state = "on"
			}
			tab.add(s.URL, s.Role, fl.Name, state, strings.Join(fl.Roles, ","), fl.Doc)
		}
	}
	return printListing(f, opts.JSON, out, tab, rows)
}

type faultSetOptions struct {
	f      *factory
	Attach *attachOptions
	Name   string
	On     bool
}

func newCmdFaultSet(f *factory, on bool, runF func(context.Context, *faultSetOptions) error) *cobra.Command {
	opts := &faultSetOptions{f: f, Attach: &f.attach, On: on}
	verb, short := "off", "Switch a fault off on every server it applies to"
	if on {
		verb, short = "on", "Switch a fault on on every server it applies to"
	}
	cmd := &cobra.Command{
		Use:   verb + " NAME",
		Short: short,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return newUsageError(cmd, "fault %s takes one fault name, got %q", verb, args)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			opts.Name = args[0]
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return faultSetRun(cmd.Context(), opts)
		},
	}
	return cmd
}

// faultSetRun switches the fault on every server and prints one row per
// server: the fault's new state, "skipped" with the server's reason (a fault
// of another role), or the error. It fails when a server refused the switch
// or could not be reached, or when the fault applies to none of them.
func faultSetRun(ctx context.Context, opts *faultSetOptions) error {
	state := onOff(opts.On)
	return serverSwitch{
		columns: []string{"FAULT"},
		cells:   []string{opts.Name},
		apply: func(ctx context.Context, t *target) (string, switchOutcome) {
			_, err := t.c.SetFault(ctx, opts.Name, opts.On)
			if err == nil {
				return state, switchDone
			}
			if client.StatusOf(err) == http.StatusBadRequest {
				var ae *client.APIError
				errorsAs(err, &ae)
				return "skipped: " + ae.Message, switchSkipped
			}
			return switchFailure(err)
		},
		none: errorf("fault %q applies to none of the servers", opts.Name),
	}.run(ctx, opts.f, opts.Attach)
}
