package dist

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// TestAMissingRankIsNamedAndTheOthersTimeOut: rank 2 took another branch and
// never enters seq 2. The others wait until their ctx deadline; meanwhile
// Stuck names rank 2 and where it is.
func TestAMissingRankIsNamedAndTheOthersTimeOut(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGroup(t, 3, Options{})
		errs := make([]error, 3)
		var wg sync.WaitGroup
		for r := range 3 { // everyone passes seq 1
			wg.Add(1)
			go func() { defer wg.Done(); errs[r] = g.Rank(r).Barrier(context.Background()) }()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}

		start := time.Now()
		for r := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				errs[r] = g.Rank(r).AllReduceSum(ctx, make([]float32, 288))
			}()
		}
		synctest.Wait()
		if s := g.Stuck(time.Now(), time.Second); len(s) != 0 {
			t.Errorf("Stuck before the threshold: %v", s)
		}
		// In the synctest bubble a sleep is how time passes: it moves the
		// fake clock 3s on at once, to the stall's age under test.
		time.Sleep(3 * time.Second)
		synctest.Wait()
		stalls := g.Stuck(time.Now(), time.Second)
		if len(stalls) != 1 {
			t.Fatalf("Stuck = %v, want one stall", stalls)
		}
		s := stalls[0]
		wantMissing := []Peer{{Rank: 2, Seq: 1, Op: OpBarrier}}
		if s.Seq != 2 || s.Op != OpAllReduceSum || !slices.Equal(s.Arrived, []int{0, 1}) ||
			!slices.Equal(s.Missing, wantMissing) || !s.Since.Equal(start) || s.Waited != 3*time.Second {
			t.Errorf("stall = %+v, want seq 2 AllReduceSum, arrived [0 1], missing %v, waited 3s", s, wantMissing)
		}
		if want := "rank 2 not in a collective (last entered seq 1 Barrier)"; !strings.Contains(s.String(), want) {
			t.Errorf("stall reads %q, want it to say %q", s, want)
		}

		// The fake clock, moved past the ranks' 10s deadline (a sleep is
		// how time passes in the bubble).
		time.Sleep(10 * time.Second)
		wg.Wait()
		deadline := 0
		for r, err := range errs[:2] {
			switch {
			case errors.Is(err, context.DeadlineExceeded):
				deadline++
			case errors.Is(err, ErrGroupBroken):
				// The peer whose deadline fired first broke the group.
			default:
				t.Errorf("rank %d: %v, want the deadline or ErrGroupBroken", r, err)
			}
		}
		if deadline == 0 {
			t.Errorf("no rank saw its deadline: %v", errs[:2])
		}
		if err := g.Rank(2).AllReduceSum(t.Context(), make([]float32, 288)); !errors.Is(err, ErrGroupBroken) {
			t.Errorf("rank 2 arriving late: %v, want ErrGroupBroken", err)
		}
		for r := range 2 {
			recs := g.Rank(r).Records()
			last := recs[len(recs)-1]
			if last.Seq != 2 || last.Waiting() || last.Outcome == "ok" || last.End.Sub(last.Start) != 10*time.Second {
				t.Errorf("rank %d: last record %+v, want seq 2 ended after 10s with an error", r, last)
			}
		}
		if len(g.Stuck(time.Now(), 0)) != 0 {
			t.Error("Stuck still reports after every rank returned")
		}
	})
}

// TestWatchdogReportsEachStallOnce: two stalls in a row, each reported once,
// naming who has arrived and who has not.
func TestWatchdogReportsEachStallOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var got []Stall
		g := newGroup(t, 3, Options{Watchdog: time.Second, OnStall: func(s Stall) {
			mu.Lock()
			got = append(got, s)
			mu.Unlock()
		}})
		errs := make([]error, 3)
		var wg sync.WaitGroup
		enter := func(r int) {
			wg.Add(1)
			go func() { defer wg.Done(); errs[r] = g.Rank(r).Barrier(context.Background()) }()
		}

		enter(0)
		enter(1)
		// In the synctest bubble a sleep is how time passes: the fake
		// clock moves past the watchdog's period, at once, and it fires.
		time.Sleep(10 * time.Second)
		synctest.Wait()
		mu.Lock()
		if len(got) != 1 {
			t.Fatalf("reports after the first stall: %v, want one", got)
		}
		s := got[0]
		if s.Seq != 1 || !slices.Equal(s.Arrived, []int{0, 1}) || !slices.Equal(s.Missing, []Peer{{Rank: 2}}) ||
			s.Waited <= time.Second || s.Waited > 2*time.Second {
			t.Errorf("first stall %+v, want seq 1, arrived [0 1], rank 2 not entered yet, waited in (1s, 2s]", s)
		}
		mu.Unlock()
		enter(2)
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}

		enter(1)
		enter(2)
		// The fake clock again, past the watchdog's period.
		time.Sleep(10 * time.Second)
		synctest.Wait()
		mu.Lock()
		if len(got) != 2 {
			t.Fatalf("reports after the second stall: %v, want two", got)
		}
		s = got[1]
		if s.Seq != 2 || !slices.Equal(s.Arrived, []int{1, 2}) ||
			!slices.Equal(s.Missing, []Peer{{Rank: 0, Seq: 1, Op: OpBarrier}}) {
			t.Errorf("second stall %+v, want seq 2, arrived [1 2], rank 0 last in seq 1 Barrier", s)
		}
		mu.Unlock()

		g.Close() // wakes ranks 1 and 2 and stops the watchdog
		wg.Wait()
		for _, r := range []int{1, 2} {
			if !errors.Is(errs[r], ErrGroupClosed) {
				t.Errorf("rank %d after Close: %v, want ErrGroupClosed", r, errs[r])
			}
		}
	})
}

// TestStuckIgnoresARankStillFinishingASettledRound: a rank shown waiting at
// seq 1 while a peer is already at seq 2 has only not yet recorded the end
// of seq 1; that is not a stall.
func TestStuckIgnoresARankStillFinishingASettledRound(t *testing.T) {
	g := newGroup(t, 2, Options{})
	t0 := time.Unix(100, 0)
	r0 := &Record{Seq: 1, Op: OpBarrier, Start: t0}
	r1 := &Record{Seq: 2, Op: OpAllGather, Start: t0}
	g.comms[0].last.Store(r0)
	g.comms[0].waiting.Store(r0)
	g.comms[1].last.Store(r1)
	g.comms[1].waiting.Store(r1)
	stalls := g.Stuck(t0.Add(time.Hour), time.Second)
	want := []Peer{{Rank: 0, InCollective: true, Seq: 1, Op: OpBarrier}}
	if len(stalls) != 1 || stalls[0].Seq != 2 || !slices.Equal(stalls[0].Missing, want) {
		t.Errorf("Stuck = %v, want only seq 2, missing %v", stalls, want)
	}
	g.comms[0].waiting.Store(nil)
	g.comms[1].waiting.Store(nil)
}
