package debug

import (
	"strings"
	"testing"
	"time"
)

// decisionLogs builds two ranks' logs of steps 1..n, equal, each step
// agreeing on its input, the room and the results at consecutive control
// seqs.
func decisionLogs(n int) []RankDecisions {
	end := time.Unix(1, 0)
	logs := make([]RankDecisions, 2)
	for r := range logs {
		logs[r] = RankDecisions{Rank: r, LastStep: uint64(n)}
		for s := 1; s <= n; s++ {
			seq := uint64(3*s - 2)
			e := end.Add(time.Duration(r) * time.Millisecond)
			logs[r].Records = append(logs[r].Records, DecisionRecord{
				Step: uint64(s), Input: DecisionInput{NowMS: float64(s), Adds: 1, IDs: "00000000000000aa", Digest: "00000000000000bb"},
				Agreed: []Agreement{
					{Name: "input", Op: "Broadcast", Seq: seq, Len: 40, Digest: "0000000000000001"},
					{Name: "room", Op: "AllReduceMin", Seq: seq + 1, Len: 2, Digest: "0000000000000002", Values: []int64{60, 8}},
					{Name: "results", Op: "Broadcast", Seq: seq + 2, Len: 20, Digest: "0000000000000003"},
				},
				Plan: "00000000000000cc", Phase: "decode", BatchSize: 1, BatchTokens: 1, ControlSeq: seq + 2,
				ForwardFirst: uint64(s), ForwardSeq: uint64(s), End: &e,
			})
		}
	}
	return logs
}

// TestFirstDivergence: equal logs (end times apart) do not diverge; a
// differing agreed value, input, plan or collective is found at its step
// and named; an open record diverges only when it contradicts the peer's
// finished record (another value so far, or a wait in a collective the
// peer's step did not run), and a rank behind does not diverge.
func TestFirstDivergence(t *testing.T) {
	if d := FirstDivergence(decisionLogs(5)); d != nil {
		t.Fatalf("equal logs: %+v", d)
	}
	for _, tc := range []struct {
		name   string
		change func([]RankDecisions)
		step   uint64
		what   string
		detail string
	}{
		{"room", func(l []RankDecisions) { l[1].Records[2].Agreed[1].Values = []int64{59, 8} }, 3, "room", "[59 8]"},
		{"input", func(l []RankDecisions) { l[0].Records[1].Input.Adds = 2 }, 2, "input", "2 adds"},
		{"plan", func(l []RankDecisions) { l[1].Records[3].Plan = "00000000000000dd" }, 4, "plan", "00000000000000dd"},
		{"later step too", func(l []RankDecisions) {
			l[1].Records[3].Plan = "00000000000000dd"
			l[1].Records[4].BatchSize = 2
		}, 4, "plan", ""},
		{"extra collective", func(l []RankDecisions) {
			r := &l[1].Records[2]
			r.Agreed = append(r.Agreed[:2:2], Agreement{Name: "agree", Op: "AllReduceMax", Seq: r.Agreed[2].Seq, Len: 2, Digest: "0000000000000009"})
		}, 3, "collectives", "AllReduceMax (agree)"},
		{"one fewer", func(l []RankDecisions) { l[0].Records[4].Agreed = l[0].Records[4].Agreed[:2] }, 5, "collectives", "ended the step without it"},
		{"open waits elsewhere", func(l []RankDecisions) {
			// Rank 1 is in step 5 after its room, waiting in a MAX at the
			// seq where rank 0 ran its results broadcast.
			o := l[1].Records[4]
			o.Agreed, o.End = o.Agreed[:2], nil
			l[1].Records, l[1].Open, l[1].LastStep = l[1].Records[:4], &o, 4
			l[1].Waiting = &DecisionWait{Comm: CommControl, Seq: o.Agreed[1].Seq + 1, Op: "AllReduceMax"}
		}, 5, "collectives", "rank 1 waits in AllReduceMax"},
		{"open waits past the peer's step", func(l []RankDecisions) {
			o := l[1].Records[4]
			o.End = nil
			l[1].Records, l[1].Open, l[1].LastStep = l[1].Records[:4], &o, 4
			l[1].Waiting = &DecisionWait{Comm: CommControl, Seq: o.ControlSeq + 1, Op: "AllReduceMin"}
		}, 5, "collectives", "ended the step at control seq"},
	} {
		logs := decisionLogs(5)
		tc.change(logs)
		d := FirstDivergence(logs)
		if d == nil || d.Step != tc.step || d.What != tc.what || !strings.Contains(d.Detail, tc.detail) || len(d.Records) != 2 || len(d.Ranks) != 2 {
			t.Errorf("%s: %+v, want step %d, %s, detail with %q", tc.name, d, tc.step, tc.what, tc.detail)
		}
	}

	for _, tc := range []struct {
		name   string
		change func([]RankDecisions)
	}{
		{"behind", func(l []RankDecisions) { l[1].Records, l[1].LastStep = l[1].Records[:3], 3 }},
		{"open on the way", func(l []RankDecisions) {
			// Rank 1 in step 5 after its room, waiting in the results
			// broadcast rank 0 ran.
			o := l[1].Records[4]
			o.Agreed, o.End = o.Agreed[:2], nil
			l[1].Records, l[1].Open, l[1].LastStep = l[1].Records[:4], &o, 4
			l[1].Waiting = &DecisionWait{Comm: CommControl, Seq: o.Agreed[1].Seq + 1, Op: "Broadcast"}
		}},
		{"open in the next input, stalled peer", func(l []RankDecisions) {
			l[0].Open = &DecisionRecord{Step: 6, Agreed: []Agreement{}}
			l[0].Waiting = &DecisionWait{Comm: CommControl, Seq: l[0].Records[4].ControlSeq + 1, Op: "Broadcast"}
		}},
		{"a stale wait", func(l []RankDecisions) {
			o := l[1].Records[4]
			o.Agreed, o.End = o.Agreed[:2], nil
			l[1].Records, l[1].Open, l[1].LastStep = l[1].Records[:4], &o, 4
			l[1].Waiting = &DecisionWait{Comm: CommControl, Seq: 1, Op: "AllReduceMax"}
		}},
		{"evicted", func(l []RankDecisions) { l[0].Records = l[0].Records[2:] }},
	} {
		logs := decisionLogs(5)
		tc.change(logs)
		if d := FirstDivergence(logs); d != nil {
			t.Errorf("%s: %+v", tc.name, d)
		}
	}
}
