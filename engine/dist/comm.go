package dist

import (
	"context"
	"fmt"
	"sync/atomic"
)

// Comm is one rank's communicator. Its collectives are for that rank's
// goroutine only; a second goroutine calling at the same time gets
// ErrConcurrentUse. Records may be called from any goroutine.
type Comm struct {
	g    *Group
	rank int
	busy atomic.Bool
	seq  uint64 // the last seq entered; written by the rank's goroutine only

	// The flight recorder; see the package doc. Written by the rank's
	// goroutine only, read by anyone.
	ring      []atomic.Pointer[Record] // slot (seq-1) % len
	waiting   atomic.Pointer[Record]   // the call in progress, or nil
	last      atomic.Pointer[Record]   // the latest call entered
	completed atomic.Uint64            // the last seq that ended ok
	waited    atomic.Int64             // nanoseconds spent in collectives
}

// Rank is this communicator's rank.
func (c *Comm) Rank() int { return c.rank }

// Size is the group's size.
func (c *Comm) Size() int { return c.g.size }

// AllReduceSum replaces buf, on every rank, with the element-wise sum of all
// ranks' buf, summed in rank order 0..N-1 whatever order the ranks arrive in:
// the result is bitwise identical on every rank and from run to run.
func (c *Comm) AllReduceSum(ctx context.Context, buf []float32) error {
	return c.reduceF32(ctx, OpAllReduceSum, buf)
}

// AllReduceMin replaces buf with the element-wise minimum over the ranks; a
// NaN on any rank gives NaN.
func (c *Comm) AllReduceMin(ctx context.Context, buf []float32) error {
	return c.reduceF32(ctx, OpAllReduceMin, buf)
}

// AllReduceMax replaces buf with the element-wise maximum over the ranks; a
// NaN on any rank gives NaN.
func (c *Comm) AllReduceMax(ctx context.Context, buf []float32) error {
	return c.reduceF32(ctx, OpAllReduceMax, buf)
}

// AllReduceMinInt replaces buf with the element-wise minimum over the ranks
// (for example KVPoll states, where Failed is 0 and sticky).
func (c *Comm) AllReduceMinInt(ctx context.Context, buf []int64) error {
	return c.reduceI64(ctx, OpAllReduceMin, buf)
}

// AllReduceMaxInt replaces buf with the element-wise maximum over the ranks.
func (c *Comm) AllReduceMaxInt(ctx context.Context, buf []int64) error {
	return c.reduceI64(ctx, OpAllReduceMax, buf)
}

func (c *Comm) reduceF32(ctx context.Context, op Op, buf []float32) error {
	call := Call{Op: op, Elem: ElemFloat32, Count: len(buf), Root: -1, Out: -1}
	return c.do(ctx, call, arg{f32: buf}, func(r *round) { copy(buf, r.resF32) })
}

func (c *Comm) reduceI64(ctx context.Context, op Op, buf []int64) error {
	call := Call{Op: op, Elem: ElemInt64, Count: len(buf), Root: -1, Out: -1}
	return c.do(ctx, call, arg{i64: buf}, func(r *round) { copy(buf, r.resI64) })
}

// Broadcast copies root's buf into every rank's buf; all lengths must match.
func (c *Comm) Broadcast(ctx context.Context, root int, buf []float32) error {
	call := Call{Op: OpBroadcast, Elem: ElemFloat32, Count: len(buf), Root: root, Out: -1}
	return c.do(ctx, call, arg{f32: buf}, func(r *round) {
		if c.rank != root {
			copy(buf, r.resF32)
		}
	})
}

// BroadcastBytes returns root's data on every rank: root gets data itself,
// the others a fresh copy. Non-roots' data is ignored (pass nil).
func (c *Comm) BroadcastBytes(ctx context.Context, root int, data []byte) ([]byte, error) {
	call := Call{Op: OpBroadcast, Elem: ElemByte, Count: -1, Root: root, Out: -1}
	var a arg
	if c.rank == root {
		call.Count = len(data)
		a.b = data
	}
	var out []byte
	err := c.do(ctx, call, a, func(r *round) {
		if c.rank == root {
			out = data
		} else {
			out = append(make([]byte, 0, len(r.resBytes)), r.resBytes...)
		}
	})
	return out, err
}

// AllGather writes every rank's local into out, in rank order: out must have
// Size()*len(local) elements, and local the same length on every rank.
func (c *Comm) AllGather(ctx context.Context, local, out []float32) error {
	call := Call{Op: OpAllGather, Elem: ElemFloat32, Count: len(local), Root: -1, Out: len(out)}
	return c.do(ctx, call, arg{f32: local}, func(r *round) { copy(out, r.resF32) })
}

// Barrier returns when every rank has entered it.
func (c *Comm) Barrier(ctx context.Context) error {
	return c.do(ctx, Call{Op: OpBarrier, Root: -1, Out: -1}, arg{}, nil)
}

// do runs one collective: it takes the next seq, records the call, joins the
// round, waits for it with ctx and, on success, lets result copy the round's
// result out before the call is recorded as done.
func (c *Comm) do(ctx context.Context, call Call, a arg, result func(*round)) error {
	if !c.busy.CompareAndSwap(false, true) {
		return fmt.Errorf("%w (rank %d)", ErrConcurrentUse, c.rank)
	}
	defer c.busy.Store(false)
	c.seq++
	seq := c.seq
	call.Rank, call.Arrived, call.Tag = c.rank, true, tagOf(ctx)
	if c.g.inject != nil {
		if err := c.g.inject(c.rank, seq, call.Op); err != nil {
			c.begin(seq, call, c.g.clock())
			c.g.leave(nil, c.rank, seq, call.Op, err)
			err = fmt.Errorf("dist: rank %d seq %d %v: injected fault: %w", c.rank, seq, call.Op, err)
			c.end(err)
			return err
		}
	}

	r, err := c.g.join(c.rank, seq, call, a, c.g.clock())
	if err == nil {
		select {
		case <-r.done:
			err = r.err
		case <-ctx.Done():
			if c.g.leave(r, c.rank, seq, call.Op, ctx.Err()) {
				err = r.err // the round settled first
			} else {
				err = fmt.Errorf("dist: rank %d seq %d %v: %w", c.rank, seq, call.Op, ctx.Err())
			}
		}
		if me, ok := err.(*MismatchError); ok {
			err = me.clone() // each rank gets its own
		}
	}
	if err == nil && result != nil {
		result(r)
	}
	c.end(err)
	return err
}
