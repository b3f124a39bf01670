package diag

import (
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

func pdEntryOverdue(c Config) Rule {
	return Rule{
		Name:     "pd-entry-overdue",
		Doc:      "PD entries are past their deadline (plus a grace): the one each rank publishes, a fixed timeout or a lease the peer renews; from servers that publish none, their state's timeout. The rank that should have failed them is not judging its deadlines, and their pages and peers stay held.",
		Severity: Warning,
		Basis:    LastSample,
		Check:    func(w Window) []Finding { return checkPDEntryOverdue(c, w) },
	}
}

// overdueQueues maps a PD queue to its timeout; the aborting queue is
// judged by kv-leak, the active one by the scheduler.
func overdueQueues(t Timeouts) []struct {
	name    string
	timeout time.Duration
	setting string
} {
	return []struct {
		name    string
		timeout time.Duration
		setting string
	}{
		{"bootstrap", t.Bootstrap, "bootstrap"},
		{"inflight", t.Inflight, "inflight"},
		{"prealloc", t.Bootstrap, "bootstrap"},
		{"transfer", t.Transfer, "transfer"},
	}
}

func checkPDEntryOverdue(c Config, w Window) []Finding {
	var out []Finding
	for _, s := range w.Last().Servers {
		if !s.Reachable || s.PD == nil {
			continue
		}
		l := c.LimitsOf(&s)
		for _, r := range s.PD.Ranks {
			for _, q := range overdueQueues(l.Timeouts) {
				if q.timeout <= 0 {
					continue // unknown: the server published no settings
				}
				limit := q.timeout + l.Grace
				var late []debug.ID
				var oldest float64
				es := entries(&r, q.name)
				for _, e := range es {
					overdue := time.Duration(e.InQueueMS*float64(time.Millisecond)) > limit
					if e.DeadlineInMS != nil || e.Leased {
						// The rank publishes the entry's own deadline: a
						// lease (a queued room) may rightly outlive the
						// state's timeout.
						overdue = e.DeadlineInMS != nil && time.Duration(-*e.DeadlineInMS*float64(time.Millisecond)) > l.Grace
					}
					if overdue {
						late = append(late, e.Room)
						oldest = max(oldest, e.InQueueMS)
					}
				}
				if len(late) == 0 {
					continue
				}
				out = append(out, Finding{
					Rule: "pd-entry-overdue", Severity: Warning, Server: s.URL, Rank: AtRank(r.Rank),
					Summary: fmt.Sprintf("%d of %d rooms in the %s queue of %s rank %d are past their deadline (the %s timeout %v, or their lease)", len(late), len(es), q.name, s.PD.Role, r.Rank, q.setting, q.timeout),
					Evidence: []Evidence{
						ev("queue", "%s", q.name),
						ev("overdue", "%d of %d", len(late), len(es)),
						ev("oldest", "%s", ms(oldest)),
						ev("timeout", "%v (+%v grace)", q.timeout, l.Grace),
						ev("rooms", "%s", list(late, 10)),
					},
					Remedy: fmt.Sprintf("the rank is not failing timed-out rooms: check that its loop iterates (rank-divergence, pdctl status) and its control loop is alive; abort the rooms (pdctl abort --prefill/--rooms-from-queue) or restart %s.", s.URL),
				})
			}
		}
	}
	return out
}
