package dist

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// safety bounds every test's waiting: a hang fails the test instead of
// hanging it. Assertions never rely on it firing.
const safety = 5 * time.Second

// runRanks runs fn on every rank's goroutine and returns each rank's error.
func runRanks(t *testing.T, g *Group, fn func(ctx context.Context, c *Comm) error) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), safety)
	defer cancel()
	errs := make([]error, g.Size())
	done := make(chan int, g.Size())
	for r := range g.Size() {
		go func() {
			errs[r] = fn(ctx, g.Rank(r))
			done <- r
		}()
	}
	timeout := time.NewTimer(2 * safety)
	defer timeout.Stop()
	for range g.Size() {
		select {
		case <-done:
		case <-timeout.C:
			t.Fatalf("ranks did not return within %v", 2*safety)
		}
	}
	return errs
}

// waitArrived polls, with a deadline, until every rank in ranks is waiting at
// seq. It reads only the lock-free snapshot, and returns an error rather
// than failing the test: the ranks' goroutines call it.
func waitArrived(g *Group, seq uint64, ranks ...int) error {
	arrived := func() bool {
		s := g.Snapshot()
		for _, r := range ranks {
			if w := s.Ranks[r].Waiting; w == nil || w.Seq != seq {
				return false
			}
		}
		return true
	}
	if !waitfor.Poll(safety, arrived) {
		return fmt.Errorf("ranks %v not waiting at seq %d after %v", ranks, seq, safety)
	}
	return nil
}

func newGroup(t testing.TB, size int, opts Options) *Group {
	t.Helper()
	g, err := NewGroup(size, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return g
}
