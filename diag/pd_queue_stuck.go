package diag

import (
	"fmt"
	"slices"

	"github.com/pdkit/pdkit/api/debug"
)

// stuckQueues are the PD queues judged by pd-queue-stuck, with the severity
// of a stuck one and what to do about it. The active queue moves with the
// scheduler and the aborting queue belongs to kv-leak.
var stuckQueues = []struct {
	name, role string
	severity   Severity
	remedy     string
}{
	{"bootstrap", "prefill", Critical, "the prefill never got the decode's transfer info for these rooms: check that the prefill's control loop is alive (control-loop-dead) and that the decode's prealloc queue moves; abort the rooms (pdctl abort --rooms-from-queue) and restart the prefill server if its loop is dead."},
	{"inflight", "prefill", Warning, "the prefill waits for the decode's acknowledgement of the last chunk: check the decode server's KV loop and the peer's reachability; the inflight timeout will fail the rooms."},
	{"prealloc", "decode", Warning, "the decode cannot resolve the prefill registry or reserve pages: check that the prefill server is reachable and all its ranks registered, and the decode's free KV pages."},
	{"transfer", "decode", Critical, "the decode waits for KV that the prefill does not send (the mass-abort wedge): check the prefill peer's control loop (control-loop-dead) and the prefill's bootstrap queue, abort the stuck rooms (pdctl abort --rooms-from-queue), then restart the prefill server."},
}

func pdQueueStuck() Rule {
	return Rule{
		Name:     "pd-queue-stuck",
		Doc:      "A PD queue (prefill bootstrap or inflight, decode prealloc or transfer) is non-empty at both ends of the window and no room left it, so the requests in it are wedged and new ones will queue behind them.",
		Severity: Critical,
		Check:    checkPDQueueStuck,
	}
}

func checkPDQueueStuck(w Window) []Finding {
	if len(w.Samples) < 2 || w.Span() <= 0 {
		return nil
	}
	var out []Finding
	first := w.First()
	for _, last := range w.Last().Servers {
		if !last.Reachable || last.PD == nil {
			continue
		}
		for _, r := range last.PD.Ranks {
			for _, q := range stuckQueues {
				if q.role != last.PD.Role {
					continue
				}
				now := entries(&r, q.name)
				if len(now) == 0 {
					continue
				}
				f := first.Server(last.URL)
				if f == nil || !f.Reachable || len(entries(pdRank(f.PD, r.Rank), q.name)) == 0 {
					continue
				}
				if leftQueue(w, last.URL, r.Rank, q.name) {
					continue
				}
				rooms, oldest := summarise(now)
				out = append(out, Finding{
					Rule: "pd-queue-stuck", Severity: q.severity, Server: last.URL, Rank: AtRank(r.Rank),
					Summary: fmt.Sprintf("the %s queue of %s rank %d holds %s and none left it in %v", q.name, last.PD.Role, r.Rank, nRooms(len(now)), w.Span().Round(1e6)),
					Evidence: []Evidence{
						ev("queue", "%s", q.name),
						ev("count", "%d (first sample %d)", len(now), len(entries(pdRank(f.PD, r.Rank), q.name))),
						ev("oldest", "%s", ms(oldest)),
						ev("rooms", "%s", list(rooms, 10)),
						ev("window", "%v over %d samples", w.Span().Round(1e6), len(w.Samples)),
					},
					Remedy: q.remedy,
				})
			}
		}
	}
	return out
}

// leftQueue reports whether some room in the queue of a server's rank was
// gone from it in a later sample.
func leftQueue(w Window, url string, rank int, queue string) bool {
	var prev []debug.ID
	for i, s := range w.Samples {
		ss := s.Server(url)
		if ss == nil || !ss.Reachable {
			continue
		}
		var rooms []debug.ID
		for _, e := range entries(pdRank(ss.PD, rank), queue) {
			rooms = append(rooms, e.Room)
		}
		if i > 0 {
			for _, room := range prev {
				if !slices.Contains(rooms, room) {
					return true
				}
			}
		}
		prev = rooms
	}
	return false
}
