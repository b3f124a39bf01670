package serve

import (
	"fmt"

	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
)

// The phase executors: each runs one row of the loop's table
// (engine/rankcore). It gathers this rank's proposal (its PD votes, its
// prefix matches, its free pages, its plan's digest), runs the row's
// collective through the rank's agreer (agree.go), which enters the phase
// in the rank's cursor first, and applies the agreed value, the same on every
// rank.

// poll is the PD rooms' vote: every rank votes a KVPoll per room from what
// it alone knows, the ranks MIN-reduce the vector (its length, the number
// of rooms, is agreed), and every rank applies the same agreed votes. It
// returns the prefill requests the ranks agreed to admit (their
// TRANSFER_INFO is in), for the iteration's admit.
func (l *rankLoop) poll() ([]addMsg, error) {
	if !l.ag.runs(rankcore.Poll, rankcore.Facts{Rooms: l.pd.rooms()}) {
		return nil, nil
	}
	votes := l.pd.machine.Votes(l.core.Now())
	if err := l.ag.ints(rankcore.Poll, votes); err != nil {
		return nil, err
	}
	return l.pd.applyPoll(l.pdLoop(), votes)
}

// room MIN-reduces, as phase p, what every rank could allocate (free pages
// plus unused cached pages) and its free sequence rows: in the room phase
// what the decode's PD rooms (grantPagesSendInfo) and then the scheduler
// share, in the fork phases (pd_fork, fork) the room to fork samples in.
func (l *rankLoop) room(p rankcore.Phase) (pages, rows int, err error) {
	pool := l.rk.Pool()
	reduced := []int64{int64(l.px.freePages()), int64(pool.Config().MaxSeqs - pool.Live())}
	if err := l.ag.ints(p, reduced); err != nil {
		return 0, 0, err
	}
	return int(reduced[0]), int(reduced[1]), nil
}

// admit adds the new requests, each at the length of its cached prefix: the
// ranks match their own caches and MIN-reduce, per request, the device
// match, the whole match (device plus host tier) and the negated device
// match, so all of them admit at the same length and load back the same
// host part; rankcore's PlanAdmit says what each rank does with its own
// match, and the prefix executor (admission.go) does it. Device caches
// hold the same pages on every rank; should they ever differ (the negated
// minimum is not the minimum), nothing is loaded.
func (l *rankLoop) admit(adds []addMsg) error {
	if len(adds) == 0 {
		return nil
	}
	var hms []prefix.HostMatch
	var plan []rankcore.Admission
	if l.ag.runs(rankcore.Admit, rankcore.Facts{Joining: len(adds), PrefixOn: l.px.on()}) {
		var own []rankcore.Match
		hms, own = l.px.match(adds)
		agreed := rankcore.AdmitProposal(own)
		if err := l.ag.ints(rankcore.Admit, agreed); err != nil {
			return err
		}
		plan = rankcore.PlanAdmit(own, agreed)
	}
	for i, a := range adds {
		var d rankcore.Admission
		var h *hold
		if plan != nil {
			d, h = plan[i], &hold{probe: a.probe}
			if err := l.px.keep(a.prompt, hms[i], d, h); err != nil {
				return err
			}
		}
		total := d.Agreed.Total
		err := l.core.Join(sched.Request{ID: a.id, PromptLen: len(a.prompt), MaxTokens: a.maxTokens, Cached: total, Loaded: d.Loaded()}, a.seq())
		if err != nil {
			if uerr := l.px.unlock(h); uerr != nil {
				return fmt.Errorf("serve: rank %d: %w", l.r, uerr)
			}
			if a.pd {
				// A prefill room the scheduler refuses fails like any
				// other end of its scheduler life.
				if _, err := l.pd.schedFinished(l.pdLoop(), sched.Finish{ID: a.id, Reason: sched.ReasonError}); err != nil {
					return err
				}
			}
			l.ex.end(a.id, ending{reason: sched.ReasonError, err: err.Error()})
			continue
		}
		if h != nil {
			l.px.holds[a.id] = h
		}
		if l.r == 0 {
			t := &l.e.streams.totals
			t.PromptTokens += uint64(len(a.prompt))
			t.CachedTokens += uint64(total)
			if total > 0 {
				t.PrefixHits++
			}
		}
	}
	return nil
}

// agree MAX-reduces the plan digest and its negation: the ranks agree when
// the maximum equals the minimum.
func (l *rankLoop) agree(d uint64) error {
	buf := rankcore.AgreeProposal(d)
	if err := l.ag.ints(rankcore.Agree, buf); err != nil {
		return err
	}
	if !rankcore.PlansAgree(buf) {
		return fmt.Errorf("%w: rank %d at step %d", errDiverged, l.r, l.step+1)
	}
	return nil
}

// results gets the step's outcome: rank 0 takes the aborts that came during
// the step, samples every other item that wants logits, streams the tokens
// and broadcasts all of it; every rank decodes the broadcast bytes.
func (l *rankLoop) results(plan sched.Plan) (stepOutput, error) {
	var out stepOutput
	var data []byte
	if l.r == 0 {
		e := l.e
		out.now = e.clock()
		out.cuts = e.streams.takeAborts()
		cut := make(map[uint64]bool, len(out.cuts))
		for _, a := range out.cuts {
			cut[a.id] = true
		}
		logits := l.rk.Logits()
		greedy := l.rk.Greedy() // the greedy choices the forward found, when it did
		emitted := e.now()      // one timestamp for every token of the step
		e.streams.holding = e.cfg.Schedule == ScheduleOverlap && len(logits) >= holdFromTokens*e.vocab
		defer func() { e.streams.holding = false }()
		j := 0
		for _, it := range plan.Run {
			if !it.WantLogits {
				continue
			}
			lg := logits[j*e.vocab : (j+1)*e.vocab]
			j++
			if l.core.Seq(it.ID).Cut || cut[it.ID] {
				continue
			}
			r := e.streams.front[it.ID]
			var tok int32
			if greedy != nil && r.sampler.IsGreedy() {
				tok = greedy[j-1]
			} else {
				tok = r.sampler.Sample(lg)
			}
			e.streams.totals.Sampled++
			r.gen++
			// Counted even if the reader proves too slow, as
			// CompletionTokens does; never blocks: the request goes
			// instead.
			if !e.streams.emit(r, tok, emitted) {
				r.cut = ReasonSlowReader
				out.cuts = append(out.cuts, abortMsg{id: it.ID, by: AbortBySlowReader})
				continue
			}
			stops := func(tok int32) bool { return l.core.Stops(it.ID, tok) }
			out.toks = append(out.toks, rankcore.Sampled{Tok: tok, Stop: stops(tok)})
			if k := l.core.PendingForks(it.ID); k > 0 {
				out.toks = e.streams.sampleForks(it.ID, k, lg, stops, emitted, out.toks)
			}
		}
		l.wire = out.encode(l.wire[:0])
		data = l.wire
	}
	got, err := l.ag.bytes(rankcore.Results, data)
	if err != nil {
		return out, err
	}
	if err := out.decode(got); err != nil {
		return out, fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return out, nil
}
