package diag

import (
	"fmt"
	"net"
	"strings"
)

func registryMismatch() Rule {
	return Rule{
		Name: "registry-mismatch",
		Doc: "A prefill server's bootstrap registry lists one of its ranks at an endpoint the rank does not listen on " +
			"(a registration by someone else, or a stale one), so decodes send that rank's rooms elsewhere: " +
			"their KV and first tokens come from wherever the registry points.",
		Severity: Critical,
		Basis:    LastSample,
		Check:    checkRegistryMismatch,
	}
}

func checkRegistryMismatch(w Window) []Finding {
	var out []Finding
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.Registry == nil || s.PD == nil {
			continue
		}
		for _, r := range s.PD.Ranks {
			// The endpoint the rank hands out (a server before it
			// published one: the bound one, a wildcard matching its port).
			own := r.Socket.Advertised
			if own == "" {
				own = r.Socket.Endpoint
			}
			var listed string
			for _, ri := range s.Registry.Ranks {
				if ri.Rank == r.Rank {
					listed = ri.Endpoint
				}
			}
			if listed == "" || own == "" || sameEndpoint(listed, own) {
				continue
			}
			out = append(out, Finding{
				Rule: "registry-mismatch", Severity: Critical, Server: s.URL, Rank: AtRank(r.Rank),
				Summary: fmt.Sprintf("the prefill server's bootstrap registry lists rank %d at %s, but the rank listens on %s: decodes send its rooms there", r.Rank, listed, own),
				Evidence: []Evidence{
					ev("registered", "%s", listed),
					ev("listening", "%s", own),
				},
				Remedy: "give every server the cluster secret (--cluster-secret-file or PD_CLUSTER_SECRET), so that only cluster members can register; " +
					"then restart this prefill server, which registers its ranks again as it starts.",
			})
		}
	}
	return out
}

// sameEndpoint compares two ZeroMQ TCP endpoints; a wildcard host (the
// socket bound to every address) matches any host on the same port.
func sameEndpoint(a, b string) bool {
	ha, pa, okA := splitEndpoint(a)
	hb, pb, okB := splitEndpoint(b)
	if !okA || !okB {
		return a == b
	}
	if pa != pb {
		return false
	}
	return ha == hb || wildcard(ha) || wildcard(hb)
}

func splitEndpoint(e string) (host, port string, ok bool) {
	rest, found := strings.CutPrefix(e, "tcp://")
	if !found {
		return "", "", false
	}
	host, port, err := net.SplitHostPort(rest)
	return host, port, err == nil
}

func wildcard(h string) bool {
	ip := net.ParseIP(h)
	return h == "*" || (ip != nil && ip.IsUnspecified())
}
