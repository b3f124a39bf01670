package serve

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/internal/testmodel"
)

// controlLog is every rank's control communicator log from a snapshot of
// the group, as rankcore.CheckLog reads it.
func controlLog(s dist.Snapshot) [][]rankcore.Entry {
	logs := make([][]rankcore.Entry, len(s.Ranks))
	for r, rs := range s.Ranks {
		for _, rec := range rs.Records {
			logs[r] = append(logs[r], rankcore.Entry{Seq: rec.Seq, Op: rec.Op, Tag: rec.Tag})
		}
	}
	return logs
}

// TestCollectivesFollowTheTable: at TP 2, under a load with prefix hits,
// a request of two samples that forks and more requests than run at once,
// every control collective of both loops is tagged with its phase and the
// ranks' recorded logs walk the loop's table (rankcore.CheckLog), seq by
// seq alike on both ranks.
func TestCollectivesFollowTheTable(t *testing.T) {
	for _, schedule := range []string{ScheduleLockstep, ScheduleOverlap} {
		t.Run(schedule, func(t *testing.T) {
			e := newEngine(t, tinyModel(t), Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 3,
				Heartbeat: 500 * time.Millisecond, Schedule: schedule, FlightRecorderLen: 4096})
			prompts := testmodel.Prompts(31, 5, 6, 14, e.vocab)
			prompts = append(prompts, prompts[0]) // a prefix hit
			var streams []*Stream
			for i, p := range prompts {
				q := Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true}
				if i == 2 {
					q.N = 2
				}
				ss, err := e.SubmitN(context.Background(), q)
				if err != nil {
					t.Fatal(err)
				}
				streams = append(streams, ss...)
			}
			for _, s := range streams {
				if toks, fin := collect(t, s, 30*time.Second); len(toks) != 6 || fin.Reason != ReasonLength {
					t.Fatalf("request %d: %d tokens, %q", s.ID, len(toks), fin.Reason)
				}
			}
			snap := e.View().Collectives()[0]
			logs := controlLog(snap)
			seen := map[string]bool{}
			for _, log := range logs {
				for _, en := range log {
					seen[en.Tag] = true
				}
			}
			for _, want := range []string{AgreeInput, AgreeAdmit, AgreeRoom, AgreePlan, AgreeResults, AgreeFork} {
				if !seen[want] {
					t.Errorf("no %s collective in the logs (saw %v)", want, seen)
				}
			}
			if err := rankcore.CheckLog(e.cfg.table(), logs); err != nil {
				t.Fatalf("the control log against the %s table: %v", schedule, err)
			}
		})
	}
}

// TestAgreeNamesArePhases: the decision log's names are the phases'.
func TestAgreeNamesArePhases(t *testing.T) {
	for name, p := range map[string]rankcore.Phase{AgreeInput: rankcore.Input, AgreePoll: rankcore.Poll, AgreeAdmit: rankcore.Admit,
		AgreeRoom: rankcore.Room, AgreePDFork: rankcore.PDFork, AgreePlan: rankcore.Agree, AgreeResults: rankcore.Results, AgreeFork: rankcore.Fork} {
		if p.String() != name {
			t.Errorf("%s is phase %s", name, p)
		}
	}
}

// checkPartedAtIdle holds a failed group's control log to the overlap
// table: it must name where the fault's idle rank parted from its peer.
func checkPartedAtIdle(t *testing.T, side string, s dist.Snapshot) {
	t.Helper()
	err := rankcore.CheckLog(&rankcore.Overlap, controlLog(s))
	if err == nil || !strings.Contains(err.Error(), "the ranks parted") || !strings.Contains(err.Error(), "rank 1 in input (Broadcast)") {
		t.Fatalf("%s: the failed group's log against the overlap table: %v; want the ranks parted with rank 1 in the step input", side, err)
	}
	t.Logf("%s: %v", side, err)
}
