package dist

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestMismatchIsAnErrorOnEveryRankNotAHang is the overlap-schedule desync:
// ranks that branched differently before a collective all get ErrMismatch at
// that seq, and the group is broken afterwards.
func TestMismatchIsAnErrorOnEveryRankNotAHang(t *testing.T) {
	type branch func(ctx context.Context, c *Comm) error
	sum := func(n int) branch {
		return func(ctx context.Context, c *Comm) error { return c.AllReduceSum(ctx, make([]float32, n)) }
	}
	cases := []struct {
		name   string
		size   int
		reason string
		calls  func(rank int) branch
		want   []string // in the error text
	}{
		{
			name: "different op", size: 2, reason: "op",
			calls: func(rank int) branch {
				if rank == 1 {
					return func(ctx context.Context, c *Comm) error { return c.Broadcast(ctx, 0, make([]float32, 288)) }
				}
				return sum(288)
			},
			want: []string{"seq 17", "rank 0 AllReduceSum float32[288]", "rank 1 Broadcast(root 0) float32[288]"},
		},
		{
			name: "different length", size: 4, reason: "length",
			calls: func(rank int) branch {
				if rank == 2 {
					return sum(287)
				}
				return sum(288)
			},
			want: []string{"seq 17", "rank 2 AllReduceSum float32[287]"},
		},
		{
			name: "one rank idle in a barrier", size: 4, reason: "op",
			calls: func(rank int) branch {
				if rank == 3 {
					return func(ctx context.Context, c *Comm) error { return c.Barrier(ctx) }
				}
				return func(ctx context.Context, c *Comm) error { return c.AllReduceMinInt(ctx, make([]int64, 5)) }
			},
			want: []string{"rank 3 Barrier", "AllReduceMin int64[5]"},
		},
		{
			name: "different element type", size: 2, reason: "element type",
			calls: func(rank int) branch {
				if rank == 0 {
					return func(ctx context.Context, c *Comm) error { return c.AllReduceMinInt(ctx, make([]int64, 4)) }
				}
				return func(ctx context.Context, c *Comm) error { return c.AllReduceMin(ctx, make([]float32, 4)) }
			},
		},
		{
			name: "different root", size: 2, reason: "root",
			calls: func(rank int) branch {
				return func(ctx context.Context, c *Comm) error {
					_, err := c.BroadcastBytes(ctx, c.Rank(), []byte("x"))
					return err
				}
			},
		},
		{
			name: "root out of range", size: 2, reason: "out of range",
			calls: func(rank int) branch {
				return func(ctx context.Context, c *Comm) error { return c.Broadcast(ctx, 2, make([]float32, 1)) }
			},
		},
		{
			name: "AllGather output too short", size: 2, reason: "AllGather out",
			calls: func(rank int) branch {
				return func(ctx context.Context, c *Comm) error {
					return c.AllGather(ctx, make([]float32, 3), make([]float32, 5))
				}
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := newGroup(t, tc.size, Options{})
			errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
				for range 16 {
					if err := c.Barrier(ctx); err != nil {
						return err
					}
				}
				return tc.calls(c.Rank())(ctx, c)
			})
			for r, err := range errs {
				if errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrMismatch) {
					t.Fatalf("rank %d: %v, want ErrMismatch", r, err)
				}
				var me *MismatchError
				if !errors.As(err, &me) || me.Seq != 17 || !strings.Contains(me.Reason, tc.reason) {
					t.Errorf("rank %d: %#v, want a MismatchError at seq 17 about %q", r, me, tc.reason)
				}
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("rank %d: %q does not say %q", r, err, w)
					}
				}
			}
			// The group is broken: every later call on every rank says so.
			errs = runRanks(t, g, func(ctx context.Context, c *Comm) error { return c.Barrier(ctx) })
			for r, err := range errs {
				if !errors.Is(err, ErrGroupBroken) {
					t.Errorf("rank %d after the mismatch: %v, want ErrGroupBroken", r, err)
				}
			}
			snap := g.Snapshot()
			if !strings.Contains(snap.Broken, "seq 17") {
				t.Errorf("Snapshot.Broken = %q, want the seq of the mismatch", snap.Broken)
			}
			for _, rs := range snap.Ranks {
				recs := rs.Records
				if len(recs) != 18 || recs[16].Seq != 17 || !strings.Contains(recs[16].Outcome, "mismatch") {
					t.Errorf("rank %d: flight recorder does not show the mismatch at seq 17: %+v", rs.Rank, recs[16:])
				}
			}
		})
	}
}

func TestMismatchReachesARankThatArrivesLater(t *testing.T) {
	g := newGroup(t, 3, Options{})
	early := make(chan struct{})
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		switch c.Rank() {
		case 0:
			err := c.AllReduceSum(ctx, make([]float32, 8))
			close(early)
			return err
		case 1:
			return c.Barrier(ctx)
		}
		<-early // rank 2 comes after the mismatch was found
		return c.AllReduceSum(ctx, make([]float32, 8))
	})
	for r, err := range errs {
		if !errors.Is(err, ErrMismatch) {
			t.Fatalf("rank %d: %v, want ErrMismatch", r, err)
		}
	}
	want := "rank 0 AllReduceSum float32[8], rank 1 Barrier, rank 2 AllReduceSum float32[8]"
	if !strings.Contains(errs[2].Error(), want) {
		t.Errorf("late rank's error %q does not list every call (%q)", errs[2], want)
	}
	if !strings.Contains(errs[0].Error(), "rank 2 not arrived") && !strings.Contains(errs[1].Error(), "rank 2 not arrived") {
		t.Errorf("early ranks' errors do not say rank 2 had not arrived: %q, %q", errs[0], errs[1])
	}
}
