package model

import (
	"errors"
	"fmt"
	"math"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/kernels"
)

// SeqInput is one sequence's part of a forward batch: the next tokens to
// run (a prefill chunk or one decode token) and how many trailing tokens
// want logits.
type SeqInput struct {
	Seq       *kvcache.Seq
	Tokens    []int32
	NumLogits int // logits for the last NumLogits tokens: 1 for generation, len(Tokens) to score a prompt
}

// Exec runs forward passes of one model on one backend over one KV pool. It
// holds scratch buffers, so it belongs to one goroutine (a rank's loop).
//
// Every token is computed independently of the others in the batch (each
// kernel call is batch-invariant, and a token reads only its own sequence's
// KV), so a sequence's logits do not depend on what it is batched with or how
// its prompt is chunked.
type Exec struct {
	m    *Model
	b    kernels.Backend
	pool *kvcache.Pool
	ws   workspace
}

type workspace struct {
	pos                  []int32
	slot                 []int32
	ctx                  [][]int32 // per token: the slots of its whole context
	attn                 [][]int32 // per token: the slots it attends to
	x, xn, q, k, v, a, o []float32
	gate, up, h          []float32
	iq, ik, iw           []float32
	logitRows            []int
	lx                   []float32
	// indexer selection scratch
	selTok   []int       // tokens whose context exceeds top-k
	selSlots [][]int32   // their candidate slots
	selOut   [][]float32 // their scores
	scoreBuf []float32
	selQ     []float32 // their index queries
	selW     []float32 // their per-head weights
	topk     []int32
	slotBuf  []int32
}

// NewExec binds a model, a backend and a pool whose shape matches the model.
func (m *Model) NewExec(b kernels.Backend, pool *kvcache.Pool) (*Exec, error) {
	pc := pool.Config()
	c := &m.Config
	if pc.Layers != c.Layers || pc.KVDim != c.KVDim() {
		return nil, fmt.Errorf("model: pool has %d layers × KV dim %d, model needs %d × %d", pc.Layers, pc.KVDim, c.Layers, c.KVDim())
	}
	if (pc.IndexK != nil) != (c.Indexer != nil) {
		return nil, errors.New("model: pool index-K buffers do not match the model's indexer")
	}
	if c.Indexer != nil && pc.IndexK.Dim != c.Indexer.Dim {
		return nil, fmt.Errorf("model: pool index-K dim %d, indexer key length %d", pc.IndexK.Dim, c.Indexer.Dim)
	}
	return &Exec{m: m, b: b, pool: pool}, nil
}

// PoolConfig is the pool shape this model needs, for the given page size,
// page count and index-K precision. A sequence can grow to the model's
// context length or the pool's capacity, whichever is smaller.
func (m *Model) PoolConfig(pageSize, pages, maxSeqs int, indexK kernels.IndexKDType) kvcache.Config {
	c := &m.Config
	pc := kvcache.Config{
		Layers: c.Layers, KVDim: c.KVDim(), PageSize: pageSize, Pages: pages,
		MaxSeqs: maxSeqs, MaxContext: min(c.ContextLen, pageSize*pages),
	}
	if c.Indexer != nil {
		pc.IndexK = &kvcache.IndexKConfig{DType: indexK, Dim: c.Indexer.Dim}
	}
	return pc
}

// Model returns the model this Exec runs.
func (e *Exec) Model() *Model { return e.m }

// Pool returns the KV pool this Exec writes.
func (e *Exec) Pool() *kvcache.Pool { return e.pool }

// Backend returns the kernels this Exec runs on.
func (e *Exec) Backend() kernels.Backend { return e.b }

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// Forward runs one step over the batch: it writes the KV (and index keys) of
// every input token into its sequence's slots, commits them, and stores the
// requested logits in order (sequence by sequence, token by token) into
// logits, which must hold Σ NumLogits × vocab floats.
func (e *Exec) Forward(batch []SeqInput, logits []float32) error {
	c := &e.m.Config
	n, nl := 0, 0
	for i, s := range batch {
		if len(s.Tokens) == 0 {
			return fmt.Errorf("model: batch entry %d has no tokens", i)
		}
		if s.NumLogits < 0 || s.NumLogits > len(s.Tokens) {
			return fmt.Errorf("model: batch entry %d wants %d logits of %d tokens", i, s.NumLogits, len(s.Tokens))
		}
		for _, t := range s.Tokens {
			if t < 0 || int(t) >= c.VocabSize {
				return fmt.Errorf("model: token %d out of vocabulary (%d)", t, c.VocabSize)
			}
		}
		if s.Seq.Len()+len(s.Tokens) > c.ContextLen {
			return fmt.Errorf("model: sequence of %d tokens exceeds the context length %d", s.Seq.Len()+len(s.Tokens), c.ContextLen)
		}
		n += len(s.Tokens)
		nl += s.NumLogits
	}
	if len(logits) < nl*c.VocabSize {
		return fmt.Errorf("model: logits buffer holds %d floats, need %d", len(logits), nl*c.VocabSize)
	}
	for _, s := range batch {
		if err := e.pool.Reserve(s.Seq, len(s.Tokens)); err != nil {
			return err
		}
	}
	e.prepare(batch, n)
	ws := &e.ws
	for i, t := range e.flatTokens(batch) {
		e.m.TokenEmbd.DecodeRow(ws.x[i*c.Dim:(i+1)*c.Dim], int(t))
	}
	for l := range e.m.Layers {
		e.layer(l, n)
	}
	e.logits(logits)
	for _, s := range batch {
		if err := e.pool.Commit(s.Seq, len(s.Tokens)); err != nil {
			return err
		}
	}
	return nil
}

func (e *Exec) flatTokens(batch []SeqInput) func(func(int, int32) bool) {
	return func(yield func(int, int32) bool) {
		i := 0
		for _, s := range batch {
			for _, t := range s.Tokens {
				if !yield(i, t) {
					return
				}
				i++
			}
		}
	}
}

// prepare sizes the scratch buffers and lays out positions, slots and
// contexts of the n batch tokens.
func (e *Exec) prepare(batch []SeqInput, n int) {
	c := &e.m.Config
	ws := &e.ws
	ws.pos = grow(ws.pos, n)
	ws.slot = grow(ws.slot, n)
	ws.ctx = grow(ws.ctx, n)
	ws.attn = grow(ws.attn, n)
	ws.logitRows = ws.logitRows[:0]
	i := 0
	for _, s := range batch {
		slots := s.Seq.Slots()
		base := s.Seq.Len()
		for j := range s.Tokens {
			p := base + j
			ws.pos[i] = int32(p)
			ws.slot[i] = slots[p]
			ws.ctx[i] = slots[:p+1]
			if j >= len(s.Tokens)-s.NumLogits {
				ws.logitRows = append(ws.logitRows, i)
			}
			i++
		}
	}
	ws.x = grow(ws.x, n*c.Dim)
	ws.xn = grow(ws.xn, n*c.Dim)
	ws.o = grow(ws.o, n*c.Dim)
	ws.q = grow(ws.q, n*c.QDim())
	ws.a = grow(ws.a, n*c.QDim())
	ws.k = grow(ws.k, n*c.KVDim())
	ws.v = grow(ws.v, n*c.KVDim())
	ws.gate = grow(ws.gate, n*c.Hidden)
	ws.up = grow(ws.up, n*c.Hidden)
	ws.h = grow(ws.h, n*c.Hidden)
	if ix := c.Indexer; ix != nil {
		ws.iq = grow(ws.iq, n*ix.Heads*ix.Dim)
		ws.ik = grow(ws.ik, n*ix.Dim)
		ws.iw = grow(ws.iw, n*ix.Heads)
	}
}

func (e *Exec) layer(l, n int) {
	c := &e.m.Config
	w := &e.m.Layers[l]
	b := e.b
	ws := &e.ws
	kvd := c.KVDim()

	b.RMSNorm(ws.xn, ws.x, w.AttnNorm, n, c.NormEps)
	b.MatMul(ws.q, ws.xn, w.Q, n)
	b.MatMul(ws.k, ws.xn, w.K, n)
	b.MatMul(ws.v, ws.xn, w.V, n)
	b.RoPE(ws.q, ws.pos, c.Heads, c.HeadDim, c.RopeDim, c.RopeTheta)
	b.RoPE(ws.k, ws.pos, c.KVHeads, c.HeadDim, c.RopeDim, c.RopeTheta)
	for i := range n {
		e.pool.WriteKV(l, ws.slot[i], ws.k[i*kvd:(i+1)*kvd], ws.v[i*kvd:(i+1)*kvd])
	}
	copy(ws.attn, ws.ctx)
	if c.Indexer != nil {
		e.index(l, n)
	}
	b.Attention(&kernels.AttentionArgs{
		Out: ws.a, Q: ws.q, K: e.pool.K(l), V: e.pool.V(l), Slots: ws.attn[:n],
		NHeads: c.Heads, NKVHeads: c.KVHeads, HeadDim: c.HeadDim,
		Scale: float32(1 / math.Sqrt(float64(c.HeadDim))),
	})
	b.MatMul(ws.o, ws.a, w.O, n)
	addInPlace(ws.x, ws.o)

	b.RMSNorm(ws.xn, ws.x, w.FFNNorm, n, c.NormEps)
	b.MatMul(ws.gate, ws.xn, w.Gate, n)
	b.MatMul(ws.up, ws.xn, w.Up, n)
	b.SwiGLU(ws.h, ws.gate, ws.up)
	b.MatMul(ws.o, ws.h, w.Down, n)
	addInPlace(ws.x, ws.o)
}

// index runs the sparse-attention indexer of layer l: it writes every batch
// token's index key into the pool's index-K buffer (in the pool's precision),
// then, for each token whose context is longer than top-k, scores its context
// from that buffer and narrows ws.attn to the top-k slots.
func (e *Exec) index(l, n int) {
	c := &e.m.Config
	ix := c.Indexer
	w := &e.m.Layers[l]
	b := e.b
	ws := &e.ws

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
		e.pool.WriteIndexK(b, l, ws.slot[i], ws.ik[i*ix.Dim:(i+1)*ix.Dim])
	}

	ws.selTok = ws.selTok[:0]
	total := 0
	for i := range n {
		if len(ws.ctx[i]) > ix.TopK {
			ws.selTok = append(ws.selTok, i)
			total += len(ws.ctx[i])
		}
	}
	if len(ws.selTok) == 0 {
		return
	}
	m := len(ws.selTok)
	ws.selSlots = grow(ws.selSlots, m)
	ws.selOut = grow(ws.selOut, m)
	ws.scoreBuf = grow(ws.scoreBuf, total)
	ws.slotBuf = grow(ws.slotBuf, m*ix.TopK)
	iqd := ix.Heads * ix.Dim
	q := ws.selQ[:0]
	wts := ws.selW[:0]
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
		Out: ws.selOut, Q: q, W: wts, Keys: e.pool.IndexKeys(l), Slots: ws.selSlots, NHeads: ix.Heads,
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

// logits computes the output projection for the rows that asked for it.
func (e *Exec) logits(dst []float32) {
	c := &e.m.Config
	ws := &e.ws
	r := len(ws.logitRows)
	if r == 0 {
		return
	}
	ws.lx = grow(ws.lx, r*c.Dim)
	for j, i := range ws.logitRows {
		copy(ws.lx[j*c.Dim:(j+1)*c.Dim], ws.x[i*c.Dim:(i+1)*c.Dim])
	}
	xn := ws.xn[:r*c.Dim]
	e.b.RMSNorm(xn, ws.lx, e.m.OutputNorm, r, c.NormEps)
	e.b.MatMul(dst[:r*c.VocabSize], xn, e.m.Output, r)
}

func addInPlace(dst, src []float32) {
	for i, v := range src {
		dst[i] += v
	}
}
