package dist

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// tickClock is a clock that advances 1ms on every reading; safe for
// concurrent use.
type tickClock struct{ n atomic.Int64 }

func (c *tickClock) now() time.Time {
	return time.Unix(0, 0).Add(time.Duration(c.n.Add(1)) * time.Millisecond)
}

func TestFlightRecorderKeepsTheLastNCalls(t *testing.T) {
	var clock tickClock
	g := newGroup(t, 2, Options{FlightRecorderLen: 4, Clock: clock.now})
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		for k := range 5 {
			if err := c.AllReduceSum(ctx, make([]float32, 10+k)); err != nil {
				return err
			}
		}
		if err := c.AllReduceMaxInt(ctx, make([]int64, 3)); err != nil {
			return err
		}
		if _, err := c.BroadcastBytes(ctx, 1, []byte("hello")); err != nil {
			return err
		}
		if err := c.AllGather(ctx, make([]float32, 2), make([]float32, 4)); err != nil {
			return err
		}
		return c.Barrier(ctx)
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for r := range 2 {
		recs := g.Rank(r).Records()
		type want struct {
			seq   uint64
			op    Op
			bytes int
		}
		bcast := 0
		if r == 1 {
			bcast = 5
		}
		wants := []want{{6, OpAllReduceMax, 24}, {7, OpBroadcast, bcast}, {8, OpAllGather, 8}, {9, OpBarrier, 0}}
		if len(recs) != len(wants) {
			t.Fatalf("rank %d: %d records, want %d: %+v", r, len(recs), len(wants), recs)
		}
		for i, w := range wants {
			rec := recs[i]
			if rec.Seq != w.seq || rec.Op != w.op || rec.Bytes != w.bytes || rec.Outcome != "ok" ||
				rec.Start.IsZero() || rec.Waiting() || rec.End.Before(rec.Start) {
				t.Errorf("rank %d record %d = %+v, want seq %d %v %d bytes, ok, start <= end", r, i, rec, w.seq, w.op, w.bytes)
			}
			if i > 0 && rec.Start.Before(recs[i-1].End) {
				t.Errorf("rank %d: seq %d started before seq %d ended", r, rec.Seq, recs[i-1].Seq)
			}
		}
	}
}

// TestSnapshotWhileRanksRun is run under -race: a reader snapshots and
// checks for stalls while four ranks run collectives.
func TestSnapshotWhileRanksRun(t *testing.T) {
	const size, rounds = 4, 400
	g := newGroup(t, size, Options{FlightRecorderLen: 16})
	stop := make(chan struct{})
	var reads atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			s := g.Snapshot()
			g.Stuck(time.Now(), 0)
			for _, rs := range s.Ranks {
				if rs.LastCompleted > rs.LastEntered {
					t.Errorf("rank %d: completed %d > entered %d", rs.Rank, rs.LastCompleted, rs.LastEntered)
				}
				if rs.Waiting != nil && rs.Waiting.Seq > rs.LastEntered {
					t.Errorf("rank %d: waiting at %d > entered %d", rs.Rank, rs.Waiting.Seq, rs.LastEntered)
				}
				for i := 1; i < len(rs.Records); i++ {
					if rs.Records[i].Seq <= rs.Records[i-1].Seq {
						t.Errorf("rank %d: records out of order", rs.Rank)
					}
				}
			}
			reads.Add(1)
			runtime.Gosched()
		}
	}()
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		buf := make([]float32, 64)
		for range rounds {
			if err := c.AllReduceSum(ctx, buf); err != nil {
				return err
			}
		}
		return nil
	})
	close(stop)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if reads.Load() == 0 {
		t.Error("the reader never ran")
	}
	for _, rs := range g.Snapshot().Ranks {
		if rs.LastCompleted != rounds || len(rs.Records) != 16 || rs.Records[15].Seq != rounds {
			t.Errorf("rank %d at the end: completed %d, %d records", rs.Rank, rs.LastCompleted, len(rs.Records))
		}
	}
}

func TestCloseWakesWaitersAndLeaksNoGoroutine(t *testing.T) {
	base := runtime.NumGoroutine()
	g, err := NewGroup(4, Options{Watchdog: time.Hour, OnStall: func(Stall) {}})
	if err != nil {
		t.Fatal(err)
	}
	errs := make([]error, 3)
	var wg sync.WaitGroup
	for r := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = g.Rank(r).AllReduceSum(context.Background(), make([]float32, 8))
		}()
	}
	if err := waitArrived(g, 1, 0, 1, 2); err != nil {
		t.Fatal(err)
	}
	g.Close()
	wg.Wait()
	for r, err := range errs {
		if !errors.Is(err, ErrGroupClosed) {
			t.Errorf("rank %d: %v, want ErrGroupClosed", r, err)
		}
		recs := g.Rank(r).Records()
		if len(recs) != 1 || !strings.Contains(recs[0].Outcome, "closed") || recs[0].Waiting() {
			t.Errorf("rank %d: records %+v, want one call ended by Close", r, recs)
		}
	}
	if err := g.Rank(3).Barrier(context.Background()); !errors.Is(err, ErrGroupClosed) {
		t.Errorf("call after Close: %v, want ErrGroupClosed", err)
	}
	if !g.Snapshot().Closed {
		t.Error("Snapshot does not say closed")
	}
	g.Close() // idempotent

	waitfor.NoError(t, "the group's goroutines ending", safety, func() error {
		if n := runtime.NumGoroutine(); n > base {
			return fmt.Errorf("%d goroutines, %d before the group", n, base)
		}
		return nil
	})
}

func TestCancelBreaksTheGroupForEveryRank(t *testing.T) {
	g := newGroup(t, 3, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := context.Background()
			if r == 0 {
				c = ctx
			}
			errs[r] = g.Rank(r).Barrier(c)
		}()
	}
	if err := waitArrived(g, 1, 0, 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	wg.Wait()
	if !errors.Is(errs[0], context.Canceled) {
		t.Errorf("cancelled rank: %v, want context.Canceled", errs[0])
	}
	if !errors.Is(errs[1], ErrGroupBroken) || !strings.Contains(errs[1].Error(), "rank 0 left seq 1") {
		t.Errorf("peer of the cancelled rank: %v, want ErrGroupBroken naming rank 0 and seq 1", errs[1])
	}
	for r := range 3 {
		if err := g.Rank(r).Barrier(context.Background()); !errors.Is(err, ErrGroupBroken) {
			t.Errorf("rank %d after the cancel: %v, want ErrGroupBroken", r, err)
		}
	}
}

func TestACommRefusesASecondGoroutine(t *testing.T) {
	g := newGroup(t, 2, Options{})
	done := make(chan error, 1)
	go func() { done <- g.Rank(0).Barrier(context.Background()) }()
	if err := waitArrived(g, 1, 0); err != nil {
		t.Fatal(err)
	}
	if err := g.Rank(0).Barrier(context.Background()); !errors.Is(err, ErrConcurrentUse) {
		t.Errorf("second goroutine on rank 0: %v, want ErrConcurrentUse", err)
	}
	if err := g.Rank(1).Barrier(context.Background()); err != nil {
		t.Errorf("rank 1: %v (the refused call must not have used a seq)", err)
	}
	if err := <-done; err != nil {
		t.Errorf("rank 0: %v", err)
	}
}

func TestNewGroupRejectsBadOptions(t *testing.T) {
	for _, tc := range []struct {
		size int
		opts Options
	}{
		{0, Options{}},
		{2, Options{FlightRecorderLen: -1}},
		{2, Options{Watchdog: time.Second}},
		{2, Options{Watchdog: -time.Second, OnStall: func(Stall) {}}},
	} {
		if g, err := NewGroup(tc.size, tc.opts); err == nil {
			g.Close()
			t.Errorf("NewGroup(%d, %+v) accepted", tc.size, tc.opts)
		}
	}
}
