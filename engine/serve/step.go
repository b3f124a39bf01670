package serve

import (
	"fmt"

	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/tp"
)

// A step's work on this rank once its plan is agreed: the batch prepared
// on the plan's pages, the forward pass, and the agreed outcome applied
// (tokens appended, stops finished, sequences released, cuts).

// prepare starts the sequences of admissions on their cached prefixes,
// evicts cached pages for the room the plan needs and builds the batch.
func (l *rankLoop) prepare(plan sched.Plan, rec *StepRecord) ([]tp.Input, error) {
	pool := l.rk.Pool()
	for _, it := range plan.Run {
		if it.Fresh && it.Cached > 0 {
			s := l.seqs[it.ID]
			if err := l.tier.loadBack(it, s); err != nil {
				return nil, err
			}
			if _, err := pool.NewSeqWithPrefix(it.ID, s.matched[:it.Cached/l.e.cfg.PageSize], it.Cached); err != nil {
				return nil, fmt.Errorf("serve: rank %d: admit %d on its prefix: %w", l.r, it.ID, err)
			}
		}
	}
	evicted := l.px.evictFor(plan)
	if l.r == 0 {
		l.e.streams.totals.PrefixEvictions += uint64(evicted)
		now := l.e.now()
		for _, it := range plan.Run {
			l.e.streams.observeServed(it.ID, now)
		}
	}
	batch := make([]tp.Input, len(plan.Run))
	prefill, decode := 0, 0
	for i, it := range plan.Run {
		s := l.seqs[it.ID]
		n := 0
		if it.WantLogits {
			n = 1
		}
		batch[i] = tp.Input{SeqID: it.ID, Tokens: s.all[it.Start : it.Start+it.Tokens], NumLogits: n}
		if l.cache != nil && len(s.matched) > 0 {
			if loads := l.cache.Gate(s.matched); loads != nil {
				batch[i].Gate = l.tier.gate(loads)
			}
		}
		rec.BatchTokens += it.Tokens
		if s.decoding {
			decode++
		} else {
			prefill++
		}
	}
	rec.BatchSize = len(plan.Run)
	switch {
	case decode == 0:
		rec.Phase = "prefill"
	case prefill == 0:
		rec.Phase = "decode"
	default:
		rec.Phase = "mixed"
	}
	return batch, nil
}

// forward runs the step's forward pass in line (the lock-step loop),
// noting when the pass itself ran.
func (l *rankLoop) forward(batch []tp.Input, rec *StepRecord) error {
	if err := l.ag.forward(); err != nil {
		return err
	}
	if err := l.rk.Begin(ctx, batch, nil); err != nil {
		return err
	}
	rec.ForwardStart = l.e.now()
	err := l.rk.Run(ctx)
	rec.ForwardEnd = l.e.now()
	if err != nil {
		return err
	}
	return l.rk.End()
}

// appendTokens is the part of apply the next step's batch needs first: each
// sampled token appended to its request (those cut in the step get none);
// stopped is told each request whose token ends it.
func (l *rankLoop) appendTokens(plan sched.Plan, out stepOutput, cut map[uint64]bool, stopped func(uint64)) error {
	j := 0
	for _, it := range plan.Run {
		s := l.seqs[it.ID]
		if !it.WantLogits || s.cut || cut[it.ID] {
			continue
		}
		if j == len(out.toks) {
			return fmt.Errorf("%w: rank %d: %d sampled tokens for more items", errWire, l.r, len(out.toks))
		}
		t := out.toks[j]
		j += 1 + l.forks.Pending(it.ID)
		s.all = append(s.all, t.tok)
		s.decoding = true
		if t.stop {
			stopped(it.ID)
		}
	}
	return nil
}

// apply ends the step on this rank: the cuts, then the tokens; appended
// says appendTokens has already appended the step's tokens to their
// requests (the overlap loop does so before the next step starts).
func (l *rankLoop) apply(plan sched.Plan, out stepOutput, appended bool) error {
	l.now = max(l.now, out.now)
	for _, a := range out.cuts {
		if err := l.cut(a.id, a.by.String()); err != nil {
			return err
		}
	}
	outcomes := make([]sched.Outcome, 0, len(plan.Run))
	var toks map[uint64]int32
	var forked []forkOf
	j := 0
	for _, it := range plan.Run {
		s := l.seqs[it.ID]
		switch {
		case !it.WantLogits:
			outcomes = append(outcomes, sched.Outcome{ID: it.ID})
		case s.cut:
			// Aborted in the step: its outcome is ignored.
			outcomes = append(outcomes, sched.Outcome{ID: it.ID, Emitted: 1})
		default:
			if j == len(out.toks) {
				return fmt.Errorf("%w: rank %d: %d sampled tokens for more items", errWire, l.r, len(out.toks))
			}
			t := out.toks[j]
			j++
			if !appended {
				s.all = append(s.all, t.tok)
				s.decoding = true
			}
			if toks == nil {
				toks = make(map[uint64]int32)
			}
			toks[it.ID] = t.tok
			outcomes = append(outcomes, sched.Outcome{ID: it.ID, Emitted: 1, Stop: t.stop})
			if k := l.forks.Take(it.ID); k > 0 {
				if j+k > len(out.toks) {
					return fmt.Errorf("%w: rank %d: %d sampled tokens for more samples", errWire, l.r, len(out.toks))
				}
				forked = append(forked, forkOf{parent: it.ID, toks: out.toks[j : j+k]})
				j += k
			}
		}
	}
	if j != len(out.toks) {
		return fmt.Errorf("%w: rank %d: %d sampled tokens for %d items", errWire, l.r, len(out.toks), j)
	}
	if err := l.forkAll(forked); err != nil { // while the parents hold their prompt's KV
		return err
	}
	if err := l.pd.sendStepKV(l.pdLoop(), l.seqs, plan.Run, toks); err != nil { // before StepDone releases what finished
		return err
	}
	fs, err := l.sched.StepDone(l.now, outcomes)
	if ferr := l.finish(fs); ferr != nil {
		return ferr
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: step %d: %w", l.r, l.step+1, err)
	}
	return nil
}

// finish ends requests the scheduler finished: each exactly once, with its
// sequence (if any) given to the prefix cache; a PD prefill request goes on
// in the PD machine (it waits for the decode's word) or ends by it.
func (l *rankLoop) finish(fs []sched.Finish) error {
	for _, f := range fs {
		s := l.seqs[f.ID]
		if s == nil {
			return fmt.Errorf("serve: rank %d: finish of unknown request %d", l.r, f.ID)
		}
		delete(l.seqs, f.ID)
		var err error
		switch {
		case f.Release:
			err = l.release(f.ID, s)
		case l.cache != nil:
			err = l.px.unlock(s) // finished while waiting
		}
		handled, perr := l.pd.schedFinished(l.pdLoop(), f)
		if !handled {
			l.end(f.ID, endingOf(f, err))
		}
		if err != nil {
			return fmt.Errorf("serve: rank %d: release %d: %w", l.r, f.ID, err)
		}
		if perr != nil {
			return perr
		}
	}
	return nil
}

// release ends request id's sequence: its full pages go to the prefix cache
// (which unlocks its matched prefix), the rest is freed.
func (l *rankLoop) release(id uint64, s *seqState) error {
	pool := l.rk.Pool()
	seq, ok := pool.Seq(id)
	if !ok {
		return fmt.Errorf("no live sequence %d", id)
	}
	defer func() { s.matched = nil }()
	if l.cache == nil {
		return pool.Release(seq)
	}
	return l.cache.Finish(seq, s.all[:seq.Len()], s.matched)
}

// cut aborts a request the ranks know in whatever state it is; an unknown
// (already finished) or already cut id changes nothing. why, who asked,
// goes with a PD request's abort to its peer.
func (l *rankLoop) cut(id uint64, why string) error {
	s := l.seqs[id]
	if s == nil {
		_, err := l.pd.abort(l.pdLoop(), id, why)
		return err
	}
	if s.cut {
		return nil
	}
	s.cut = true
	fs, err := l.sched.Abort(id, l.now)
	if err != nil {
		return fmt.Errorf("serve: rank %d: abort %d: %w", l.r, id, err)
	}
	if len(fs) == 0 && l.r == 0 {
		l.e.streams.totals.AbortsInStep++
	}
	return l.finish(fs)
}
