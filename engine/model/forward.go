package model

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

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
	// Gate, when set, holds this sequence's reads of layer i of its pages
	// (the indexer's of index-K, attention's of K and V) until its gate for
	// that part of layer i opens: its prefix is being loaded onto the
	// device while the forward pass runs. Other sequences in the batch are
	// not gated by it, but the batch runs as one pass, so they finish with
	// it.
	Gate LayerGate
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
	ctx  context.Context // the current forward's, for the gates

	// Tensor parallelism (see Shard): this rank's rows of every split
	// matrix and the widths they produce. With one rank they are the whole.
	shard              Shard
	layers             []Layer
	output             *kernels.Matrix
	chunks             map[int][]*kernels.Matrix // output row chunks by width (greedy.go)
	chunkBytes         int                       // the chunks' logits bound; 0: greedyChunkBytes
	heads, kvHeads     int
	qDim, kvDim        int
	aDim               int // this rank's attention output width (its heads' values)
	dim, hidden, vocab int
	mla                []mlaHeads // per layer, this rank's heads' expansions (MLA only)
}

// mlaHeads are one layer's per-head latent expansions for this rank's
// heads: kb[h] absorbs head h's position-free query into the latent's
// space, vb[h] expands its attention output to its value.
type mlaHeads struct{ kb, vb []*kernels.Matrix }

// Gatherer joins, across the ranks of a tensor-parallel group, every rank's
// rows×width piece into rows×(ranks·width), pieces side by side in rank
// order. A failure (a cancelled step, a broken group) ends the forward pass.
type Gatherer interface {
	Gather(local []float32, rows, width int, out []float32) error
}

// Shard places an Exec in a tensor-parallel group of Size ranks. Every
// matrix is split by output rows (query and KV heads, model-width rows of the
// output and down projections, hidden rows, vocabulary rows) and the
// activations are gathered after each split matmul. Each output element is
// thus still one full-length dot product computed by the same batch-invariant
// kernel, so any number of ranks gives bit-identical logits to one rank. The
// residual stream and the sparse indexer are replicated on every rank, and so
// is the latent attention's KV row (every rank's heads read the whole latent,
// as in DeepSeek's MLA under tensor parallelism): its projection is not split.
type Shard struct {
	Rank, Size int
	Gather     Gatherer // nil when Size is 1
}

// CheckInput checks batch entry i: at least one token, every token in the
// vocabulary, and logits wanted for at most all of them.
func (c *Config) CheckInput(i int, tokens []int32, numLogits int) error {
	if len(tokens) == 0 {
		return fmt.Errorf("batch entry %d has no tokens", i)
	}
	if numLogits < 0 || numLogits > len(tokens) {
		return fmt.Errorf("batch entry %d wants %d logits of %d tokens", i, numLogits, len(tokens))
	}
	for _, t := range tokens {
		if t < 0 || int(t) >= c.VocabSize {
			return fmt.Errorf("token %d out of vocabulary (%d)", t, c.VocabSize)
		}
	}
	return nil
}

// CheckShards says whether the model can be split over n ranks.
func (c *Config) CheckShards(n int) error {
	if n < 1 {
		return fmt.Errorf("tensor parallelism %d must be at least 1", n)
	}
	dims := []struct {
		what string
		v    int
	}{
		{"attention heads", c.Heads}, {"KV heads", c.KVHeads}, {"embedding length", c.Dim},
		{"feed-forward length", c.Hidden}, {"vocabulary size", c.VocabSize},
	}
	if c.MLA != nil {
		dims = slices.Delete(dims, 1, 2) // the latent row is replicated, not split
	}
	for _, d := range dims {
		if d.v%n != 0 {
			return fmt.Errorf("tensor parallelism %d must divide the %d %s", n, d.v, d.what)
		}
	}
	return nil
}

type workspace struct {
	pos                  []int32
	slot                 []int32
	ctx                  [][]int32 // per token: the slots of its whole context
	attn                 [][]int32 // per token: the slots it attends to
	x, xn, q, k, v, a, o []float32
	gate, up, h          []float32
	iq, ik, iw           []float32
	// latent attention scratch (mla.go)
	mq, mo              []float32 // absorbed queries and their outputs: [token][head][latent+rope]
	mLat, mRope         []float32 // the latent being normalised; RoPE parts being rotated
	mIn, mOut           []float32 // one head's slice in and out of its expansion
	logitRows           []int
	lx, lLocal          []float32
	lChunk, greedyMax   []float32 // output projection chunks (greedy.go)
	greedy              []int32   // each logits row's greedy choice (greedy.go)
	aFull, oFull, hFull []float32 // gathered activations (tensor parallelism)
	// indexer selection scratch
	selTok   []int       // tokens whose context exceeds top-k
	selSlots [][]int32   // their candidate slots
	selOut   [][]float32 // their scores
	scoreBuf []float32
	selQ     []float32 // their index queries
	selW     []float32 // their per-head weights
	topk     []int32
	slotBuf  []int32
	gated    []gated // the batch's sequences with a LayerGate
}

// NewExec binds a model, a backend and a pool whose shape matches the model.
func (m *Model) NewExec(b kernels.Backend, pool *kvcache.Pool) (*Exec, error) {
	return m.NewShardedExec(b, pool, Shard{Size: 1})
}

// NewShardedExec binds rank sh.Rank of a tensor-parallel group: its pool
// holds only its KV heads (see ShardPoolConfig).
func (m *Model) NewShardedExec(b kernels.Backend, pool *kvcache.Pool, sh Shard) (*Exec, error) {
	c := &m.Config
	if err := c.CheckShards(sh.Size); err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	if sh.Rank < 0 || sh.Rank >= sh.Size || (sh.Size > 1 && sh.Gather == nil) {
		return nil, fmt.Errorf("model: rank %d of %d (gatherer set: %v)", sh.Rank, sh.Size, sh.Gather != nil)
	}
	n := sh.Size
	pc := pool.Config()
	if want := m.ShardPoolConfig(n, pc.PageSize, pc.Pages, pc.MaxSeqs, 0); pc.Layers != want.Layers || pc.KVDim != want.KVDim || pc.Latent != want.Latent {
		return nil, fmt.Errorf("model: pool has %d layers × KV dim %d (latent %v), model needs %d × %d (latent %v)",
			pc.Layers, pc.KVDim, pc.Latent, want.Layers, want.KVDim, want.Latent)
	}
	if (pc.IndexK != nil) != (c.Indexer != nil) {
		return nil, errors.New("model: pool index-K buffers do not match the model's indexer")
	}
	if c.Indexer != nil && pc.IndexK.Dim != c.Indexer.Dim {
		return nil, fmt.Errorf("model: pool index-K dim %d, indexer key length %d", pc.IndexK.Dim, c.Indexer.Dim)
	}
	e := &Exec{m: m, b: b, pool: pool, shard: sh,
		heads: c.Heads / n, kvHeads: c.KVHeads / n,
		dim: c.Dim / n, hidden: c.Hidden / n, vocab: c.VocabSize / n,
	}
	e.qDim, e.kvDim, e.aDim = e.heads*c.HeadDim, e.kvHeads*c.HeadDim, e.heads*c.HeadDim
	r := sh.Rank
	e.layers = make([]Layer, len(m.Layers))
	for l, w := range m.Layers {
		w.Q, w.O = rowShard(w.Q, r, n), rowShard(w.O, r, n)
		if c.MLA == nil {
			w.K, w.V = rowShard(w.K, r, n), rowShard(w.V, r, n)
		}
		w.Gate, w.Up, w.Down = rowShard(w.Gate, r, n), rowShard(w.Up, r, n), rowShard(w.Down, r, n)
		e.layers[l] = w // norms, indexer and latent projection stay whole: they are replicated
	}
	if ml := c.MLA; ml != nil {
		e.kvHeads, e.kvDim, e.aDim = 1, c.KVDim(), e.heads*ml.VDim
		e.mla = make([]mlaHeads, len(m.Layers))
		for l, w := range m.Layers {
			e.mla[l] = mlaHeads{kb: headMatrices(w.KB, r*e.heads, e.heads, ml.KVRank), vb: headMatrices(w.VB, r*e.heads, e.heads, ml.VDim)}
		}
	}
	e.output = rowShard(m.Output, r, n)
	return e, nil
}

// headMatrices are heads per-head matrices of rows rows each from a stack
// of them (Layer.KB, Layer.VB), starting at head first, without copying.
func headMatrices(w *kernels.Matrix, first, heads, rows int) []*kernels.Matrix {
	out := make([]*kernels.Matrix, heads)
	for h := range out {
		out[h] = rowRange(w, (first+h)*rows, rows)
	}
	return out
}

// rowRange is rows [lo, lo+k) of w, without copying.
func rowRange(w *kernels.Matrix, lo, k int) *kernels.Matrix {
	rb := w.RowBytes()
	s, err := kernels.NewMatrix(w.DType, k, w.Cols, w.Data[lo*rb:(lo+k)*rb])
	if err != nil { // unreachable: the callers' ranges lie inside w
		panic(fmt.Sprintf("model: rows %d..%d of a %d×%d %v matrix: %v", lo, lo+k, w.Rows, w.Cols, w.DType, err))
	}
	return s
}

// rowShard is rows [r·R/n, (r+1)·R/n) of w, without copying.
func rowShard(w *kernels.Matrix, r, n int) *kernels.Matrix {
	if n == 1 {
		return w
	}
	k := w.Rows / n // CheckShards made the rows divide
	return rowRange(w, r*k, k)
}

// gather joins a split activation across the group (with one rank, the
// local piece is already whole).
func (e *Exec) gather(local []float32, rows, width int, full *[]float32) ([]float32, error) {
	local = local[:rows*width]
	if e.shard.Size == 1 {
		return local, nil
	}
	*full = grow(*full, rows*width*e.shard.Size)
	return *full, e.shard.Gather.Gather(local, rows, width, *full)
}

// PoolConfig is the pool shape this model needs, for the given page size,
// page count and index-K precision, with K and V in float32 (set the
// Config's KVType for a 16-bit pool). A sequence can grow to the model's
// context length or the pool's capacity, whichever is smaller.
func (m *Model) PoolConfig(pageSize, pages, maxSeqs int, indexK kernels.IndexKDType) kvcache.Config {
	return m.ShardPoolConfig(1, pageSize, pages, maxSeqs, indexK)
}

// ShardPoolConfig is PoolConfig for one rank of a group of n: it holds that
// rank's KV heads, and the whole index-K cache (the indexer is replicated).
// A latent-attention model's pool holds the whole latent row on every rank,
// and no V rows (the latent is read as both).
func (m *Model) ShardPoolConfig(n, pageSize, pages, maxSeqs int, indexK kernels.IndexKDType) kvcache.Config {
	c := &m.Config
	pc := kvcache.Config{
		Layers: c.Layers, KVDim: c.RankKVDim(n), PageSize: pageSize, Pages: pages,
		MaxSeqs: maxSeqs, MaxContext: min(c.ContextLen, pageSize*pages), Latent: c.MLA != nil,
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
	return e.ForwardContext(context.Background(), batch, logits)
}

// ForwardContext is Forward whose gate waits (see SeqInput.Gate) end with
// ctx: a wait's error, ctx's included, fails the step.
func (e *Exec) ForwardContext(ctx context.Context, batch []SeqInput, logits []float32) error {
	if _, err := e.check(batch, logits, false); err != nil {
		return err // before anything is reserved
	}
	if err := e.Reserve(batch); err != nil {
		return err
	}
	if err := e.ForwardReserved(ctx, batch, logits); err != nil {
		return err
	}
	return e.Commit(batch)
}

// Reserve reserves room in the pool for every input token of batch: the
// first of ForwardContext's three parts. Reserve and Commit change the
// pool's bookkeeping, so they run where the pool's owner runs; between
// them ForwardReserved touches only the batch's own pages and the Exec's
// workspace, and may run on another goroutine while the owner changes
// other sequences (the overlap schedule's forward goroutine).
func (e *Exec) Reserve(batch []SeqInput) error {
	for _, s := range batch {
		if err := e.pool.Reserve(s.Seq, len(s.Tokens)); err != nil {
			return err
		}
	}
	return nil
}

// Commit records every input token of batch as written: the last part.
func (e *Exec) Commit(batch []SeqInput) error {
	for _, s := range batch {
		if err := e.pool.Commit(s.Seq, len(s.Tokens)); err != nil {
			return err
		}
	}
	return nil
}

// ForwardReserved is ForwardContext's middle part: batch's room is
// reserved (Reserve), and it is committed afterwards (Commit).
func (e *Exec) ForwardReserved(ctx context.Context, batch []SeqInput, logits []float32) error {
	e.ctx = ctx
	e.ws.greedy = e.ws.greedy[:0]
	defer func() { e.ctx = nil; clear(e.ws.gated); e.ws.gated = e.ws.gated[:0] }()
	c := &e.m.Config
	n, err := e.check(batch, logits, true)
	if err != nil {
		return err
	}
	e.prepare(batch, n)
	ws := &e.ws
	for i, t := range e.flatTokens(batch) {
		e.m.TokenEmbd.DecodeRow(ws.x[i*c.Dim:(i+1)*c.Dim], int(t))
	}
	for l := range e.layers {
		if err := e.layer(l, n); err != nil {
			return err
		}
	}
	return e.logits(logits)
}

// check validates batch and the logits buffer and returns the batch's
// tokens; reserved also asks that each sequence has its tokens' room.
func (e *Exec) check(batch []SeqInput, logits []float32, reserved bool) (int, error) {
	c := &e.m.Config
	n, nl := 0, 0
	for i, s := range batch {
		if err := c.CheckInput(i, s.Tokens, s.NumLogits); err != nil {
			return 0, fmt.Errorf("model: %w", err)
		}
		if s.Seq.Len()+len(s.Tokens) > c.ContextLen {
			return 0, fmt.Errorf("model: sequence of %d tokens exceeds the context length %d", s.Seq.Len()+len(s.Tokens), c.ContextLen)
		}
		if reserved && s.Seq.Reserved() < len(s.Tokens) {
			return 0, fmt.Errorf("model: %d tokens for a sequence with room for %d reserved", len(s.Tokens), s.Seq.Reserved())
		}
		n += len(s.Tokens)
		nl += s.NumLogits
	}
	if len(logits) < nl*c.VocabSize {
		return 0, fmt.Errorf("model: logits buffer holds %d floats, need %d", len(logits), nl*c.VocabSize)
	}
	return n, nil
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
	ws.gated = ws.gated[:0]
	i := 0
	for _, s := range batch {
		if s.Gate != nil {
			ws.gated = append(ws.gated, gated{gate: s.Gate, end: i + len(s.Tokens)})
		}
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
	ws.o = grow(ws.o, n*e.dim)
	ws.q = grow(ws.q, n*e.qDim)
	ws.a = grow(ws.a, n*e.aDim)
	ws.k = grow(ws.k, n*e.kvDim)
	if ml := c.MLA; ml == nil {
		ws.v = grow(ws.v, n*e.kvDim)
	} else {
		row := e.kvDim // latent and RoPE key: what a query head reads in the absorbed form
		ws.mq = grow(ws.mq, n*e.heads*row)
		ws.mo = grow(ws.mo, n*e.heads*row)
		ws.mLat = grow(ws.mLat, n*ml.KVRank)
		ws.mRope = grow(ws.mRope, n*max(e.heads, 1)*c.RopeDim)
		ws.mIn = grow(ws.mIn, n*max(ml.NopeDim, ml.KVRank))
		ws.mOut = grow(ws.mOut, n*max(ml.KVRank, ml.VDim))
	}
	ws.gate = grow(ws.gate, n*e.hidden)
	ws.up = grow(ws.up, n*e.hidden)
	ws.h = grow(ws.h, n*e.hidden)
	if ix := c.Indexer; ix != nil {
		ws.iq = grow(ws.iq, n*ix.Heads*ix.Dim)
		ws.ik = grow(ws.ik, n*ix.Dim)
		ws.iw = grow(ws.iw, n*ix.Heads)
	}
}

func (e *Exec) layer(l, n int) error {
	c := &e.m.Config
	w := &e.layers[l]
	b := e.b
	ws := &e.ws

	if len(ws.gated) > 0 {
		if err := e.waitLayer(l); err != nil {
			return err
		}
	}
	b.RMSNorm(ws.xn, ws.x, w.AttnNorm, n, c.NormEps)
	b.MatMul(ws.q, ws.xn, w.Q, n)
	if c.MLA != nil {
		if err := e.latentAttention(l, n); err != nil {
			return err
		}
	} else if err := e.attention(l, n); err != nil {
		return err
	}
	a, err := e.gather(ws.a, n, e.aDim, &ws.aFull)
	if err != nil {
		return err
	}
	b.MatMul(ws.o, a, w.O, n)
	o, err := e.gather(ws.o, n, e.dim, &ws.oFull)
	if err != nil {
		return err
	}
	addInPlace(ws.x, o)

	b.RMSNorm(ws.xn, ws.x, w.FFNNorm, n, c.NormEps)
	b.MatMul(ws.gate, ws.xn, w.Gate, n)
	b.MatMul(ws.up, ws.xn, w.Up, n)
	b.SwiGLU(ws.h, ws.gate, ws.up)
	h, err := e.gather(ws.h, n, e.hidden, &ws.hFull)
	if err != nil {
		return err
	}
	b.MatMul(ws.o, h, w.Down, n)
	if o, err = e.gather(ws.o, n, e.dim, &ws.oFull); err != nil {
		return err
	}
	addInPlace(ws.x, o)
	return nil
}

// attention is layer l's grouped-query attention over ws.q into ws.a: it
// writes every batch token's K and V rows, lets the indexer narrow what
// each token reads, waits for the layer's gates, and attends.
func (e *Exec) attention(l, n int) error {
	c := &e.m.Config
	w := &e.layers[l]
	b := e.b
	ws := &e.ws
	kvd := e.kvDim
	b.MatMul(ws.k, ws.xn, w.K, n)
	b.MatMul(ws.v, ws.xn, w.V, n)
	b.RoPE(ws.q, ws.pos, e.heads, c.HeadDim, c.RopeDim, c.RopeTheta)
	b.RoPE(ws.k, ws.pos, e.kvHeads, c.HeadDim, c.RopeDim, c.RopeTheta)
	for i := range n {
		e.pool.WriteKV(l, ws.slot[i], ws.k[i*kvd:(i+1)*kvd], ws.v[i*kvd:(i+1)*kvd])
	}
	if err := e.narrowAndWait(l, n); err != nil {
		return err
	}
	aa := kernels.AttentionArgs{
		Out: ws.a, Q: ws.q, Slots: ws.attn[:n],
		NHeads: e.heads, NKVHeads: e.kvHeads, HeadDim: c.HeadDim,
		Scale: float32(1 / math.Sqrt(float64(c.HeadDim))),
	}
	e.pool.AttentionKV(l, &aa) // K and V in the pool's element type
	b.Attention(&aa)
	return nil
}

// narrowAndWait sets what each batch token attends to in layer l: its
// whole context, or the indexer's top-k of it; then it waits for the
// layer's KV gates. The layer's K and V (or latent) rows are written.
func (e *Exec) narrowAndWait(l, n int) error {
	ws := &e.ws
	copy(ws.attn, ws.ctx)
	if e.m.Config.Indexer != nil {
		if err := e.index(l, n); err != nil {
			return err
		}
	}
	if len(ws.gated) > 0 {
		return e.waitKV(l)
	}
	return nil
}

// index runs the sparse-attention indexer of layer l: it writes every batch
// token's index key into the pool's index-K buffer (in the pool's precision),
// then, for each token whose context is longer than top-k, scores its context
// from that buffer and narrows ws.attn to the top-k slots. That read waits
// for the index-K gates of layer l first (see LayerGate).
func (e *Exec) index(l, n int) error {
	c := &e.m.Config
	ix := c.Indexer
	w := &e.layers[l]
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
		return nil
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
	if len(ws.gated) > 0 {
		if err := e.waitIndexK(l, ix.TopK); err != nil {
			return err
		}
	}
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
	return nil
}

// logits computes the output projection for the rows that asked for it.
func (e *Exec) logits(dst []float32) error {
	c := &e.m.Config
	ws := &e.ws
	r := len(ws.logitRows)
	ws.greedy = ws.greedy[:0]
	if r == 0 {
		return nil
	}
	ws.lx = grow(ws.lx, r*c.Dim)
	for j, i := range ws.logitRows {
		copy(ws.lx[j*c.Dim:(j+1)*c.Dim], ws.x[i*c.Dim:(i+1)*c.Dim])
	}
	xn := ws.xn[:r*c.Dim]
	e.b.RMSNorm(xn, ws.lx, e.m.OutputNorm, r, c.NormEps)
	if e.shard.Size == 1 {
		return e.projectGreedy(dst, xn, r)
	}
	ws.greedy = nil
	ws.lLocal = grow(ws.lLocal, r*e.vocab)
	e.b.MatMul(ws.lLocal, xn, e.output, r)
	return e.shard.Gather.Gather(ws.lLocal, r, e.vocab, dst[:r*c.VocabSize])
}

func addInPlace(dst, src []float32) {
	for i, v := range src {
		dst[i] += v
	}
}
