package tp

import (
	"context"
	"errors"
	"fmt"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/kernels"
)

// Rank is one rank's share of the model and its state. Everything in it
// belongs to the one goroutine that drives the rank. The forward pass itself
// is model.Exec in its sharded form; this type adds the sequences, the step's
// agreement and the all-gather.
type Rank struct {
	r, n int
	m    *model.Model
	b    kernels.Backend
	pool *kvcache.Pool
	comm *dist.Comm
	exec *model.Exec

	ctx     context.Context // the current step's, for Gather
	seqs    []*kvcache.Seq
	created []*kvcache.Seq
	inputs  []model.SeqInput
	logits  []float32 // ranks other than 0 still receive the gathered logits
	gath    []float32 // all-gather output, [N×rows×width]
	last    []float32 // the last Forward's logits
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// Gather all-gathers every rank's rows×width piece and lays the pieces side
// by side in rank order into out (rows × N·width); it is the rank's
// model.Gatherer.
func (rk *Rank) Gather(local []float32, rows, width int, out []float32) error {
	rk.gath = grow(rk.gath, rk.n*rows*width)
	if err := rk.comm.AllGather(rk.ctx, local, rk.gath); err != nil {
		return err
	}
	full := rk.n * width
	for p := range rk.n {
		for i := range rows {
			src := rk.gath[(p*rows+i)*width : (p*rows+i+1)*width]
			copy(out[i*full+p*width:i*full+(p+1)*width], src)
		}
	}
	return nil
}

// Index is the rank's number in its group.
func (rk *Rank) Index() int { return rk.r }

// Pool is the rank's KV pool.
func (rk *Rank) Pool() *kvcache.Pool { return rk.pool }

// Comm is the rank's handle on the group, for the caller's own collectives
// between steps.
func (rk *Rank) Comm() *dist.Comm { return rk.comm }

// Release frees sequence id.
func (rk *Rank) Release(id uint64) error {
	s, ok := rk.pool.Seq(id)
	if !ok {
		return fmt.Errorf("tp: no live sequence %d", id)
	}
	return rk.pool.Release(s)
}

// Forward runs one step over batch on this rank, together with every other
// rank of the group (each with the same batch): it writes the KV of every
// input token into its sequence (a SeqID without a live sequence starts one;
// a sequence started by the caller, for instance with a shared prefix, is
// continued), commits it and stores the requested logits into dst (nil: a
// buffer of the rank's own, see Logits). Every rank ends with the same full
// logits.
func (rk *Rank) Forward(ctx context.Context, batch []Input, dst []float32) error {
	if err := rk.Begin(ctx, batch, dst); err != nil {
		return err
	}
	if err := rk.Run(ctx); err != nil {
		return err
	}
	return rk.End()
}

// Forward's three parts. Begin (find or start the sequences, reserve their
// room, agree that every rank could) and End (commit) change the pool's
// bookkeeping and run on the goroutine that owns the pool; Run, the forward
// pass itself, touches only the batch's own pages, the rank's workspace and
// the forward communicator, so it may run on another goroutine while the
// owner changes other sequences of the pool (the overlap schedule). Each
// Begin needs one Run and one End, in that order; Logits are valid after
// Run.

// Begin starts a step over batch (see Forward): its sequences and their
// room, agreed with every rank on the forward communicator.
func (rk *Rank) Begin(ctx context.Context, batch []Input, dst []float32) error {
	if err := rk.begin(ctx, batch); err != nil {
		return err
	}
	rk.inputs = rk.inputs[:0]
	nl := 0
	for i, in := range batch {
		rk.inputs = append(rk.inputs, model.SeqInput{Seq: rk.seqs[i], Tokens: in.Tokens, NumLogits: in.NumLogits, Gate: in.Gate})
		nl += in.NumLogits
	}
	if dst == nil {
		rk.logits = grow(rk.logits, nl*rk.m.Config.VocabSize)
		dst = rk.logits
	}
	rk.last = dst[:nl*rk.m.Config.VocabSize]
	return nil
}

// Run is the step's forward pass, after Begin.
func (rk *Rank) Run(ctx context.Context) error {
	rk.ctx = ctx
	defer func() { rk.ctx = nil }()
	return rk.exec.ForwardReserved(ctx, rk.inputs, rk.last)
}

// End commits the step's tokens, after Run.
func (rk *Rank) End() error { return rk.exec.Commit(rk.inputs) }

// Logits are the logits of the rank's last Forward, valid until the next.
func (rk *Rank) Logits() []float32 { return rk.last }

// Greedy is each logits row's greedy choice from the rank's last Forward,
// found with the output projection (model.Exec.Greedy); nil in a group of
// more than one rank.
func (rk *Rank) Greedy() []int32 { return rk.exec.Greedy() }

// begin finds (or starts) every sequence and reserves room for its tokens,
// then agrees with the other ranks that all of them could: a rank that
// failed must not leave its peers waiting in the next collective. On failure
// the sequences this step started are released again.
func (rk *Rank) begin(ctx context.Context, batch []Input) error {
	c := &rk.m.Config
	rk.seqs = grow(rk.seqs, len(batch))
	rk.created = rk.created[:0]
	var err error
	for i, in := range batch {
		s, ok := rk.pool.Seq(in.SeqID)
		if !ok {
			if s, err = rk.pool.NewSeq(in.SeqID); err != nil {
				break
			}
			rk.created = append(rk.created, s)
		}
		rk.seqs[i] = s
		if s.Len()+len(in.Tokens) > c.ContextLen {
			err = fmt.Errorf("tp: sequence %d of %d tokens exceeds the context length %d", in.SeqID, s.Len()+len(in.Tokens), c.ContextLen)
			break
		}
		if err = rk.pool.Reserve(s, len(in.Tokens)); err != nil {
			break
		}
	}
	flag := []int64{0}
	if err != nil {
		flag[0] = 1
	}
	if cerr := rk.comm.AllReduceMaxInt(ctx, flag); cerr != nil && err == nil {
		err = cerr
	}
	if err == nil && flag[0] != 0 {
		err = errors.New("tp: another rank could not start the step")
	}
	if err != nil {
		for _, s := range rk.created {
			rk.pool.Release(s)
		}
		rk.created = rk.created[:0]
	}
	return err
}
