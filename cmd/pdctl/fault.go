package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"

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
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return newUsageError(cmd, "fault needs a command: list, on or off")
			}
			return newUsageError(cmd, "unknown command %q for %q", args[0], cmd.CommandPath())
		},
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
	URL    string        `json:"url"`
	Role   string        `json:"role"`
	Error  string        `json:"error,omitempty"`
	Faults []debug.Fault `json:"faults,omitempty"`
}

func faultListRun(ctx context.Context, opts *faultListOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	out := struct {
		Servers []serverFaults `json:"servers"`
	}{Servers: make([]serverFaults, len(targets))}
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() {
			s := serverFaults{URL: t.URL, Role: t.Role}
			if t.Err != nil {
				s.Error = t.Err.Error()
			} else if r, err := t.c.Faults(ctx); err != nil {
				s.Error = err.Error()
			} else {
				s.Faults = []debug.Fault{}
				for _, fl := range r.Faults {
					if opts.keep(fl) {
						s.Faults = append(s.Faults, fl)
					}
				}
			}
			out.Servers[i] = s
		})
	}
	wg.Wait()
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
	unreachable := 0
	tab := newTable([]string{"SERVER", "ROLE", "FAULT", "STATE", "ROLES", "DOC"})
	for _, s := range out.Servers {
		if s.Error != "" {
			unreachable++
			tab.add(s.URL, s.Role, "", "unreachable: "+s.Error)
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
	if opts.JSON {
		err = writeJSON(f.Out, out)
	} else {
		err = tab.print(f)
	}
	if err != nil {
		return err
	}
	if unreachable > 0 {
		return &unreachableError{n: unreachable, of: len(targets)}
	}
	return nil
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
// of another role), or the error. It fails when no server took the switch.
func faultSetRun(ctx context.Context, opts *faultSetOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	results := make([]string, len(targets))
	var switched, unreachable, refused int
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() {
			var res string
			var ok, down, no bool
			if t.Err != nil {
				res, down = "unreachable: "+t.Err.Error(), true
			} else if _, err := t.c.SetFault(ctx, opts.Name, opts.On); err == nil {
				res, ok = "off", true
				if opts.On {
					res = "on"
				}
			} else if st := client.StatusOf(err); st == http.StatusBadRequest {
				var ae *client.APIError
				errorsAs(err, &ae)
				res = "skipped: " + ae.Message
			} else if st != 0 {
				res, no = "refused: "+err.Error(), true
			} else {
				res, down = "unreachable: "+err.Error(), true
			}
			mu.Lock()
			defer mu.Unlock()
			results[i] = res
			switch {
			case ok:
				switched++
			case down:
				unreachable++
			case no:
				refused++
			}
		})
	}
	wg.Wait()
	tab := newTable([]string{"SERVER", "ROLE", "FAULT", "RESULT"})
	for i, t := range targets {
		tab.add(t.URL, t.Role, opts.Name, results[i])
	}
	if err := tab.print(f); err != nil {
		return err
	}
	switch {
	case refused > 0:
		return errorf("%s refused the switch", pluralf(refused, "server", "servers"))
	case switched == 0 && unreachable == 0:
		return errorf("fault %q applies to none of the servers", opts.Name)
	case unreachable > 0:
		return &unreachableError{n: unreachable, of: len(targets)}
	}
	return nil
}
