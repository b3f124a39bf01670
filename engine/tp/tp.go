// Package tp runs a model tensor-parallel over N ranks: N goroutines, each
// owning a shard of the weights, its own backend and its own KV pool, which
// meet only through a dist.Group.
//
// The split is all-gather tensor parallelism. Every matrix is cut by output
// rows: rank r computes rows [r·R/N, (r+1)·R/N) of Q, K and V (its own query
// and KV heads), of O, gate, up and down, and of the output projection, then
// the ranks all-gather the pieces. The residual stream, the norms and the
// sparse indexer are replicated. Every output element is therefore still one
// full-length dot product computed by the same batch-invariant kernel, so the
// logits are bitwise those of the model run on one rank (model.Exec).
package tp

import (
	"context"
	"errors"
	"fmt"
	"runtime/pprof"
	"strconv"
	"sync"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/kernels"
)

// ErrClosed is returned by calls on a closed Engine.
var ErrClosed = errors.New("tp: engine closed")

// ErrAbandoned is returned by every call after a step was abandoned (its ctx
// ended before all ranks finished): the ranks may disagree with the caller
// about what was committed, so the Engine must be rebuilt.
var ErrAbandoned = errors.New("tp: a step was abandoned; the engine must be rebuilt")

// Input is one sequence's part of a forward batch: the next tokens to run
// and how many trailing tokens want logits.
type Input struct {
	SeqID     uint64
	Tokens    []int32
	NumLogits int // logits for the last NumLogits tokens
	// Gate, when set, holds this rank's reads of the sequence's pages per
	// layer (model.SeqInput.Gate): a prefix being loaded back from the
	// rank's host tier. Unlike the rest of the input it is the rank's own.
	Gate model.LayerGate
}

// Shards is a model split over N ranks: each Rank owns its weight shard, its
// backend and its KV pool, and the ranks meet only through one dist.Group.
// Whoever drives the ranks gives each Rank to exactly one goroutine; Engine
// does that for callers that want one call per step, engine/serve runs one
// event loop per Rank.
type Shards struct {
	m     *model.Model
	group *dist.Group
	ranks []*Rank
}

// Options shape a group of ranks.
type Options struct {
	Ranks int // n, the group's size
	// Backend gives rank r its kernels; the Shards own them and close
	// those that have a Close method.
	Backend  func(rank int) kernels.Backend
	PageSize int // tokens per KV page
	KVTokens int // each rank's pool holds ⌈KVTokens/PageSize⌉ pages of its share of every token's KV
	MaxSeqs  int // sequences each pool holds at once
	IndexK   kernels.IndexKDType
	KVType   kernels.DType // K and V element type of every rank's pool: F32 (the zero value), BF16 or F16
	Group    dist.Options  // the group's flight recorder, watchdog and name
}

// NewShards splits m over o.Ranks ranks.
func NewShards(m *model.Model, o Options) (*Shards, error) {
	newBackend, n, pageSize, kvTokens, maxSeqs, indexK, opts := o.Backend, o.Ranks, o.PageSize, o.KVTokens, o.MaxSeqs, o.IndexK, o.Group
	if err := m.Config.CheckShards(n); err != nil {
		return nil, fmt.Errorf("tp: %w", err)
	}
	if pageSize < 1 {
		return nil, fmt.Errorf("tp: page size %d must be positive", pageSize)
	}
	if kvTokens < 1 {
		return nil, fmt.Errorf("tp: KV capacity of %d tokens must be positive", kvTokens)
	}
	pc := m.ShardPoolConfig(n, pageSize, (kvTokens+pageSize-1)/pageSize, maxSeqs, indexK)
	pc.KVType = o.KVType
	group, err := dist.NewGroup(n, opts)
	if err != nil {
		return nil, err
	}
	s := &Shards{m: m, group: group}
	for r := range n {
		pool, err := kvcache.NewPool(pc)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("tp: rank %d: %w", r, err)
		}
		rk := &Rank{r: r, n: n, m: m, b: newBackend(r), pool: pool, comm: group.Rank(r)}
		if rk.b == nil {
			s.Close()
			return nil, fmt.Errorf("tp: no backend for rank %d", r)
		}
		s.ranks = append(s.ranks, rk)
		if rk.exec, err = m.NewShardedExec(rk.b, pool, model.Shard{Rank: r, Size: n, Gather: rk}); err != nil {
			s.Close()
			return nil, fmt.Errorf("tp: rank %d: %w", r, err)
		}
	}
	return s, nil
}

// Size is the number of ranks.
func (s *Shards) Size() int { return len(s.ranks) }

// Rank returns rank r. It belongs to the one goroutine that drives it.
func (s *Shards) Rank(r int) *Rank { return s.ranks[r] }

// Group is the ranks' TP group: its Snapshot, Stuck and Close may be called
// from any goroutine.
func (s *Shards) Group() *dist.Group { return s.group }

// Close closes the group and the backends. Call it once the goroutines that
// drive the ranks have stopped; to wake a rank waiting in a collective
// first, close the Group alone (it is idempotent).
func (s *Shards) Close() error {
	err := s.group.Close()
	for _, rk := range s.ranks {
		switch b := rk.b.(type) {
		case interface{ Close() }:
			b.Close()
		case interface{ Close() error }:
			b.Close()
		}
		rk.b = nil
	}
	return err
}

// Engine runs forward passes of one model over N ranks: one goroutine per
// rank, each step handed to all of them. Its methods may be called from any
// goroutine; steps run one at a time.
type Engine struct {
	m      *model.Model
	n      int
	shards *Shards
	jobs   []chan *job // one per rank, unbuffered
	stop   chan struct{}
	wg     sync.WaitGroup
	logits []float32 // rank 0's logits of the current step

	mu        sync.Mutex // serialises steps; guards abandoned
	abandoned bool

	closeOnce sync.Once
	closeErr  error
}

type jobKind int

const (
	jobForward jobKind = iota
	jobRelease
)

type job struct {
	kind  jobKind
	ctx   context.Context
	batch []Input
	id    uint64          // jobRelease
	done  chan rankResult // buffered, one per rank
}

type rankResult struct {
	rank int
	err  error
}

// New shards m over o.Ranks ranks (see NewShards) and starts a goroutine
// per rank (pprof label rank=r).
func New(m *model.Model, o Options) (*Engine, error) {
	n := o.Ranks
	shards, err := NewShards(m, o)
	if err != nil {
		return nil, err
	}
	e := &Engine{m: m, n: n, shards: shards, stop: make(chan struct{})}
	e.jobs = make([]chan *job, n)
	for r, rk := range shards.ranks {
		e.jobs[r] = make(chan *job)
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			pprof.Do(context.Background(), pprof.Labels("rank", strconv.Itoa(r)), func(context.Context) {
				e.loop(rk, e.jobs[r])
			})
		}()
	}
	return e, nil
}

// Size is the number of ranks.
func (e *Engine) Size() int { return e.n }

// Pool returns rank r's KV pool. It belongs to the rank's goroutine: read it
// only between calls.
func (e *Engine) Pool(r int) *kvcache.Pool { return e.shards.ranks[r].pool }

// loop is rank rk's goroutine: it runs jobs until Close.
func (e *Engine) loop(rk *Rank, jobs <-chan *job) {
	for {
		select {
		case <-e.stop:
			return
		case j := <-jobs:
			var err error
			switch j.kind {
			case jobForward:
				var dst []float32
				if rk.r == 0 {
					dst = e.logits
				}
				err = rk.Forward(j.ctx, j.batch, dst)
			case jobRelease:
				err = rk.Release(j.id)
			}
			j.done <- rankResult{rk.r, err}
		}
	}
}

// Forward runs one step over the batch on every rank: it writes the KV of
// every input token into its sequence (a new SeqID starts a sequence), commits
// it, and stores the requested logits in order (sequence by sequence, token
// by token) into logits, which must hold Σ NumLogits × vocab floats.
//
// When ctx ends before the step completes, Forward returns its error and the
// Engine is unusable afterwards (ErrAbandoned).
func (e *Engine) Forward(ctx context.Context, batch []Input, logits []float32) error {
	c := &e.m.Config
	nl := 0
	seen := make(map[uint64]bool, len(batch))
	for i, s := range batch {
		if err := c.CheckInput(i, s.Tokens, s.NumLogits); err != nil {
			return fmt.Errorf("tp: %w", err)
		}
		if seen[s.SeqID] {
			return fmt.Errorf("tp: sequence %d appears twice in the batch", s.SeqID)
		}
		seen[s.SeqID] = true
		nl += s.NumLogits
	}
	if len(logits) < nl*c.VocabSize {
		return fmt.Errorf("tp: logits buffer holds %d floats, need %d", len(logits), nl*c.VocabSize)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	// Rank 0 of an abandoned or interrupted step may still write e.logits.
	if e.abandoned {
		return ErrAbandoned
	}
	select {
	case <-e.stop:
		return ErrClosed
	default:
	}
	if cap(e.logits) < nl*c.VocabSize {
		e.logits = make([]float32, nl*c.VocabSize)
	}
	e.logits = e.logits[:nl*c.VocabSize]
	if err := e.run(ctx, &job{kind: jobForward, ctx: ctx, batch: batch}); err != nil {
		return err
	}
	copy(logits, e.logits)
	return nil
}

// Release frees sequence id on every rank.
func (e *Engine) Release(ctx context.Context, id uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.run(ctx, &job{kind: jobRelease, ctx: ctx, id: id})
}

// run hands j to every rank and waits for all of them. It holds e.mu.
func (e *Engine) run(ctx context.Context, j *job) error {
	if e.abandoned {
		return ErrAbandoned
	}
	j.done = make(chan rankResult, e.n)
	for r, ch := range e.jobs {
		select {
		case ch <- j:
		case <-e.stop:
			// Ranks that took the job still answer into the buffered done.
			return ErrClosed
		case <-ctx.Done():
			if r > 0 {
				// Some ranks run the step and some do not.
				e.abandoned = true
			}
			return ctx.Err()
		}
	}
	var first error
	for range e.n {
		select {
		case res := <-j.done:
			// A rank's own failure comes before the errors its peers
			// get from the group it broke.
			if res.err != nil && (first == nil || errors.Is(first, dist.ErrGroupBroken)) {
				first = res.err
			}
		case <-e.stop:
			return ErrClosed
		case <-ctx.Done():
			e.abandoned = true
			return ctx.Err()
		}
	}
	return first
}

// Close stops the rank goroutines, closes the group and the backends. It is
// idempotent; a step in flight fails with ErrClosed.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		close(e.stop)
		// Wakes a rank waiting in a collective.
		e.closeErr = e.shards.group.Close()
		e.wg.Wait()
		e.shards.Close()
	})
	return e.closeErr
}
