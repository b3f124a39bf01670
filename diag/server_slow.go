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
		var worst *debug.StepRate
		var factor float64
		var against string
		for i := range s.Steps.Rates {
			r := &s.Steps.Rates[i]
			if r.Steps < slowMinSteps || r.RecentMS < slowMinMS {
				continue
			}
			if r.BaselineMS > 0 && r.RecentMS/r.BaselineMS >= SlowFactor && r.RecentMS/r.BaselineMS > factor {
				worst, factor, against = r, r.RecentMS/r.BaselineMS, fmt.Sprintf("its own baseline of %s", ms(r.BaselineMS))
			}
			if f := fastest[s.Role][bucket{r.Phase, r.Tokens}]; f > 0 && r.RecentMS/f >= SlowFactor && r.RecentMS/f > factor {
				worst, factor, against = r, r.RecentMS/f, fmt.Sprintf("the fastest %s server's %s", s.Role, ms(f))
			}
		}
		if worst == nil {
			continue
		}
		evidence := []Evidence{
			ev("steps", "%s steps of up to %d tokens: %s recently, against %s", worst.Phase, worst.Tokens, ms(worst.RecentMS), against),
		}
		throttled := false
		if first := firstWithProcess(w, s.URL); first != nil && s.Steps.Process != nil {
			a, b := first, s.Steps.Process
			if wall := b.Taken.Sub(a.Taken).Seconds(); wall > 0 {
				evidence = append(evidence, ev("cpu", "%.2f cores used over the window's %s", (b.CPUMS-a.CPUMS)/1000/wall,
					b.Taken.Sub(a.Taken).Round(time.Millisecond)))
			}
			if b.Throttled > a.Throttled {
				throttled = true
				evidence = append(evidence, ev("cgroup", "%s: throttled in %d of %d quota periods over the window, %.1fs held back",
					b.Cgroup, b.Throttled-a.Throttled, b.Periods-a.Periods, (b.ThrottledMS-a.ThrottledMS)/1000))
			}
		}
		remedy := "find what takes the CPU from the server (other processes on its cores: top, or its host's metrics) and move one of them; " +
			"capture a bundle first (pdctl bundle -o FILE.tar.gz) to keep the evidence."
		if throttled {
			remedy = "the server's cgroup CPU quota holds it back: raise its CPU limit (the container's or the pod's), or give it fewer --threads than its quota."
		}
		out = append(out, Finding{Rule: "server-slow", Severity: Warning, Server: s.URL,
			Summary:  fmt.Sprintf("the %s server's %s steps are %.1f times slower than %s, at the same batch size", s.Role, worst.Phase, factor, against),
			Evidence: evidence, Remedy: remedy})
	}
	return out
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
