package diag

import (
	"fmt"
	"time"
)

func routerUnreachable() Rule {
	return Rule{
		Name: "router-unreachable",
		Doc: "The router does not answer (frozen, gone, or its port unreachable), so no client request gets in, " +
			"whatever its servers do; diagnose then samples the servers directly, as it last discovered them.",
		Severity: Critical,
		Basis:    LastSample,
		Check:    checkRouterUnreachable,
	}
}

func checkRouterUnreachable(w Window) []Finding {
	r := w.Last().Router
	if r == nil || r.Reachable {
		return nil
	}
	since := "unreachable in the first sample too"
	if f := w.First().Router; f != nil && f.Reachable {
		since = "reachable in the first sample"
	}
	evidence := []Evidence{ev("error", "%s", r.Error), ev("history", "%s", since)}
	if w.DiscoveredAt != nil {
		evidence = append(evidence, ev("servers", "sampled directly, as pdctl last discovered them through the router %s before the first sample",
			w.First().Taken.Sub(*w.DiscoveredAt).Round(time.Second)))
	}
	return []Finding{{
		Rule: "router-unreachable", Severity: Critical, Server: r.URL,
		Summary:  fmt.Sprintf("the router does not answer: %s", r.Error),
		Evidence: evidence,
		Remedy: fmt.Sprintf("check that the router process (pdserve router) at %s runs and its port is reachable from here and from the clients; "+
			"restart it if it is gone or frozen (pdctl --server URL reaches each server without it).", r.URL),
	}}
}
