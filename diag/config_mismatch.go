package diag

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

func configMismatch() Rule {
	return Rule{
		Name: "config-mismatch",
		Doc: "A prefill and a decode server disagree on what their PD handshake compares (the TP size, the page size, " +
			"the KV or index-K element type, the model and its KV shape, the PD protocol version), so every request " +
			"the router pairs them for fails at the handshake, with or without traffic in the window; during a live " +
			"index-K switch the operator started, a precision that differs is only the switch under way.",
		Severity: Critical,
		Basis:    LastSample,
		Check:    checkConfigMismatch,
	}
}

// handshakeFlags names, for each field a PD handshake compares
// (pdproto.Differences), the pdserve flag that sets it.
var handshakeFlags = map[string]string{
	"tp_size":       "--tp",
	"page_size":     "--page-size",
	"kv_dtype":      "--kv-dtype",
	"index_k_dtype": "--index-k",
	"model":         "--model",
	"layers":        "--model",
	"kv_heads":      "--model",
	"head_dim":      "--model",
}

// checkConfigMismatch compares every prefill server with every decode
// server by the settings each published in the last sample where it was
// reachable, with pdproto.Differences, the handshake's own comparison, so
// that the two cannot drift apart.
func checkConfigMismatch(w Window) []Finding {
	last := w.Last()
	type side struct {
		s  ServerSample
		at time.Time
	}
	var prefills, decodes []side
	seen := map[string]bool{}
	for i := len(w.Samples) - 1; i >= 0; i-- {
		smp := w.Samples[i]
		for _, s := range smp.Servers {
			if seen[s.URL] || !s.Reachable || s.Settings == nil || s.Settings.Handshake == nil {
				continue
			}
			seen[s.URL] = true
			switch s.Settings.Role {
			case pdproto.RolePrefill:
				prefills = append(prefills, side{s, smp.Taken})
			case pdproto.RoleDecode:
				decodes = append(decodes, side{s, smp.Taken})
			}
		}
	}
	paused := last.Router != nil && last.Router.Paused
	var out []Finding
	for _, d := range decodes {
		for _, p := range prefills {
			ps, ds := p.s.Settings, d.s.Settings
			diffs := pdproto.Differences(ps.Handshake.RankInfo(), ds.Handshake.RankInfo())
			if ps.PDProtocol != 0 && ds.PDProtocol != 0 && ps.PDProtocol != ds.PDProtocol {
				diffs = append(diffs, pdproto.Difference{Field: "pd_protocol", A: ps.PDProtocol, B: ds.PDProtocol})
			}
			if len(diffs) == 0 {
				continue
			}
			switching := switchUnderWay(diffs, ps.IndexKSwitch, ds.IndexKSwitch, paused)
			sev, summary := Critical, fmt.Sprintf("this decode server and prefill server %s disagree on %s: every request routed to the pair fails at the handshake",
				p.s.URL, fieldList(diffs))
			if switching != "" {
				sev, summary = Info, fmt.Sprintf("this decode server and prefill server %s run different index-K precisions while %s", p.s.URL, switching)
			}
			evidence := []Evidence{}
			var flags []string
			for _, df := range diffs {
				evidence = append(evidence, ev(df.Field, "prefill %s, decode %s", showValue(df.A), showValue(df.B)))
				if f := handshakeFlags[df.Field]; f != "" && !slices.Contains(flags, f) {
					flags = append(flags, f)
				}
			}
			evidence = append(evidence,
				ev("as of", "the prefill's settings %s before the last sample, the decode's %s", age(last.Taken, p.at), age(last.Taken, d.at)))
			out = append(out, Finding{Rule: "config-mismatch", Severity: sev, Server: d.s.URL,
				Summary: summary, Evidence: evidence, Remedy: configRemedy(diffs, flags, switching != "")})
		}
	}
	return out
}

// switchUnderWay says which live index-K switch explains diffs, when the
// precision is all they differ in and a switch is under way on either
// server (or the router is paused, as pdctl indexk set pauses it between
// the prefill's switch and the decode's); "" when none does.
func switchUnderWay(diffs []pdproto.Difference, prefillTo, decodeTo string, routerPaused bool) string {
	if len(diffs) != 1 || diffs[0].Field != "index_k_dtype" {
		return ""
	}
	switch {
	case prefillTo != "":
		return "the prefill server switches to " + prefillTo
	case decodeTo != "":
		return "the decode server switches to " + decodeTo
	case routerPaused:
		return "the router is paused (pdctl indexk set switches the prefill servers, then the decode servers)"
	}
	return ""
}

func configRemedy(diffs []pdproto.Difference, flags []string, switching bool) string {
	if switching {
		return "none while the switch runs: it ends with both in one precision (pdctl indexk status shows each server's); " +
			"should it stop half-way, run pdctl indexk set with the precision wanted."
	}
	var b strings.Builder
	if len(flags) > 0 {
		fmt.Fprintf(&b, "restart one side with the other's %s, so that both agree", strings.Join(flags, ", "))
	}
	for _, df := range diffs {
		switch df.Field {
		case "index_k_dtype":
			b.WriteString("; or switch the cluster live: pdctl indexk set fp8|bf16")
		case "model", "layers", "kv_heads", "head_dim":
			b.WriteString("; serve the same model file on every prefill and decode server")
		case "pd_protocol":
			if b.Len() > 0 {
				b.WriteString("; ")
			}
			b.WriteString("run the same pdkit version on both (pdserve --version)")
		}
	}
	return strings.TrimPrefix(b.String(), "; ") + "."
}

func fieldList(diffs []pdproto.Difference) string {
	names := make([]string, len(diffs))
	for i, d := range diffs {
		names[i] = d.Field
	}
	return strings.Join(names, ", ")
}

// showValue formats a compared value; a string is quoted, so an empty one
// shows.
func showValue(v any) string {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprint(v)
}

// age says how long before t the evidence at at was taken.
func age(t, at time.Time) string {
	return t.Sub(at).Round(time.Millisecond).String()
}
