package serve

import (
	"context"
	"sync"
	"testing"
	"time"
)

type recordingObserver struct {
	mu     sync.Mutex
	steps  []StepRecord
	tokens int
	ends   int
}

func (o *recordingObserver) TokenEmitted(uint64, int, time.Duration) {
	o.mu.Lock()
	o.tokens++
	o.mu.Unlock()
}

func (o *recordingObserver) RequestFinished(uint64, Finish) {
	o.mu.Lock()
	o.ends++
	o.mu.Unlock()
}

func (o *recordingObserver) StepFinished(rec StepRecord) {
	o.mu.Lock()
	o.steps = append(o.steps, rec)
	o.mu.Unlock()
}

// The observer sees every token, every finish and every forward step as
// published: complete records with their end times.
func TestObserverSeesPublishedSteps(t *testing.T) {
	m := tinyModel(t)
	obs := &recordingObserver{}
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 128, Observer: obs})
	s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7, 8, 9}, MaxTokens: 4, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	toks, _ := collect(t, s, 20*time.Second)
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if obs.tokens != len(toks) || obs.ends != 1 || len(obs.steps) != 4 {
		t.Fatalf("observer saw %d tokens, %d finishes, %d steps; want %d, 1, 4", obs.tokens, obs.ends, len(obs.steps), len(toks))
	}
	for i, rec := range obs.steps {
		if rec.End.IsZero() || rec.End.Before(rec.Start) || rec.CollectiveSeq == 0 || rec.BatchSize != 1 {
			t.Errorf("step %d: %+v", i, rec)
		}
	}
	if obs.steps[0].Phase != "prefill" || obs.steps[3].Phase != "decode" {
		t.Errorf("phases %q ... %q", obs.steps[0].Phase, obs.steps[3].Phase)
	}
}
