package serve

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/internal/waitfor"
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
	// The finish reaches the stream inside the last step, before the loop
	// reports that step.
	waitfor.Check(t, "the last step reported", 10*time.Second, func() bool {
		obs.mu.Lock()
		defer obs.mu.Unlock()
		return len(obs.steps) >= 4
	})
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if obs.tokens != len(toks) || obs.ends != 1 || len(obs.steps) != 4 {
		t.Fatalf("observer saw %d tokens, %d finishes, %d steps; want %d, 1, 4", obs.tokens, obs.ends, len(obs.steps), len(toks))
	}
	for i, rec := range obs.steps {
		if rec.End.IsZero() || rec.End.Before(rec.Start) || rec.ControlSeq == 0 || rec.ForwardSeq == 0 || rec.BatchSize != 1 {
			t.Errorf("step %d: %+v", i, rec)
		}
	}
	if obs.steps[0].Phase != "prefill" || obs.steps[3].Phase != "decode" {
		t.Errorf("phases %q ... %q", obs.steps[0].Phase, obs.steps[3].Phase)
	}
}

// blockingObserver holds rank 0's loop inside StepFinished until released.
type blockingObserver struct {
	recordingObserver
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (o *blockingObserver) StepFinished(rec StepRecord) {
	o.once.Do(func() {
		close(o.entered)
		<-o.release
	})
}

// A rank that does not arrive at a collective is reported by the watchdog,
// which names it; the engine goes on once it arrives.
func TestWatchdogNamesMissingRank(t *testing.T) {
	m := tinyModel(t)
	obs := &blockingObserver{entered: make(chan struct{}), release: make(chan struct{})}
	stalls := make(chan string, 16)
	e := newEngine(t, m, Config{TP: 2, PageSize: 4, KVTokens: 128, Observer: obs, Heartbeat: 5 * time.Millisecond,
		CollectiveWatchdog: 50 * time.Millisecond, OnStall: func(s dist.Stall) {
			select {
			case stalls <- s.String():
			default:
			}
		}})
	s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7}, MaxTokens: 3, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-obs.entered // rank 0 is held after its first step; rank 1 waits for it
	var report string
	select {
	case report = <-stalls:
	case <-time.After(20 * time.Second):
		t.Fatal("no stall reported")
	}
	close(obs.release)
	if !strings.Contains(report, "arrived [1]") || !strings.Contains(report, "waiting for rank 0") {
		t.Errorf("stall report %q does not name rank 0", report)
	}
	if _, fin := collect(t, s, 20*time.Second); fin.Reason != ReasonLength {
		t.Errorf("after the stall: %+v", fin)
	}
	if e.View().StallsReported() == 0 {
		t.Error("stall not counted")
	}
	t.Logf("report: %s", report)
}

// queueObserver records each request's queue wait.
type queueObserver struct {
	recordingObserver
	waits map[uint64][]time.Duration
}

func (o *queueObserver) QueueWaited(id uint64, waited time.Duration) {
	o.mu.Lock()
	o.waits[id] = append(o.waits[id], waited)
	o.mu.Unlock()
}

// A QueueObserver hears each request's queue wait exactly once: with one
// request admitted at a time, the second request waits its turn behind
// the whole of the first, so its wait is longer than the first's.
func TestQueueObserverReportsEachWaitOnce(t *testing.T) {
	m := tinyModel(t)
	obs := &queueObserver{waits: map[uint64][]time.Duration{}}
	e := newEngine(t, m, Config{PageSize: 4, KVTokens: 256, MaxRunning: 1, Observer: obs})
	var streams []*Stream
	for range 2 {
		s, err := e.Submit(context.Background(), Request{Prompt: []int32{5, 6, 7, 8, 9}, MaxTokens: 16, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	for _, s := range streams {
		collect(t, s, 20*time.Second)
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	first, second := obs.waits[streams[0].ID], obs.waits[streams[1].ID]
	if len(first) != 1 || len(second) != 1 {
		t.Fatalf("waits reported %d and %d times, want once each", len(first), len(second))
	}
	if second[0] <= first[0] {
		t.Errorf("the second request waited %v, the first %v: it should have waited for the first to finish", second[0], first[0])
	}
}
