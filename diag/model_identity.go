package diag

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

func modelIdentity() Rule {
	return Rule{
		Name: "model-identity",
		Doc: "A server's model file changed under it (rewritten in place, another file moved to its path): " +
			"the weights it serves are mapped from that file, so its outputs change or it serves what no other server does; " +
			"or servers of one cluster serve different weights (their fingerprints differ).",
		Severity: Critical,
		Basis:    LastSample,
		Check:    checkModelIdentity,
	}
}

func checkModelIdentity(w Window) []Finding {
	last := w.Last()
	var out []Finding
	byWeights := map[string][]string{} // the weights' name@fingerprint -> servers
	for _, s := range last.Servers {
		if !s.Reachable || s.Settings == nil {
			continue
		}
		if hs := s.Settings.Handshake; hs != nil && hs.Model != "" {
			byWeights[hs.Model] = append(byWeights[hs.Model], s.URL)
		}
		mf := s.Settings.ModelFile
		if mf == nil || !mf.Changed {
			continue
		}
		out = append(out, Finding{
			Rule: "model-identity", Severity: Critical, Server: s.URL,
			Summary: fmt.Sprintf("the %s server's model file changed under it: %s", s.Role, mf.Why),
			Evidence: []Evidence{
				ev("file", "%s", mf.Path),
				ev("fingerprint at load", "%s", mf.Fingerprint),
				ev("what changed", "%s", mf.Why),
			},
			Remedy: "restart the server on the weights it should serve (pdserve serve|prefill|decode --model PATH); " +
				"replace a model file by renaming a new file into place, never by writing over it.",
		})
	}
	// Servers of the same fingerprint whose whole files differ: the
	// samples cannot tell them apart, a full hash (at load, or by pdctl
	// diagnose --rehash) can.
	byFile := map[string][]string{} // sha256 -> servers
	for _, s := range last.Servers {
		if s.Reachable && s.Settings != nil && s.Settings.ModelFile != nil && s.Settings.ModelFile.SHA256 != "" && !s.Settings.ModelFile.Changed {
			byFile[s.Settings.ModelFile.SHA256] = append(byFile[s.Settings.ModelFile.SHA256], s.URL)
		}
	}
	if len(byWeights) <= 1 && len(byFile) > 1 {
		out = append(out, groupsFinding(byFile,
			"the cluster's servers load %d different model files with the same fingerprint (their full hashes differ)",
			"the files differ where the fingerprint's samples do not read: copy one file to every server (its sha256 above) and restart them on it (pdserve ... --model PATH)."))
	}
	if len(byWeights) > 1 {
		out = append(out, groupsFinding(byWeights, "the cluster's servers serve %d different weights (their fingerprints differ)",
			"start every server on the same model file (pdserve ... --model PATH); PD pairs of different weights are refused at the handshake."))
	}
	return out
}

// groupsFinding is the warning that the servers fall into several groups
// (by weights, by file): one evidence line a group, summary given the
// number of groups.
func groupsFinding(groups map[string][]string, summary, remedy string) Finding {
	keys := slices.Sorted(maps.Keys(groups))
	var evidence []Evidence
	for _, k := range keys {
		evidence = append(evidence, ev(k, "%s", strings.Join(groups[k], ", ")))
	}
	return Finding{Rule: "model-identity", Severity: Warning, Server: groups[keys[0]][0],
		Summary: fmt.Sprintf(summary, len(keys)), Evidence: evidence, Remedy: remedy}
}
