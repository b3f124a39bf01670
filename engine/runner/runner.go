// Package runner drives a model over a batch of requests in one process:
// chunked prefill, then decode steps, sampling each sequence on its own. It
// is the single-process engine behind `pdserve generate` and the model
// benchmarks; the serving scheduler reuses model.Exec the same way.
package runner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/kernels"
)

// Options size a runner.
type Options struct {
	PageSize     int                 // tokens per KV page (default 16)
	KVTokens     int                 // KV capacity in tokens across all sequences (default: MaxSeqs × context length)
	MaxSeqs      int                 // sequences in flight (default 1)
	IndexK       kernels.IndexKDType // index-K precision for models with an indexer
	KVType       kernels.DType       // K and V element type: F32 (the zero value), BF16 or F16
	PrefillChunk int                 // prompt tokens per forward step across the batch (default 512)
}

func (o *Options) setDefaults(ctxLen int) {
	if o.PageSize == 0 {
		o.PageSize = 16
	}
	if o.MaxSeqs == 0 {
		o.MaxSeqs = 1
	}
	if o.KVTokens == 0 {
		o.KVTokens = o.MaxSeqs * ctxLen
	}
	if o.PrefillChunk == 0 {
		o.PrefillChunk = 512
	}
}

// Runner owns one KV pool and the scratch of one model execution. Not safe
// for concurrent use.
type Runner struct {
	exec *model.Exec
	opts Options
	buf  []float32
}

// New sizes a pool for m and binds it to backend b.
func New(m *model.Model, b kernels.Backend, opts Options) (*Runner, error) {
	opts.setDefaults(m.Config.ContextLen)
	if opts.PrefillChunk < 1 || opts.MaxSeqs < 1 {
		return nil, fmt.Errorf("runner: prefill chunk %d and max sequences %d must be positive", opts.PrefillChunk, opts.MaxSeqs)
	}
	if opts.PageSize < 1 {
		return nil, fmt.Errorf("runner: page size %d must be positive", opts.PageSize)
	}
	pages := (opts.KVTokens + opts.PageSize - 1) / opts.PageSize
	pc := m.PoolConfig(opts.PageSize, pages, opts.MaxSeqs, opts.IndexK)
	pc.KVType = opts.KVType
	pool, err := kvcache.NewPool(pc)
	if err != nil {
		return nil, err
	}
	exec, err := m.NewExec(b, pool)
	if err != nil {
		return nil, err
	}
	return &Runner{exec: exec, opts: opts}, nil
}

// Pool is the runner's KV pool (for accounting checks).
func (r *Runner) Pool() *kvcache.Pool { return r.exec.Pool() }

// Request is one generation.
type Request struct {
	Prompt    []int32
	MaxTokens int
	Sampling  sample.Params
	// IgnoreEOS keeps generating past end-of-generation tokens (benchmarks).
	IgnoreEOS bool
}

// Finish reasons, as the OpenAI API names them.
const (
	FinishLength = "length"
	FinishStop   = "stop"
)

// Result is one request's output.
type Result struct {
	Tokens []int32
	Finish string
}

// Stats time a Generate call.
type Stats struct {
	PromptTokens, OutputTokens int
	Prefill, Decode            time.Duration
	Steps                      int
}

type seqState struct {
	id      int // index in the request list
	req     Request
	seq     *kvcache.Seq
	sampler *sample.Sampler
	fed     int // prompt tokens already run
	next    int32
	out     []int32
	done    bool
	finish  string
}

// Generate runs all requests together until each reaches its token limit or
// an end-of-generation token. emit, when not nil, receives each new token as
// it is sampled. Pages are released on every path out.
func (r *Runner) Generate(ctx context.Context, reqs []Request, emit func(req int, tok int32)) ([]Result, Stats, error) {
	var st Stats
	m := r.exec.Model()
	if len(reqs) > r.opts.MaxSeqs {
		return nil, st, fmt.Errorf("runner: %d requests, room for %d", len(reqs), r.opts.MaxSeqs)
	}
	pool := r.exec.Pool()
	seqs := make([]*seqState, len(reqs))
	defer func() {
		for _, s := range seqs {
			if s != nil && s.seq != nil {
				_ = pool.Release(s.seq)
			}
		}
	}()
	for i, q := range reqs {
		if len(q.Prompt) == 0 {
			return nil, st, fmt.Errorf("runner: request %d has an empty prompt", i)
		}
		if q.MaxTokens < 1 {
			return nil, st, fmt.Errorf("runner: request %d asks for %d tokens", i, q.MaxTokens)
		}
		if n := len(q.Prompt) + q.MaxTokens; n > m.Config.ContextLen {
			return nil, st, fmt.Errorf("runner: request %d needs %d tokens of context, the model has %d", i, n, m.Config.ContextLen)
		}
		if err := q.Sampling.Validate(); err != nil {
			return nil, st, fmt.Errorf("runner: request %d: %w", i, err)
		}
		seq, err := pool.NewSeq(uint64(i))
		if err != nil {
			return nil, st, err
		}
		seqs[i] = &seqState{id: i, req: q, seq: seq, sampler: sample.New(q.Sampling)}
		st.PromptTokens += len(q.Prompt)
	}
	vocab := m.Config.VocabSize
	batch := make([]model.SeqInput, 0, len(reqs))
	owner := make([]*seqState, 0, len(reqs))
	for {
		if err := ctx.Err(); err != nil {
			return nil, st, err
		}
		batch, owner = batch[:0], owner[:0]
		budget := r.opts.PrefillChunk
		prefilling := false
		for _, s := range seqs {
			switch {
			case s.done:
			case s.fed < len(s.req.Prompt):
				if budget == 0 {
					continue
				}
				n := min(budget, len(s.req.Prompt)-s.fed)
				budget -= n
				in := model.SeqInput{Seq: s.seq, Tokens: s.req.Prompt[s.fed : s.fed+n]}
				s.fed += n
				if s.fed == len(s.req.Prompt) {
					in.NumLogits = 1
				}
				batch = append(batch, in)
				owner = append(owner, s)
				prefilling = true
			default:
				batch = append(batch, model.SeqInput{Seq: s.seq, Tokens: []int32{s.next}, NumLogits: 1})
				owner = append(owner, s)
			}
		}
		if len(batch) == 0 {
			break
		}
		nl := 0
		for _, in := range batch {
			nl += in.NumLogits
		}
		if cap(r.buf) < nl*vocab {
			r.buf = make([]float32, nl*vocab)
		}
		start := time.Now()
		if err := r.exec.Forward(batch, r.buf[:nl*vocab]); err != nil {
			if errors.Is(err, kvcache.ErrOutOfPages) {
				return nil, st, fmt.Errorf("runner: KV pool too small for this batch: %w", err)
			}
			return nil, st, err
		}
		st.Steps++
		j := 0
		for bi, in := range batch {
			if in.NumLogits == 0 {
				continue
			}
			s := owner[bi]
			tok := s.sampler.Sample(r.buf[j*vocab : (j+1)*vocab])
			j++
			s.out = append(s.out, tok)
			s.next = tok
			if emit != nil {
				emit(s.id, tok)
			}
			switch {
			case !s.req.IgnoreEOS && m.Tokenizer.IsEOG(tok):
				s.done, s.finish = true, FinishStop
			case len(s.out) >= s.req.MaxTokens:
				s.done, s.finish = true, FinishLength
			}
		}
		el := time.Since(start)
		if prefilling {
			st.Prefill += el
		} else {
			st.Decode += el
		}
	}
	res := make([]Result, len(seqs))
	for i, s := range seqs {
		res[i] = Result{Tokens: s.out, Finish: s.finish}
		st.OutputTokens += len(s.out)
	}
	return res, st, nil
}
