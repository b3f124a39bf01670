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
			h := l.px.holds[it.ID]
			if err := l.tier.loadBack(it, l.core.Seq(it.ID).Tokens, h); err != nil {
				return nil, err
			}
			if _, err := pool.NewSeqWithPrefix(it.ID, h.matched[:it.Cached/l.e.cfg.PageSize], it.Cached); err != nil {
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
		s, h := l.core.Seq(it.ID), l.px.holds[it.ID]
		n := 0
		if it.WantLogits {
			n = 1
		}
		batch[i] = tp.Input{SeqID: it.ID, Tokens: s.Tokens[it.Start : it.Start+it.Tokens], NumLogits: n}
		if l.cache != nil && h.locked() > 0 {
			if loads := l.cache.Gate(h.matched); loads != nil {
				batch[i].Gate = l.tier.gate(loads)
			}
		}
		rec.BatchTokens += it.Tokens
		if s.Decoding {
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

// apply ends the step on this rank: the cuts, then the tokens, as the
// core lands them; appended says the core has already appended the step's
// tokens (the overlap loop does so before the next step starts). The
// forks and the step's KV go out while the parents hold their prompt's
// KV, before StepDone releases what finished.
func (l *rankLoop) apply(plan sched.Plan, out stepOutput, appended bool) error {
	l.core.Later(out.now)
	for _, a := range out.cuts {
		if err := l.ex.cut(a.id, a.by.String()); err != nil {
			return err
		}
	}
	land := l.core.Land
	if appended {
		land = l.core.LandAppended
	}
	ld, err := land(plan, out.toks)
	if err != nil {
		return fmt.Errorf("%w: rank %d: %v", errWire, l.r, err)
	}
	if err := l.forkAll(ld.Forks); err != nil {
		return err
	}
	if err := l.pd.sendStepKV(l.pdLoop(), l.core, plan.Run, ld.Tokens); err != nil {
		return err
	}
	fs, err := l.core.StepDone(ld.Outcomes)
	if ferr := l.ex.finish(fs); ferr != nil {
		return ferr
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: step %d: %w", l.r, l.step+1, err)
	}
	return nil
}
