package server

import (
	"context"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestDebugDecisionsTP2: after a completion at TP 2, GET
// /debug/v1/decisions has both ranks' logs, newest record last, the same
// step by step (no divergence), each record's agreements named and at
// consecutive control seqs; ?since keeps later steps only, through the
// client too; a since that is not a step is a 400.
func TestDebugDecisionsTP2(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 8, DecisionLogLen: 64}, Options{})
	e.complete(t, map[string]any{"prompt": prompt, "max_tokens": 5, "ignore_eos": true})
	waitIdle(t, e.eng)
	var resp debug.DecisionsResponse
	waitfor.For(t, "both ranks at the same step", 20*time.Second, func() bool {
		getJSON(t, e, debug.DecisionsPath, &resp)
		return len(resp.Ranks) == 2 && resp.Ranks[0].LastStep == resp.Ranks[1].LastStep
	})
	if resp.LogLen != 64 || resp.Since != 0 || resp.Divergence != nil {
		t.Fatalf("log_len %d, since %d, divergence %+v", resp.LogLen, resp.Since, resp.Divergence)
	}
	ran := false
	for i, rd := range resp.Ranks {
		if rd.Rank != i || len(rd.Records) == 0 || len(rd.Records) > 64 || rd.Records[len(rd.Records)-1].Step > rd.LastStep {
			t.Fatalf("rank %d: %d records, last step %d", i, len(rd.Records), rd.LastStep)
		}
		for j, r := range rd.Records {
			if j > 0 && r.Step != rd.Records[j-1].Step+1 {
				t.Errorf("rank %d: step %d after %d", i, r.Step, rd.Records[j-1].Step)
			}
			if r.End == nil || r.Open || len(r.Agreed) == 0 || r.Agreed[0].Name != "input" || len(r.Input.Digest) != 16 {
				t.Errorf("rank %d step %d: %+v", i, r.Step, r)
			}
			for k, a := range r.Agreed {
				if a.Seq != r.Agreed[0].Seq+uint64(k) || len(a.Digest) != 16 || a.Op == "" {
					t.Errorf("rank %d step %d agreement %d: %+v", i, r.Step, k, a)
				}
			}
			ran = ran || (r.BatchSize > 0 && len(r.Plan) == 16 && r.ForwardSeq >= r.ForwardFirst)
		}
	}
	if !ran {
		t.Error("no record of a forward step")
	}

	since := resp.Ranks[0].LastStep - 2
	got, err := client.New(e.ts.URL, "", nil).Decisions(context.Background(), since)
	if err != nil {
		t.Fatal(err)
	}
	if got.Since != since || len(got.Ranks) != 2 {
		t.Fatalf("since %d: %+v", since, got)
	}
	for _, rd := range got.Ranks {
		if len(rd.Records) == 0 {
			t.Errorf("rank %d: no record after step %d (last %d)", rd.Rank, since, rd.LastStep)
		}
		for _, r := range rd.Records {
			if r.Step <= since {
				t.Errorf("rank %d: step %d with since %d", rd.Rank, r.Step, since)
			}
		}
	}
	if code, b := get(t, e, debug.DecisionsPath+"?since=x"); code != 400 {
		t.Errorf("since=x: %d %s", code, b)
	}
}

// TestDebugDecisionsStalled: with rank 1 held by stall-last-rank from the
// start, GET /debug/v1/decisions answers: rank 0 is in step 1, waiting in
// its input broadcast on the control communicator, rank 1 a step behind and
// in no collective, and nothing the ranks agreed differs.
func TestDebugDecisionsStalled(t *testing.T) {
	e := newEnvWith(t, serve.Config{TP: 2, PageSize: 4, MaxRunning: 8, Faults: []string{serve.FaultStallLastRank}}, Options{})
	var resp debug.DecisionsResponse
	waitfor.For(t, "rank 0 waiting in its first input", 20*time.Second, func() bool {
		getJSON(t, e, debug.DecisionsPath, &resp)
		w := resp.Ranks[0].Waiting
		return w != nil && w.Comm == debug.CommControl && w.Op == "Broadcast" && resp.Ranks[0].Open != nil
	})
	r0, r1 := resp.Ranks[0], resp.Ranks[1]
	if !r0.Open.Open || r0.Open.Step != 1 || r0.LastStep != 0 || r1.LastStep != 0 || r1.Open != nil || r1.Waiting != nil || resp.Divergence != nil {
		t.Errorf("rank 0 %+v, open %+v; rank 1 %+v; divergence %+v", r0, r0.Open, r1, resp.Divergence)
	}
}
