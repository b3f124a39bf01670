package serve

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// After every iteration the ranks agree: same step, same plan digest, same
// sequence number on each communicator.
func TestRanksAgreeEachStep(t *testing.T) {
	m := tinyModel(t)
	e := newEngine(t, m, Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 24, PrefillChunk: 6})
	ps := testmodel.Prompts(5, 6, 4, 20, m.Config.VocabSize)
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(func() {
			s, err := e.Submit(context.Background(), Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true})
			if err != nil {
				t.Error(err)
				return
			}
			collect(t, s, 20*time.Second)
		})
	}
	wg.Wait()
	checkPools(t, e) // every rank has passed the last busy step
	// Poll until both ranks published the same iteration (they may be one
	// idle iteration apart when read).
	var recs []StepRecord
	waitfor.Check(t, "ranks at the same step", 10*time.Second, func() bool {
		recs = e.View().RankSteps()
		return recs[0].Step == recs[1].Step
	})
	if recs[0].Digest != recs[1].Digest || recs[0].ControlSeq != recs[1].ControlSeq || recs[0].ForwardSeq != recs[1].ForwardSeq ||
		recs[0].ControlSeq == 0 || recs[0].ForwardSeq == 0 {
		t.Errorf("ranks disagree: %+v vs %+v", recs[0], recs[1])
	}
	// Both communicators, control first, each with its own flight
	// recorders and wait totals.
	snaps := e.View().Collectives()
	if len(snaps) != 2 || snaps[0].Name != CommControl || snaps[1].Name != CommForward {
		t.Fatalf("communicators %+v", snaps)
	}
	for _, snap := range snaps {
		if snap.Broken != "" || len(snap.Ranks) != 2 {
			t.Fatalf("%s group %+v", snap.Name, snap)
		}
		for _, r := range snap.Ranks {
			if len(r.Records) == 0 {
				t.Errorf("%s rank %d: empty flight recorder", snap.Name, r.Rank)
			}
		}
		for r := range 2 {
			if e.View().CollectiveWait(snap.Name, r) <= 0 {
				t.Errorf("%s rank %d: collective wait %v", snap.Name, r, e.View().CollectiveWait(snap.Name, r))
			}
		}
	}
	if e.View().CollectiveWait("nonesuch", 0) != 0 {
		t.Error("a communicator that does not exist has a wait")
	}
}
