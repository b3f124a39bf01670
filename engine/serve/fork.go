package serve

import (
	"errors"
	"fmt"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
)

// Samples of one prompt (Request.N > 1).
//
// The first sample (the parent) is the request the ranks admit and
// prefill; its later samples have the ids parent+1 .. parent+n-1, agreed
// by every rank from the step input, and exist on rank 0 only as fronts
// (streams and samplers) until the parent's first token. At that token
// rank 0 samples n first tokens from the same logits, one per sampler, and
// broadcasts them in the step output; every rank then forks n-1 sequences
// from the parent's: each a new sequence holding a copy of the prompt's
// KV, committed to the prompt's length, that joins the scheduler exactly
// like a PD decode arrival (Transferred: the prompt, its first token
// appended). The prompt is computed once; the KV is copied, not shared,
// so each sample holds its own pages and the scheduler counts them as it
// counts any arrival's.
//
// The forks' room is agreed: the ranks MIN-reduce what each could
// allocate (free plus evictable cached pages, free sequence rows) before
// forking. Busy is not dead: a sample that does not fit joins the
// scheduler's waiting queue without KV, like a retracted request, and
// computes its prompt itself once admitted. A parent that ends before its
// first token (an abort, a timeout, an admission refused) ends its pending
// samples the same way.

// forkAll forks the samples of the parents of the step. It runs on every
// rank after the step's tokens are appended and before StepDone, while the
// parents' sequences hold their prompt's KV. rankcore plans which samples
// fork, wait or end; this runs the plan.
func (l *rankLoop) forkAll(fs []rankcore.Forked) error {
	if !l.ag.runs(rankcore.Fork, rankcore.Facts{Firsts: len(fs)}) {
		return nil
	}
	pages, rows, err := l.room(rankcore.Fork)
	if err != nil {
		return err
	}
	plan := rankcore.PlanFirstForks(rankcore.Capacity{Pages: pages, Rows: rows}, l.e.cfg.PageSize, l.core.Firsts(fs))
	kv := kvCopy{pool: l.rk.Pool(), cache: l.cache, layers: l.e.m.Config.Layers}
	for _, d := range plan.Samples {
		switch d.Act {
		case rankcore.ActEnd:
			l.ex.end(d.ID, ending{reason: d.End}) // done at its first token: nothing to hold
		case rankcore.ActWait:
			// Computes its prompt and first token once admitted; holding
			// no KV, a refusal has nothing to give back.
			req, st := l.core.ForkJoin(d, fs)
			if err := l.joinSample(req, st, nil); err != nil {
				return err
			}
		case rankcore.ActFork:
			seq, evicted, err := kv.copy(d.Parent, d.ID, d.Copy, d.Pages)
			if l.r == 0 {
				l.e.streams.totals.PrefixEvictions += uint64(evicted)
			}
			if err == nil {
				req, st := l.core.ForkJoin(d, fs)
				err = l.joinSample(req, st, seq)
			}
			if err != nil {
				return fmt.Errorf("serve: rank %d: fork %d of %d: %w", l.r, d.ID, d.Parent, err)
			}
		}
	}
	return nil
}

// joinSample adds a sample to the scheduler as req, with its state st;
// seq, when not nil, holds the KV copied for it. A sample the scheduler
// refuses ends at once and gives its KV back: the error is the release's.
func (l *rankLoop) joinSample(req sched.Request, st rankcore.Seq, seq *kvcache.Seq) error {
	if err := l.core.Join(req, st); err != nil {
		l.ex.end(req.ID, ending{reason: sched.ReasonError, err: err.Error()})
		if seq != nil {
			return l.rk.Pool().Release(seq)
		}
	}
	return nil
}

// kvCopy copies a parent's KV into a new sequence for a fork the plan
// decided: the bytes, apart from the decision.
type kvCopy struct {
	pool   *kvcache.Pool
	cache  *prefix.Cache // nil when the prefix cache is off: nothing to evict
	layers int
}

// copy starts sequence id holding a copy of the KV of the first tokens
// positions of sequence parent, evicting cached pages when the pool's
// free pages fall short of pages: what the agreed room counted on. It
// returns the pages it evicted, with or without an error.
func (c kvCopy) copy(parent, id uint64, tokens, pages int) (*kvcache.Seq, int, error) {
	pool := c.pool
	src, ok := pool.Seq(parent)
	if !ok || src.Len() < tokens {
		return nil, 0, fmt.Errorf("parent %d holds no prompt KV", parent)
	}
	evicted := 0
	if short := pages - pool.FreePages(); short > 0 && c.cache != nil {
		evicted = c.cache.Evict(short)
	}
	seq, err := pool.NewSeq(id)
	if err != nil {
		return nil, evicted, err
	}
	if err := pool.Reserve(seq, tokens); err != nil {
		return nil, evicted, errors.Join(err, pool.Release(seq))
	}
	from, to := src.Slots()[:tokens], seq.Slots()[:tokens]
	var k, v, rows, scales []byte
	for layer := range c.layers {
		k, v = pool.AppendKV(layer, from, k[:0], v[:0])
		if err := pool.PutKV(layer, to, k, v); err != nil {
			return nil, evicted, errors.Join(err, pool.Release(seq))
		}
		rows, scales = pool.AppendIndexK(layer, from, rows[:0], scales[:0])
		if err := pool.PutIndexK(layer, to, rows, scales); err != nil {
			return nil, evicted, errors.Join(err, pool.Release(seq))
		}
	}
	if err := pool.Commit(seq, tokens); err != nil {
		return nil, evicted, errors.Join(err, pool.Release(seq))
	}
	return seq, evicted, nil
}

// pdFork is a decode arrival whose later samples fork in this iteration.
type pdFork struct {
	add     addMsg
	n       int  // later samples
	release bool // the arrival ended at once: release its sequence once forked
}

// pdForkAll forks the later samples of this iteration's decode arrivals
// and returns the free pages left to the scheduler. The transfer brought
// the prompt's KV and the first token of the first sample only: each later
// sample starts on a copy of the KV of all but the prompt's last token and
// joins the scheduler with that token still to run, so that it samples its
// own first token from the prompt's logits with its own sampler, at the
// cost of one token each (no second transfer, no protocol change).
// rankcore plans which samples fork, wait or end; this runs the plan.
func (l *rankLoop) pdForkAll(free int) (int, error) {
	fs := l.pdForks
	if !l.ag.runs(rankcore.PDFork, rankcore.Facts{Arrivals: len(fs)}) {
		return free, nil
	}
	l.pdForks = nil
	pages, rows, err := l.room(rankcore.PDFork)
	if err != nil {
		return 0, err
	}
	pool := l.rk.Pool()
	arrivals, srcs := make([]rankcore.Arrival, len(fs)), make([]*kvcache.Seq, len(fs))
	for i, f := range fs {
		src, held := pool.Seq(f.add.id)
		arrivals[i], srcs[i] = rankcore.Arrival{Parent: f.add.id, Samples: f.n, Prompt: len(f.add.prompt), Held: held}, src
	}
	plan := rankcore.PlanArrivalForks(rankcore.Capacity{Pages: pages, Rows: rows}, l.e.cfg.PageSize, arrivals)
	kv := kvCopy{pool: pool, cache: l.cache, layers: l.e.m.Config.Layers}
	samples := plan.Samples
	for i, f := range fs {
		add := f.add
		for _, d := range samples[:f.n] {
			switch d.Act {
			case rankcore.ActEnd:
				// Gone between its arrival and now: aborted.
				l.ex.end(d.ID, ending{reason: d.End})
				continue
			case rankcore.ActWait:
				// Computes its prompt once admitted; holding no KV, a
				// refusal has nothing to give back.
				l.joinSample(sched.Request{ID: d.ID, PromptLen: len(add.prompt), MaxTokens: add.maxTokens},
					add.seq(), nil)
				continue
			}
			var seq *kvcache.Seq
			if d.Copy > 0 {
				var evicted int
				seq, evicted, err = kv.copy(d.Parent, d.ID, d.Copy, d.Pages)
				if l.r == 0 {
					l.e.streams.totals.PrefixEvictions += uint64(evicted)
				}
				if err != nil {
					return 0, fmt.Errorf("serve: rank %d: fork %d of %d: %w", l.r, d.ID, d.Parent, err)
				}
			}
			req := sched.Request{ID: d.ID, PromptLen: len(add.prompt), MaxTokens: add.maxTokens, Transferred: d.Copy}
			if err := l.joinSample(req, add.seq(), seq); err != nil {
				return 0, err
			}
		}
		samples = samples[f.n:]
		if f.release && arrivals[i].Held {
			if err := pool.Release(srcs[i]); err != nil {
				return 0, fmt.Errorf("serve: rank %d: release %d after its forks: %w", l.r, add.id, err)
			}
		}
	}
	return max(0, free-(pages-plan.Left.Pages)), nil
}
