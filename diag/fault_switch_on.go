package diag

import (
	"fmt"
	"regexp"
	"strings"
)

func faultSwitchOn() Rule {
	return Rule{
		Name:     "fault-switch-on",
		Doc:      "A server runs with a fault switch on: a real code path that reproduces a failure (a drill, or one left on), which explains what the other findings show.",
		Severity: Warning,
		Basis:    LastSample,
		Check:    checkFaultSwitchOn,
	}
}

func checkFaultSwitchOn(w Window) []Finding {
	var out []Finding
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.Faults == nil {
			continue
		}
		var names []string
		var evidence []Evidence
		for _, f := range s.Faults.Faults {
			if f.On {
				names = append(names, f.Name)
				evidence = append(evidence, ev(f.Name, "%s", f.Doc))
			}
		}
		if len(names) == 0 {
			continue
		}
		var offs []string
		for _, n := range names {
			offs = append(offs, fmt.Sprintf("pdctl fault off %s --server %s", n, s.URL))
		}
		out = append(out, Finding{
			Rule: "fault-switch-on", Severity: Warning, Server: s.URL, Rank: nil,
			Summary:  fmt.Sprintf("the %s server runs with the fault %s on: %s", s.Role, plural(len(names), "switch", "switches"), strings.Join(names, ", ")),
			Evidence: evidence,
			Remedy:   "unless a drill needs it, switch it off (" + strings.Join(offs, "; ") + "); a server started with --fault keeps it across restarts until the flag is removed.",
		})
	}
	return out
}

var faultInReason = regexp.MustCompile(`fault ([a-z0-9-]+)`)

// faultNamed returns the fault switch an exit reason or error names, if
// any ("... (fault bootstrap-abort-crash) ...").
func faultNamed(reason string) string {
	if m := faultInReason.FindStringSubmatch(reason); m != nil {
		return m[1]
	}
	return ""
}

// plural is "switch" or "switches" for n.
func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
