package diag

import (
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// SlowFactor is how many times slower than its baseline, or than its
// fastest peer of the same role, a server's steps must be, at the same
// phase and batch size, for server-slow to name it; slowMinSteps the steps
// a bucket needs first, slowMinMS the least step time judged (a fast step
// twice as slow is noise).
const (
	SlowFactor   = 3.0
	slowMinSteps = 50
	slowMinMS    = 10.0
)

// CycleStarved is how many times slower than their baseline a server's
// cycles (GET /debug/v1/steps rates' cycle_recent_ms: from one decoding
// step's end to the next's) must be for server-slow to name a server its
// cgroup does not throttle; a throttled one needs SlowFactor, and cycles
// of at least cycleMinMS (a decode step of a small model takes a fraction
// of a millisecond: starved to 5% of a core, its cycles take several).
const (
	CycleStarved = 10.0
	cycleMinMS   = 2.0
)

func serverSlow() Rule {
	return Rule{
		Name: "server-slow",
		Doc: "A server's forward steps take several times longer than its own recent baseline, or than its peers' of the same role, " +
			"at the same phase and batch size (so load, which grows the batch, is not slowness): its time to first token and " +
			"per output token grow with it; the evidence says what the server can see of why (CPU quota throttling, the CPU it got).",
		Severity: Warning,
		Check:    checkServerSlow,
	}
}

func checkServerSlow(w Window) []Finding {
	last := w.Last()
	type bucket struct {
		phase  string
		tokens int
	}
	// The fastest recent figure of each role at each bucket.
	fastest := map[string]map[bucket]float64{}
	for _, s := range last.Servers {
		if !s.Reachable || s.Steps == nil {
			continue
		}
		for _, r := range s.Steps.Rates {
			if r.Steps < slowMinSteps {
				continue
			}
			m := fastest[s.Role]
			if m == nil {
				m = map[bucket]float64{}
				fastest[s.Role] = m
			}
			b := bucket{r.Phase, r.Tokens}
			if f, ok := m[b]; !ok || r.RecentMS < f {
				m[b] = r.RecentMS
			}
		}
	}
	var out []Finding
	for _, s := range last.Servers {
		if !s.Reachable || s.Steps == nil {
			continue
		}
		cpuEvidence, throttled, held := processEvidence(w, s)
		var worst *debug.StepRate
		var factor float64
		var against, what string
		for i := range s.Steps.Rates {
			r := &s.Steps.Rates[i]
			// The cycles (step and what held the loop between steps)
			// against their own baseline: a quota that throttles the
			// process holds it there. Without throttling, cycles that
			// grow a little are other work on the cores (load), so only
			// CycleStarved times slower counts.
			// A quota that holds the process back most of the window
			// freezes it in long gaps between bursts at full speed, which
			// move the typical cycle little: held alone names it.
			if r.Cycles >= slowMinSteps && r.CycleBaselineMS > 0 {
				if f := r.CycleRecentMS / r.CycleBaselineMS; f > factor && (throttled && f >= SlowFactor && r.CycleRecentMS >= cycleMinMS ||
					held && f > 1 || f >= CycleStarved && r.CycleRecentMS >= slowMinMS) {
					worst, factor, what = r, f, "cycle"
					against = fmt.Sprintf("its own baseline of %s", fineMS(r.CycleBaselineMS))
				}
			}
			if r.Steps < slowMinSteps {
				continue
			}
			if r.RecentMS < slowMinMS {
				continue
			}
			if r.BaselineMS > 0 && r.RecentMS/r.BaselineMS >= SlowFactor && r.RecentMS/r.BaselineMS > factor {
				worst, factor, what, against = r, r.RecentMS/r.BaselineMS, "step", fmt.Sprintf("its own baseline of %s", ms(r.BaselineMS))
			}
			if f := fastest[s.Role][bucket{r.Phase, r.Tokens}]; f > 0 && r.RecentMS/f >= SlowFactor && r.RecentMS/f > factor {
				worst, factor, what, against = r, r.RecentMS/f, "step", fmt.Sprintf("the fastest %s server's %s", s.Role, ms(f))
			}
		}
		if worst == nil {
			continue
		}
		evidence := []Evidence{
			ev("steps", "%s steps of up to %d tokens: %s recently, against %s", worst.Phase, worst.Tokens, ms(worst.RecentMS), against),
		}
		if what == "cycle" {
			evidence = []Evidence{ev("cycles", "%s steps of up to %d tokens end %s apart recently, against %s; the steps themselves take %s",
				worst.Phase, worst.Tokens, fineMS(worst.CycleRecentMS), against, fineMS(worst.RecentMS))}
		}
		evidence = append(evidence, cpuEvidence...)
		remedy := "find what takes the CPU from the server (other processes on its cores: top, or its host's metrics) and move one of them; " +
			"capture a bundle first (pdctl bundle -o FILE.tar.gz) to keep the evidence."
		if throttled {
			remedy = "the server's cgroup CPU quota holds it back: raise its CPU limit (the container's or the pod's), or give it fewer --threads than its quota."
		}
		out = append(out, Finding{Rule: "server-slow", Severity: Warning, Server: s.URL,
			Summary:  fmt.Sprintf("the %s server's %s %ss are %.1f times slower than %s, at the same batch size", s.Role, worst.Phase, what, factor, against),
			Evidence: evidence, Remedy: remedy})
	}
	return out
}

// processEvidence is what server s's process figures over w say of its
// CPU: the cores it used, and its cgroup's throttling, which throttled
// reports; held says the quota held the process back in most of the
// window's periods for at least the window's length (held-back time is
// counted per CPU, so a process starved on every core is held for
// longer than the window).
func processEvidence(w Window, s ServerSample) (evidence []Evidence, throttled, held bool) {
	a, b := firstWithProcess(w, s.URL), s.Steps.Process
	if a == nil || b == nil {
		return nil, false, false
	}
	if wall := b.Taken.Sub(a.Taken).Seconds(); wall > 0 {
		evidence = append(evidence, ev("cpu", "%.2f cores used over the window's %s", (b.CPUMS-a.CPUMS)/1000/wall,
			b.Taken.Sub(a.Taken).Round(time.Millisecond)))
	}
	if b.Throttled > a.Throttled {
		throttled = true
		periods, heldMS := b.Periods-a.Periods, b.ThrottledMS-a.ThrottledMS
		held = 2*(b.Throttled-a.Throttled) > periods && heldMS >= float64(b.Taken.Sub(a.Taken).Milliseconds()) && heldMS > 0
		evidence = append(evidence, ev("cgroup", "%s: throttled in %d of %d quota periods over the window, %.1fs held back",
			b.Cgroup, b.Throttled-a.Throttled, periods, heldMS/1000))
	}
	return evidence, throttled, held
}

// firstWithProcess is url's first process figures in w.
func firstWithProcess(w Window, url string) *debug.ProcessCPU {
	for _, smp := range w.Samples {
		if s := smp.Server(url); s != nil && s.Reachable && s.Steps != nil && s.Steps.Process != nil {
			return s.Steps.Process
		}
	}
	return nil
}

// fineMS formats a duration given in milliseconds to three significant
// digits: a small model's decode cycle takes a fraction of one.
func fineMS(v float64) string {
	d := time.Duration(v * float64(time.Millisecond))
	switch {
	case d >= 10*time.Millisecond:
		return d.Round(time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond).String()
	}
	return d.Round(time.Microsecond).String()
}
