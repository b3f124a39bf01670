package serve

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
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

// forkOf is a parent whose first token was sampled in this step, with its
// samples' first tokens.
type forkOf struct {
	parent uint64
	toks   []sampled // n-1: sample i+1's first token
}

// forkRoom reduces the room to fork in: what every rank can allocate.
func (l *rankLoop) forkRoom(p rankcore.Phase) (pages, rows int, err error) {
	pool := l.rk.Pool()
	reduced := []int64{int64(l.freePages()), int64(pool.Config().MaxSeqs - pool.Live())}
	if err := l.agreeInts(p, reduced); err != nil {
		return 0, 0, err
	}
	return int(reduced[0]), int(reduced[1]), nil
}

// forkAll forks the samples of the parents of the step. It runs on every
// rank after the step's tokens are appended and before StepDone, while the
// parents' sequences hold their prompt's KV.
func (l *rankLoop) forkAll(fs []forkOf) error {
	if len(fs) == 0 {
		return nil
	}
	pages, rows, err := l.forkRoom(rankcore.Fork)
	if err != nil {
		return err
	}
	for _, f := range fs {
		s := l.seqs[f.parent]
		prompt := s.all[:len(s.all)-1]
		need := l.e.cfg.pagesFor(len(prompt))
		for i, t := range f.toks {
			id := f.parent + uint64(i) + 1
			if t.stop || s.maxTokens == 1 {
				l.end(id, ending{reason: firstTokenEnd(t)}) // done at its first token: nothing to hold
				continue
			}
			if need > pages || rows < 1 {
				l.waitSample(id, append(slices.Clone(prompt), t.tok), s.maxTokens-1, s.ignoreEOS, s.stop)
				continue
			}
			pages, rows = pages-need, rows-1
			if err := l.fork(f.parent, id, s, prompt, t); err != nil {
				return fmt.Errorf("serve: rank %d: fork %d of %d: %w", l.r, id, f.parent, err)
			}
		}
	}
	return nil
}

// firstTokenEnd is why a sample whose first token ends it finishes.
func firstTokenEnd(t sampled) sched.Reason {
	if t.stop {
		return sched.ReasonStop
	}
	return sched.ReasonLength
}

// waitSample adds a sample that found no room to fork to the scheduler's
// waiting queue without KV, as a retracted request waits: once admitted,
// it computes its tokens (the prompt, and its first token when it has one)
// from position 0. Busy is not dead: it waits its turn instead of failing.
func (l *rankLoop) waitSample(id uint64, tokens []int32, maxTokens int, ignoreEOS bool, stop []int32) {
	if err := l.sched.Add(sched.Request{ID: id, PromptLen: len(tokens), MaxTokens: maxTokens}, l.now); err != nil {
		l.end(id, ending{reason: sched.ReasonError, err: err.Error()})
		return
	}
	all := append(make([]int32, 0, len(tokens)+maxTokens), tokens...)
	l.seqs[id] = &seqState{all: all, maxTokens: maxTokens, ignoreEOS: ignoreEOS, stop: slices.Clone(stop)}
}

// fork starts sample id on a copy of the parent's prompt KV with its first
// token tok.
func (l *rankLoop) fork(parent, id uint64, ps *seqState, prompt []int32, t sampled) error {
	pool := l.rk.Pool()
	seq, err := l.copySeq(parent, id, len(prompt))
	if err != nil {
		return err
	}
	err = l.sched.Add(sched.Request{ID: id, PromptLen: len(prompt) + 1, MaxTokens: ps.maxTokens - 1, Transferred: len(prompt)}, l.now)
	if err != nil {
		l.end(id, ending{reason: sched.ReasonError, err: err.Error()})
		return pool.Release(seq)
	}
	all := append(make([]int32, 0, len(prompt)+ps.maxTokens), prompt...)
	l.seqs[id] = &seqState{all: append(all, t.tok), maxTokens: ps.maxTokens, ignoreEOS: ps.ignoreEOS,
		stop: slices.Clone(ps.stop), decoding: true}
	return nil
}

// copySeq starts sequence id holding a copy of the KV of the first tokens
// positions of sequence parent.
func (l *rankLoop) copySeq(parent, id uint64, tokens int) (*kvcache.Seq, error) {
	pool := l.rk.Pool()
	src, ok := pool.Seq(parent)
	if !ok || src.Len() < tokens {
		return nil, fmt.Errorf("parent %d holds no prompt KV", parent)
	}
	if short := l.e.cfg.pagesFor(tokens) - pool.FreePages(); short > 0 && l.cache != nil {
		n := l.cache.Evict(short)
		if l.r == 0 {
			l.e.totals.PrefixEvictions += uint64(n)
		}
	}
	seq, err := pool.NewSeq(id)
	if err != nil {
		return nil, err
	}
	if err := pool.Reserve(seq, tokens); err != nil {
		return nil, errors.Join(err, pool.Release(seq))
	}
	from, to := src.Slots()[:tokens], seq.Slots()[:tokens]
	var k, v, rows, scales []byte
	for layer := range l.e.m.Config.Layers {
		k, v = pool.AppendKV(layer, from, k[:0], v[:0])
		if err := pool.PutKV(layer, to, k, v); err != nil {
			return nil, errors.Join(err, pool.Release(seq))
		}
		rows, scales = pool.AppendIndexK(layer, from, rows[:0], scales[:0])
		if err := pool.PutIndexK(layer, to, rows, scales); err != nil {
			return nil, errors.Join(err, pool.Release(seq))
		}
	}
	if err := pool.Commit(seq, tokens); err != nil {
		return nil, errors.Join(err, pool.Release(seq))
	}
	return seq, nil
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
func (l *rankLoop) pdForkAll(free int) (int, error) {
	fs := l.pdForks
	if len(fs) == 0 {
		return free, nil
	}
	l.pdForks = nil
	pages, rows, err := l.forkRoom(rankcore.PDFork)
	if err != nil {
		return 0, err
	}
	start := pages
	pool := l.rk.Pool()
	for _, f := range fs {
		prompt, parent := f.add.prompt, f.add.id
		src, ok := pool.Seq(parent)
		copied := len(prompt) - 1
		need := l.e.cfg.pagesFor(copied)
		for i := range f.n {
			id := parent + uint64(i) + 1
			switch {
			case !ok:
				// Gone between its arrival and now: aborted.
				l.end(id, ending{reason: sched.ReasonAbort})
				continue
			case need > pages || (copied > 0 && rows < 1):
				l.waitSample(id, prompt, f.add.maxTokens, f.add.ignoreEOS, f.add.stop)
				continue
			}
			if copied > 0 {
				if _, err := l.copySeq(parent, id, copied); err != nil {
					return 0, fmt.Errorf("serve: rank %d: fork %d of %d: %w", l.r, id, parent, err)
				}
				pages, rows = pages-need, rows-1
			}
			err := l.sched.Add(sched.Request{ID: id, PromptLen: len(prompt), MaxTokens: f.add.maxTokens, Transferred: copied}, l.now)
			if err != nil {
				l.end(id, ending{reason: sched.ReasonError, err: err.Error()})
				if copied > 0 {
					if seq, ok := pool.Seq(id); ok {
						if err := pool.Release(seq); err != nil {
							return 0, err
						}
					}
				}
				continue
			}
			l.seqs[id] = &seqState{all: append(make([]int32, 0, len(prompt)+f.add.maxTokens), prompt...),
				maxTokens: f.add.maxTokens, ignoreEOS: f.add.ignoreEOS, stop: slices.Clone(f.add.stop)}
		}
		if f.release && ok {
			if err := pool.Release(src); err != nil {
				return 0, fmt.Errorf("serve: rank %d: release %d after its forks: %w", l.r, parent, err)
			}
		}
	}
	return max(0, free-(start-pages)), nil
}

// endForks ends the samples a parent had not forked yet, as it ended.
func (l *rankLoop) endForks(parent uint64, en ending) {
	n := l.forks[parent]
	if n == 0 {
		return
	}
	delete(l.forks, parent)
	for i := range n {
		l.end(parent+uint64(i)+1, en)
	}
}

// sampleForks, on rank 0, samples the first tokens of a parent's later
// samples from the parent's logits and streams them.
func (e *Engine) sampleForks(parent uint64, n int, lg []float32, stops func(int32) bool, at time.Time, out []sampled) []sampled {
	for i := range n {
		r := e.front[parent+uint64(i)+1]
		if r == nil {
			out = append(out, sampled{tok: 0, stop: true}) // cannot happen: a fork's front lives until it ends
			continue
		}
		tok := r.sampler.Sample(lg)
		e.totals.Sampled++
		r.gen++
		e.emit(r, tok, at)
		out = append(out, sampled{tok: tok, stop: stops(tok)})
	}
	return out
}
