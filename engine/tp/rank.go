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

// rank is one rank's share of the model and its state. Everything in it
// belongs to the rank's goroutine. The forward pass itself is model.Exec in
// its sharded form; this type adds the sequences, the step's agreement and
// the all-gather.
type rank struct {
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
func (rk *rank) Gather(local []float32, rows, width int, out []float32) error {
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

func (rk *rank) release(id uint64) error {
	s, ok := rk.pool.Seq(id)
	if !ok {
		return fmt.Errorf("tp: no live sequence %d", id)
	}
	return rk.pool.Release(s)
}

// forward runs one step on this rank; rank 0 stores the logits into dst.
func (rk *rank) forward(ctx context.Context, batch []Input, dst []float32) error {
	rk.ctx = ctx
	defer func() { rk.ctx = nil }()
	if err := rk.begin(ctx, batch); err != nil {
		return err
	}
	rk.inputs = rk.inputs[:0]
	nl := 0
	for i, in := range batch {
		rk.inputs = append(rk.inputs, model.SeqInput{Seq: rk.seqs[i], Tokens: in.Tokens, NumLogits: in.NumLogits})
		nl += in.NumLogits
	}
	if dst == nil {
		rk.logits = grow(rk.logits, nl*rk.m.Config.VocabSize)
		dst = rk.logits
	}
	return rk.exec.Forward(rk.inputs, dst)
}

// begin finds (or starts) every sequence and reserves room for its tokens,
// then agrees with the other ranks that all of them could: a rank that
// failed must not leave its peers waiting in the next collective. On failure
// the sequences this step started are released again.
func (rk *rank) begin(ctx context.Context, batch []Input) error {
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
