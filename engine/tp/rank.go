package tp

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/kernels"
)

// rank is one rank's share of the model and its state. Everything in it
// belongs to the rank's goroutine.
type rank struct {
	r, n int
	m    *model.Model
	b    kernels.Backend
	pool *kvcache.Pool
	comm *dist.Comm

	layers []shardLayer
	output *kernels.Matrix // vocab/n rows of the output projection

	// This rank's widths.
	heads, kvHeads     int
	qDim, kvDim        int
	dim, hidden, vocab int
	seqs               []*kvcache.Seq
	created            []*kvcache.Seq
	ws                 workspace
}

// shardLayer holds one layer's row slices owned by this rank.
type shardLayer struct {
	q, k, v, o     *kernels.Matrix
	gate, up, down *kernels.Matrix
}

type workspace struct {
	pos       []int32
	slot      []int32
	ctx       [][]int32 // per token: the slots of its whole context
	attn      [][]int32 // per token: the slots it attends to
	logitRows []int

	x, xn      []float32 // [n×dim], replicated
	q, a       []float32 // [n×qDim] local heads
	k, v       []float32 // [n×kvDim] local KV heads
	aFull      []float32 // [n×Heads·HeadDim]
	o, oFull   []float32 // [n×dim/N], [n×dim]
	gate, up   []float32 // [n×hidden/N]
	h, hFull   []float32 // [n×hidden/N], [n×hidden]
	gath       []float32 // all-gather output, [N×rows×width]
	lx, lLocal []float32 // logit rows, their local vocab slice
	iq, ik, iw []float32 // indexer, replicated

	selTok   []int
	selSlots [][]int32
	selOut   [][]float32
	scoreBuf []float32
	selQ     []float32
	selW     []float32
	topk     []int32
	slotBuf  []int32
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// rows returns rows [r·R/n, (r+1)·R/n) of w without copying.
func rows(w *kernels.Matrix, r, n int) *kernels.Matrix {
	k := w.Rows / n
	rb := w.RowBytes()
	s, err := kernels.NewMatrix(w.DType, k, w.Cols, w.Data[r*k*rb:(r+1)*k*rb])
	if err != nil {
		panic(fmt.Sprintf("tp: slicing a %d×%d %v matrix: %v", w.Rows, w.Cols, w.DType, err))
	}
	return s
}

// shard takes this rank's rows of every split matrix.
func (rk *rank) shard() {
	c := &rk.m.Config
	r, n := rk.r, rk.n
	rk.heads, rk.kvHeads = c.Heads/n, c.KVHeads/n
	rk.qDim, rk.kvDim = rk.heads*c.HeadDim, rk.kvHeads*c.HeadDim
	rk.dim, rk.hidden, rk.vocab = c.Dim/n, c.Hidden/n, c.VocabSize/n
	rk.layers = make([]shardLayer, len(rk.m.Layers))
	for l := range rk.m.Layers {
		w := &rk.m.Layers[l]
		rk.layers[l] = shardLayer{
			q: rows(w.Q, r, n), k: rows(w.K, r, n), v: rows(w.V, r, n), o: rows(w.O, r, n),
			gate: rows(w.Gate, r, n), up: rows(w.Up, r, n), down: rows(w.Down, r, n),
		}
	}
	rk.output = rows(rk.m.Output, r, n)
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
	if err := rk.begin(ctx, batch); err != nil {
		return err
	}
	n := 0
	for _, in := range batch {
		n += len(in.Tokens)
	}
	rk.prepare(batch, n)
	ws := &rk.ws
	dim := rk.m.Config.Dim
	i := 0
	for _, in := range batch {
		for _, t := range in.Tokens {
			rk.m.TokenEmbd.DecodeRow(ws.x[i*dim:(i+1)*dim], int(t))
			i++
		}
	}
	for l := range rk.layers {
		if err := rk.layer(ctx, l, n); err != nil {
			return err
		}
	}
	if err := rk.logits(ctx, dst); err != nil {
		return err
	}
	for i, in := range batch {
		if err := rk.pool.Commit(rk.seqs[i], len(in.Tokens)); err != nil {
			return err
		}
	}
	return nil
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

// prepare sizes the scratch buffers and lays out positions, slots and
// contexts of the n batch tokens.
func (rk *rank) prepare(batch []Input, n int) {
	c := &rk.m.Config
	ws := &rk.ws
	ws.pos = grow(ws.pos, n)
	ws.slot = grow(ws.slot, n)
	ws.ctx = grow(ws.ctx, n)
	ws.attn = grow(ws.attn, n)
	ws.logitRows = ws.logitRows[:0]
	i := 0
	for b, in := range batch {
		s := rk.seqs[b]
		slots := s.Slots()
		base := s.Len()
		for j := range in.Tokens {
			p := base + j
			ws.pos[i] = int32(p)
			ws.slot[i] = slots[p]
			ws.ctx[i] = slots[:p+1]
			if j >= len(in.Tokens)-in.NumLogits {
				ws.logitRows = append(ws.logitRows, i)
			}
			i++
		}
	}
	ws.x = grow(ws.x, n*c.Dim)
	ws.xn = grow(ws.xn, n*c.Dim)
	ws.q = grow(ws.q, n*rk.qDim)
	ws.a = grow(ws.a, n*rk.qDim)
	ws.k = grow(ws.k, n*rk.kvDim)
	ws.v = grow(ws.v, n*rk.kvDim)
	ws.aFull = grow(ws.aFull, n*c.QDim())
	ws.o = grow(ws.o, n*rk.dim)
	ws.oFull = grow(ws.oFull, n*c.Dim)
	ws.gate = grow(ws.gate, n*rk.hidden)
	ws.up = grow(ws.up, n*rk.hidden)
	ws.h = grow(ws.h, n*rk.hidden)
	ws.hFull = grow(ws.hFull, n*c.Hidden)
	if ix := c.Indexer; ix != nil {
		ws.iq = grow(ws.iq, n*ix.Heads*ix.Dim)
		ws.ik = grow(ws.ik, n*ix.Dim)
		ws.iw = grow(ws.iw, n*ix.Heads)
	}
}

// gather all-gathers every rank's rows×width piece and, when dst is not nil,
// lays the pieces side by side in rank order: dst is rows × N·width.
func (rk *rank) gather(ctx context.Context, local []float32, nrows, width int, dst []float32) error {
	ws := &rk.ws
	ws.gath = grow(ws.gath, rk.n*nrows*width)
	if err := rk.comm.AllGather(ctx, local[:nrows*width], ws.gath); err != nil {
		return err
	}
	if dst == nil {
		return nil
	}
	full := rk.n * width
	for p := range rk.n {
		for i := range nrows {
			src := ws.gath[(p*nrows+i)*width : (p*nrows+i+1)*width]
			copy(dst[i*full+p*width:i*full+(p+1)*width], src)
		}
	}
	return nil
}

func (rk *rank) layer(ctx context.Context, l, n int) error {
	c := &rk.m.Config
	w := &rk.m.Layers[l]
	sw := &rk.layers[l]
	b := rk.b
	ws := &rk.ws
	kvd := rk.kvDim

	b.RMSNorm(ws.xn, ws.x, w.AttnNorm, n, c.NormEps)
	b.MatMul(ws.q, ws.xn, sw.q, n)
	b.MatMul(ws.k, ws.xn, sw.k, n)
	b.MatMul(ws.v, ws.xn, sw.v, n)
	b.RoPE(ws.q, ws.pos, rk.heads, c.HeadDim, c.RopeDim, c.RopeTheta)
	b.RoPE(ws.k, ws.pos, rk.kvHeads, c.HeadDim, c.RopeDim, c.RopeTheta)
	for i := range n {
		rk.pool.WriteKV(l, ws.slot[i], ws.k[i*kvd:(i+1)*kvd], ws.v[i*kvd:(i+1)*kvd])
	}
	copy(ws.attn, ws.ctx)
	if c.Indexer != nil {
		rk.index(l, n)
	}
	b.Attention(&kernels.AttentionArgs{
		Out: ws.a, Q: ws.q, K: rk.pool.K(l), V: rk.pool.V(l), Slots: ws.attn[:n],
		NHeads: rk.heads, NKVHeads: rk.kvHeads, HeadDim: c.HeadDim,
		Scale: float32(1 / math.Sqrt(float64(c.HeadDim))),
	})
	if err := rk.gather(ctx, ws.a, n, rk.qDim, ws.aFull); err != nil {
		return err
	}
	b.MatMul(ws.o, ws.aFull, sw.o, n)
	if err := rk.gather(ctx, ws.o, n, rk.dim, ws.oFull); err != nil {
		return err
	}
	addInPlace(ws.x, ws.oFull)

	b.RMSNorm(ws.xn, ws.x, w.FFNNorm, n, c.NormEps)
	b.MatMul(ws.gate, ws.xn, sw.gate, n)
	b.MatMul(ws.up, ws.xn, sw.up, n)
	b.SwiGLU(ws.h, ws.gate, ws.up)
	if err := rk.gather(ctx, ws.h, n, rk.hidden, ws.hFull); err != nil {
		return err
	}
	b.MatMul(ws.o, ws.hFull, sw.down, n)
	if err := rk.gather(ctx, ws.o, n, rk.dim, ws.oFull); err != nil {
		return err
	}
	addInPlace(ws.x, ws.oFull)
	return nil
}

// index runs the sparse-attention indexer of layer l, replicated on every
// rank: it writes every batch token's index key into this rank's index-K
// buffer, then narrows ws.attn to the top-k slots for each token whose
// context is longer than top-k. It is the same computation as model.Exec's,
// so every rank selects the same slots as one rank would.
func (rk *rank) index(l, n int) {
	c := &rk.m.Config
	ix := c.Indexer
	w := &rk.m.Layers[l]
	b := rk.b
	ws := &rk.ws

	b.MatMul(ws.iq, ws.xn, w.IndexQ, n)
	b.MatMul(ws.ik, ws.xn, w.IndexK, n)
	b.MatMul(ws.iw, ws.xn, w.IndexW, n)
	b.RoPE(ws.iq, ws.pos, ix.Heads, ix.Dim, ix.Dim, c.RopeTheta)
	b.RoPE(ws.ik, ws.pos, 1, ix.Dim, ix.Dim, c.RopeTheta)
	wScale := float32(1 / math.Sqrt(float64(ix.Heads*ix.Dim)))
	for i := range ws.iw {
		ws.iw[i] *= wScale
	}
	for i := range n {
		rk.pool.WriteIndexK(b, l, ws.slot[i], ws.ik[i*ix.Dim:(i+1)*ix.Dim])
	}

	ws.selTok = ws.selTok[:0]
	total := 0
	for i := range n {
		if len(ws.ctx[i]) > ix.TopK {
			ws.selTok = append(ws.selTok, i)
			total += len(ws.ctx[i])
		}
	}
	m := len(ws.selTok)
	if m == 0 {
		return
	}
	ws.selSlots = grow(ws.selSlots, m)
	ws.selOut = grow(ws.selOut, m)
	ws.scoreBuf = grow(ws.scoreBuf, total)
	ws.slotBuf = grow(ws.slotBuf, m*ix.TopK)
	iqd := ix.Heads * ix.Dim
	q, wts := ws.selQ[:0], ws.selW[:0]
	off := 0
	for j, i := range ws.selTok {
		ws.selSlots[j] = ws.ctx[i]
		ws.selOut[j] = ws.scoreBuf[off : off+len(ws.ctx[i])]
		off += len(ws.ctx[i])
		q = append(q, ws.iq[i*iqd:(i+1)*iqd]...)
		wts = append(wts, ws.iw[i*ix.Heads:(i+1)*ix.Heads]...)
	}
	ws.selQ, ws.selW = q, wts
	b.IndexScore(&kernels.IndexScoreArgs{
		Out: ws.selOut, Q: q, W: wts, Keys: rk.pool.IndexKeys(l), Slots: ws.selSlots, NHeads: ix.Heads,
	})
	ws.topk = grow(ws.topk, ix.TopK)
	for j, i := range ws.selTok {
		top := b.TopK(ws.topk, ws.selOut[j], ix.TopK)
		sel := ws.slotBuf[j*ix.TopK : (j+1)*ix.TopK]
		for r, idx := range top {
			sel[r] = ws.ctx[i][idx]
		}
		ws.attn[i] = sel
	}
}

// logits computes this rank's vocabulary slice of the rows that asked for
// logits and gathers the whole rows into dst (nil except on rank 0).
func (rk *rank) logits(ctx context.Context, dst []float32) error {
	c := &rk.m.Config
	ws := &rk.ws
	r := len(ws.logitRows)
	if r == 0 {
		return nil
	}
	ws.lx = grow(ws.lx, r*c.Dim)
	for j, i := range ws.logitRows {
		copy(ws.lx[j*c.Dim:(j+1)*c.Dim], ws.x[i*c.Dim:(i+1)*c.Dim])
	}
	xn := ws.xn[:r*c.Dim]
	rk.b.RMSNorm(xn, ws.lx, rk.m.OutputNorm, r, c.NormEps)
	ws.lLocal = grow(ws.lLocal, r*rk.vocab)
	rk.b.MatMul(ws.lLocal, xn, rk.output, r)
	if dst != nil {
		dst = dst[:r*c.VocabSize]
	}
	return rk.gather(ctx, ws.lLocal, r, rk.vocab, dst)
}

func addInPlace(dst, src []float32) {
	for i, v := range src {
		dst[i] += v
	}
}
