package serve

import (
	"context"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// sameDecision compares two ranks' records of one step: equal but for the
// rank and the end time.
func sameDecision(a, b DecisionRecord) bool {
	a.Rank, a.End = b.Rank, b.End
	return reflect.DeepEqual(a, b)
}

// TestDecisionsAgreeTP2: under a small load at TP 2 (prefills, decodes, a
// request of two samples that forks), both ranks log the same decisions
// step by step; each record lists every control collective of its
// iteration at consecutive seqs, and the records chain: each starts at the
// seqs the previous one ended at.
func TestDecisionsAgreeTP2(t *testing.T) {
	e := newEngine(t, tinyModel(t), Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4, Heartbeat: 500 * time.Millisecond})
	prompts := testmodel.Prompts(21, 4, 6, 12, e.vocab)
	var streams []*Stream
	for i, p := range prompts {
		q := Request{Prompt: p, MaxTokens: 5, IgnoreEOS: true}
		if i == 3 {
			q.N = 2
			ss, err := e.SubmitN(context.Background(), q)
			if err != nil {
				t.Fatal(err)
			}
			streams = append(streams, ss...)
			continue
		}
		s, err := e.Submit(context.Background(), q)
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	for _, s := range streams {
		if toks, fin := collect(t, s, 20*time.Second); len(toks) != 5 || fin.Reason != ReasonLength {
			t.Fatalf("request %d: %d tokens, %q", s.ID, len(toks), fin.Reason)
		}
	}
	var logs []RankDecisions
	waitfor.Check(t, "both ranks past the load's last step", 10*time.Second, func() bool {
		logs = e.View().Decisions(0)
		return logs[0].LastStep == logs[1].LastStep && logs[0].LastStep > 0
	})
	names := map[string]bool{}
	byStep := map[uint64]DecisionRecord{}
	for _, r := range logs[0].Records {
		byStep[r.Step] = r
	}
	compared := 0
	for _, rd := range logs {
		if len(rd.Records) == 0 || rd.Records[len(rd.Records)-1].Step != rd.LastStep || rd.Records[0].Step != 1 {
			t.Fatalf("rank %d: records from step %d, last step %d", rd.Rank, rd.Records[0].Step, rd.LastStep)
		}
		for i, r := range rd.Records {
			if r.Rank != rd.Rank || r.Step != uint64(i+1) || r.End.IsZero() || len(r.Agreed) == 0 || r.Agreed[0].Name != AgreeInput {
				t.Fatalf("rank %d record %d: %+v", rd.Rank, i, r)
			}
			for j, a := range r.Agreed {
				names[a.Name] = true
				if a.Seq != r.Agreed[0].Seq+uint64(j) {
					t.Errorf("rank %d step %d: %s at control seq %d, not consecutive: %+v", rd.Rank, r.Step, a.Name, a.Seq, r.Agreed)
				}
			}
			if last := r.Agreed[len(r.Agreed)-1]; last.Seq != r.ControlSeq {
				t.Errorf("rank %d step %d: ended at control seq %d, its last agreement is at %d", rd.Rank, r.Step, r.ControlSeq, last.Seq)
			}
			if i > 0 {
				prev := rd.Records[i-1]
				if r.Agreed[0].Seq != prev.ControlSeq+1 || r.ForwardFirst != prev.ForwardSeq+1 {
					t.Errorf("rank %d step %d does not start where step %d ended: %+v after %+v", rd.Rank, r.Step, prev.Step, r, prev)
				}
			}
			if (r.BatchSize > 0) != (r.ForwardSeq >= r.ForwardFirst) || (r.BatchSize > 0) != (r.Plan != 0) {
				t.Errorf("rank %d step %d: batch %d, forward seqs %d..%d, plan %x", rd.Rank, r.Step, r.BatchSize, r.ForwardFirst, r.ForwardSeq, r.Plan)
			}
			if rd.Rank == 0 {
				continue
			}
			if r0, ok := byStep[r.Step]; !ok || !sameDecision(r0, r) {
				t.Errorf("step %d: the ranks' decisions differ:\n%+v\n%+v", r.Step, r0, r)
			}
			compared++
		}
	}
	if compared != int(logs[1].LastStep) {
		t.Errorf("compared %d steps of %d", compared, logs[1].LastStep)
	}
	for _, n := range []string{AgreeInput, AgreeAdmit, AgreeRoom, AgreePlan, AgreeResults, AgreeFork} {
		if !names[n] {
			t.Errorf("no %s agreement in the log", n)
		}
	}
	// The room the ranks agreed is the values, equal on both ranks.
	for _, r := range logs[0].Records {
		for _, a := range r.Agreed {
			if a.Name == AgreeRoom && (len(a.Values) != 2 || a.Values[0] <= 0 || a.Values[1] <= 0) {
				t.Errorf("step %d: room %+v", r.Step, a)
			}
		}
	}
}

// TestDecisionLogBounded: the ring keeps the last n records, oldest first;
// since skips the older ones.
func TestDecisionLogBounded(t *testing.T) {
	l := &rankLoop{ag: &agreer{log: newDecisionLog(3)}}
	for step := range uint64(10) {
		l.ag.log.close(StepRecord{Step: step + 1, ControlSeq: 2 * (step + 1)})
	}
	steps := func(since uint64) []uint64 {
		recs, open, last, lastC := l.ag.log.read(since)
		if open != nil || last != 10 || lastC != 20 {
			t.Errorf("open %v, last %d at seq %d", open, last, lastC)
		}
		var out []uint64
		for _, r := range recs {
			out = append(out, r.step)
		}
		return out
	}
	if got := steps(0); !slices.Equal(got, []uint64{8, 9, 10}) {
		t.Errorf("records %v, want 8 9 10", got)
	}
	if got := steps(8); !slices.Equal(got, []uint64{9, 10}) {
		t.Errorf("since 8: %v, want 9 10", got)
	}
	if got := steps(10); len(got) != 0 {
		t.Errorf("since 10: %v", got)
	}
}

// TestDecisionsStalledRank: with stall-last-rank on, a reader of the
// decision logs answers at once; rank 0 is in the next step, waiting in its
// input broadcast, while rank 1 is a step behind and in no collective.
// Switched off, the request completes and the ranks agree again.
func TestDecisionsStalledRank(t *testing.T) {
	e := newEngine(t, tinyModel(t), Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 2, DecisionLogLen: 8,
		Heartbeat: 10 * time.Millisecond, CollectiveWatchdog: -1})
	if err := e.SetFault(FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	s, err := e.Submit(context.Background(), Request{Prompt: testmodel.Prompts(3, 1, 8, 8, e.vocab)[0], MaxTokens: 4, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	read := func() []RankDecisions {
		got := make(chan []RankDecisions, 1)
		go func() { got <- e.View().Decisions(0) }()
		select {
		case d := <-got:
			return d
		case <-time.After(2 * time.Second):
			t.Fatal("Decisions did not answer within 2s with a rank stalled")
			return nil
		}
	}
	var d []RankDecisions
	waitfor.Check(t, "rank 0 waiting in the next step's input", 10*time.Second, func() bool {
		d = read()
		// Held there for 100ms: rank 1 is not merely late.
		w := d[0].Waiting
		return w != nil && w.Comm == CommControl && w.Op == dist.OpBroadcast && time.Since(w.Since) > 100*time.Millisecond
	})
	r0, r1 := d[0], d[1]
	if r0.Open == nil {
		t.Fatalf("rank 0 waits in %+v with no open step", r0.Waiting)
	}
	if r0.Open.Step != r1.LastStep+1 || r0.LastStep != r1.LastStep || len(r0.Open.Agreed) != 0 {
		t.Errorf("rank 0 in step %d (last finished %d), rank 1 last finished %d", r0.Open.Step, r0.LastStep, r1.LastStep)
	}
	if r1.Open != nil || r1.Waiting != nil {
		t.Errorf("rank 1, stalled outside the collectives: open %+v, waiting %+v", r1.Open, r1.Waiting)
	}
	if len(r0.Records) > 8 || len(r1.Records) > 8 {
		t.Errorf("%d and %d records, the log keeps 8", len(r0.Records), len(r1.Records))
	}
	if err := e.SetFault(FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	if toks, fin := collect(t, s, 10*time.Second); len(toks) != 4 || fin.Reason != ReasonLength {
		t.Fatalf("after the stall: %d tokens, %q", len(toks), fin.Reason)
	}
	waitfor.Check(t, "the ranks agreeing after the stall", 10*time.Second, func() bool {
		d = read()
		return d[0].LastStep == d[1].LastStep && d[0].LastStep > r0.Open.Step
	})
	for i, r := range d[1].Records {
		j := slices.IndexFunc(d[0].Records, func(x DecisionRecord) bool { return x.Step == r.Step })
		if j < 0 {
			t.Errorf("step %d: rank 0 has no record", r.Step)
		} else if !sameDecision(d[0].Records[j], r) {
			t.Errorf("record %d, step %d: the ranks differ:\n%+v\n%+v", i, r.Step, d[0].Records[j], r)
		}
	}
}
