package main

// What pdctl does on every server at once: read a listing (fault list,
// hicache status, indexk status), apply a switch (fault on|off, hicache
// on|off; indexk set, in two rounds).

import (
	"context"
	"sync"

	"github.com/pdkit/pdkit/api/client"
)

// serverRow is where a server of a listing is, and why it did not answer.
type serverRow struct {
	URL   string `json:"url"`
	Role  string `json:"role"`
	Error string `json:"error,omitempty"`
}

// readServers calls read on every reachable server at once and returns, per
// server, its row and what read answered; a server that cannot be reached,
// or whose read fails, has the error in its row and the zero answer.
func readServers[T any](targets []*target, read func(*target) (T, error)) ([]serverRow, []T) {
	rows, answers := make([]serverRow, len(targets)), make([]T, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		rows[i] = serverRow{URL: t.URL, Role: t.Role}
		if t.Err != nil {
			rows[i].Error = t.Err.Error()
			continue
		}
		wg.Go(func() {
			a, err := read(t)
			if err != nil {
				rows[i].Error = err.Error()
				return
			}
			answers[i] = a
		})
	}
	wg.Wait()
	return rows, answers
}

// addUnreachable adds the row of a server that did not answer to a
// listing's table.
func (t *table) addUnreachable(r serverRow) {
	t.add(r.URL, r.Role, "", "unreachable: "+r.Error)
}

// printListing writes out as JSON with --json, else tab; then it fails, with
// findings, when some of the servers in rows did not answer.
func printListing(f *factory, asJSON bool, out any, tab *table, rows []serverRow) error {
	var err error
	if asJSON {
		err = writeJSON(f.Out, out)
	} else {
		err = tab.print(f)
	}
	if err != nil {
		return err
	}
	unreachable := 0
	for _, r := range rows {
		if r.Error != "" {
			unreachable++
		}
	}
	if unreachable > 0 {
		return &unreachableError{n: unreachable, of: len(rows)}
	}
	return nil
}

// switchOutcome is how one server's row of a switch counts.
type switchOutcome int

const (
	switchSkipped     switchOutcome = iota // the switch does not apply to the server
	switchDone                             // the server took the switch
	switchUnreachable                      // the server could not be reached
	switchRefused                          // the server answered with an error
)

// serverSwitch is a switch that pdctl applies to every server at once (fault
// on|off, hicache on|off).
type serverSwitch struct {
	// columns name what each row shows between ROLE and RESULT, cells
	// their values: the same on every row (the fault's name).
	columns, cells []string
	// apply switches one reachable server: the row's result and how it
	// counts.
	apply func(ctx context.Context, t *target) (string, switchOutcome)
	// none is the failure when every server answered and none took the
	// switch.
	none error
}

// run applies the switch to every server and prints one row per server. It
// fails when a server refused the switch; else, with findings, when a server
// could not be reached; else when no server took it.
func (s serverSwitch) run(ctx context.Context, f *factory, attach *attachOptions) error {
	targets, err := attach.targets(ctx, f)
	if err != nil {
		return err
	}
	results, outcomes := applyAll(ctx, targets, func(ctx context.Context, _ int, t *target) (string, switchOutcome) { return s.apply(ctx, t) })
	counts := map[switchOutcome]int{}
	for _, o := range outcomes {
		counts[o]++
	}
	tab := newTable(append(append([]string{"SERVER", "ROLE"}, s.columns...), "RESULT"))
	for i, t := range targets {
		tab.add(append(append([]string{t.URL, t.Role}, s.cells...), results[i])...)
	}
	if err := tab.print(f); err != nil {
		return err
	}
	switch {
	case counts[switchRefused] > 0:
		return errorf("%s refused the switch", pluralf(counts[switchRefused], "server", "servers"))
	case counts[switchUnreachable] > 0:
		return &unreachableError{n: counts[switchUnreachable], of: len(targets)}
	case counts[switchDone] == 0:
		return s.none
	}
	return nil
}

// applyAll applies a switch to every target at once (apply gets the
// target's index in targets) and returns each one's result and outcome, in
// the order of targets; a target that could not be reached is unreachable
// without a call.
func applyAll(ctx context.Context, targets []*target, apply func(ctx context.Context, i int, t *target) (string, switchOutcome)) ([]string, []switchOutcome) {
	results, outcomes := make([]string, len(targets)), make([]switchOutcome, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		if t.Err != nil {
			results[i], outcomes[i] = "unreachable: "+t.Err.Error(), switchUnreachable
			continue
		}
		wg.Go(func() { results[i], outcomes[i] = apply(ctx, i, t) })
	}
	wg.Wait()
	return results, outcomes
}

// switchFailure is the row of a failed admin or debug call: refused (the
// server answered with an error) or unreachable.
func switchFailure(err error) (string, switchOutcome) {
	if client.StatusOf(err) != 0 {
		return "refused: " + err.Error(), switchRefused
	}
	return "unreachable: " + err.Error(), switchUnreachable
}

// onOff names a switch's state.
func onOff(on bool) string {
	if on {
		return "on"
	}
	return "off"
}
