package dist

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// nthFault fails one rank's n-th call of one op. It is called from every
// rank's goroutine, so it counts under a mutex.
type nthFault struct {
	rank, n int
	op      Op
	mu      sync.Mutex
	seen    int
}

var errInjected = errors.New("injected")

func (f *nthFault) inject(rank int, seq uint64, op Op) error {
	if rank != f.rank || op != f.op {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen++
	if f.seen == f.n {
		return errInjected
	}
	return nil
}

func TestAnInjectedFailureBreaksTheGroupLikeALeavingRank(t *testing.T) {
	f := &nthFault{rank: 1, n: 3, op: OpAllReduceSum}
	g := newGroup(t, 3, Options{Inject: f.inject})
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		for range 5 {
			if err := c.AllReduceSum(ctx, make([]float32, 4)); err != nil {
				return err
			}
		}
		return nil
	})
	if !errors.Is(errs[1], errInjected) {
		t.Errorf("rank 1: %v, want the injected error", errs[1])
	}
	for _, r := range []int{0, 2} {
		if !errors.Is(errs[r], ErrGroupBroken) || !strings.Contains(errs[r].Error(), "rank 1 left seq 3") {
			t.Errorf("rank %d: %v, want ErrGroupBroken naming rank 1 at seq 3", r, errs[r])
		}
	}
}

func TestAnInjectedDelayShowsTheRankOutsideTheCollective(t *testing.T) {
	release := make(chan struct{})
	g := newGroup(t, 2, Options{Inject: func(rank int, seq uint64, op Op) error {
		if rank == 1 && seq == 2 {
			<-release
		}
		return nil
	}})
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := g.Rank(r)
			if errs[r] = c.Barrier(context.Background()); errs[r] == nil {
				errs[r] = c.AllReduceMaxInt(context.Background(), []int64{int64(r)})
			}
		}()
	}
	if err := waitArrived(g, 2, 0); err != nil {
		t.Fatal(err)
	}
	// Rank 1 may still be recording the end of seq 1; wait until it is out.
	waitfor.For(t, "rank 1 out of the collective", safety, func() bool { return g.Snapshot().Ranks[1].Waiting == nil })
	stalls := g.Stuck(time.Now().Add(time.Hour), time.Minute)
	want := []Peer{{Rank: 1, Seq: 1, Op: OpBarrier}}
	if len(stalls) != 1 || stalls[0].Seq != 2 || !slices.Equal(stalls[0].Missing, want) {
		t.Errorf("Stuck = %+v, want seq 2 missing %v", stalls, want)
	}
	close(release)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}
