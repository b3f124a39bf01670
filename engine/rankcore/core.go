package rankcore

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/pdkit/pdkit/engine/sched"
)

// Core is the state of one rank that every rank of a TP group holds
// alike, and the decisions taken on it: the scheduler, each request's
// tokens and stop rules, the budgets of later samples (n > 1), and which
// requests an iteration ended. Every change to it comes from a value the
// ranks agreed on (the step input and its clock, an agreed capacity, the
// agreed plan, the broadcast results), so the cores of a group stay equal
// as long as the executor feeds them the same values in the table's order.
//
// It holds no clock (time comes in with the step input), no goroutine, no
// pool, socket or randomness: what a decision costs in pages, copies and
// streams is the executor's (engine/serve), which does what the core's
// answers say. The trace tests run several cores in one goroutine.
type Core struct {
	sched *sched.Scheduler
	seqs  map[uint64]*Seq
	forks Forks
	eog   func(int32) bool // the tokenizer's end of generation
	now   time.Duration
	ended []uint64 // requests ended in the current iteration, in order
}

// Seq is what every rank knows of a request.
type Seq struct {
	Tokens    []int32 // prompt, then generated tokens
	MaxTokens int
	IgnoreEOS bool
	Stop      []int32 // stop tokens besides end of generation
	Decoding  bool    // prefilled since its last admission
	Cut       bool    // aborted; its outcome is ignored
}

// Sampled is one token of the broadcast results: the token and whether it
// ends its request (rank 0 decides with [Core.Stops] before it broadcasts).
type Sampled struct {
	Tok  int32
	Stop bool
}

// NewCore is a core whose scheduler has configuration cfg; eog says which
// tokens end a generation (the model's tokenizer: a fixed set, the same on
// every rank).
func NewCore(cfg sched.Config, eog func(int32) bool) (*Core, error) {
	sc, err := sched.New(cfg)
	if err != nil {
		return nil, err
	}
	return &Core{sched: sc, seqs: make(map[uint64]*Seq), eog: eog}, nil
}

// Begin starts an iteration at the step input's clock: the ended list
// empties.
func (c *Core) Begin(now time.Duration) {
	c.now, c.ended = now, c.ended[:0]
}

// Later moves the clock on to the results' clock, never back.
func (c *Core) Later(now time.Duration) { c.now = max(c.now, now) }

// Now is the agreed clock of the iteration.
func (c *Core) Now() time.Duration { return c.now }

// Ended is what ended in this iteration, in order.
func (c *Core) Ended() []uint64 { return c.ended }

// Seq is request id's state, nil when the core does not know it. The
// executor reads it (the batch's tokens, a release's prefix); the core
// alone changes it.
func (c *Core) Seq(id uint64) *Seq { return c.seqs[id] }

// IDs are the requests the core knows, in id order.
func (c *Core) IDs() []uint64 { return slices.Sorted(maps.Keys(c.seqs)) }

// Len is the number of requests the core knows.
func (c *Core) Len() int { return len(c.seqs) }

// Stops says whether tok ends request id's generation: end of generation
// unless it ignores it, or one of its stop tokens. rank 0 asks before it
// broadcasts a sampled token.
func (c *Core) Stops(id uint64, tok int32) bool {
	s := c.seqs[id]
	return s != nil && s.stops(c.eog, tok)
}

func (s *Seq) stops(eog func(int32) bool, tok int32) bool {
	return (!s.IgnoreEOS && eog(tok)) || slices.Contains(s.Stop, tok)
}

// StopsAt says whether tok would end a request of stop rules s that is
// not the core's yet (a decode arrival's first token, a fork's).
func (c *Core) StopsAt(s Seq, tok int32) bool { return s.stops(c.eog, tok) }

// Expect records that request parent, of the step input, has n samples.
func (c *Core) Expect(parent uint64, n int) { c.forks.Expect(parent, n) }

// PendingForks is the number of parent's later samples still to fork.
func (c *Core) PendingForks(parent uint64) int { return c.forks.Pending(parent) }

// TakeForks spends parent's budget at its first token: the samples to
// fork now.
func (c *Core) TakeForks(parent uint64) int { return c.forks.Take(parent) }

// Join adds a request to the scheduler as req with state s. A request the
// scheduler refuses is not the core's: the error says why, and the caller
// ends it.
func (c *Core) Join(req sched.Request, s Seq) error {
	if _, ok := c.seqs[req.ID]; ok {
		return fmt.Errorf("rankcore: request %d joined twice", req.ID)
	}
	if err := c.sched.Add(req, c.now); err != nil {
		return err
	}
	c.seqs[req.ID] = &s
	return nil
}

// End records the end of request id, whatever ended it, and returns the
// later samples that end with it: a parent's before its first token.
// Every rank calls it at the same point of the same iteration.
func (c *Core) End(id uint64) []uint64 {
	c.ended = append(c.ended, id)
	return c.forks.Drop(id)
}

// Forget drops request id once the scheduler finished it; it returns its
// state, for the executor's release.
func (c *Core) Forget(id uint64) (*Seq, error) {
	s := c.seqs[id]
	if s == nil {
		return nil, fmt.Errorf("finish of unknown request %d", id)
	}
	delete(c.seqs, id)
	return s, nil
}

// Tick is the scheduler's timeouts at the iteration's clock.
func (c *Core) Tick() []sched.Finish { return c.sched.Tick(c.now) }

// Schedule plans the step within the agreed capacity.
func (c *Core) Schedule(room Capacity) (sched.Plan, error) {
	return c.sched.Schedule(c.now, room.Pages)
}

// Cut is the outcome of aborting a request.
type Cut struct {
	Unknown  bool           // the core does not know it (a PD room, or gone)
	Finishes []sched.Finish // what the scheduler finished now
	InStep   bool           // it runs in the step in flight: it finishes as the step lands
}

// Cut aborts request id in whatever state it is; an id already cut
// changes nothing.
func (c *Core) Cut(id uint64) (Cut, error) {
	s := c.seqs[id]
	switch {
	case s == nil:
		return Cut{Unknown: true}, nil
	case s.Cut:
		return Cut{}, nil
	}
	s.Cut = true
	fs, err := c.sched.Abort(id, c.now)
	if err != nil {
		return Cut{}, fmt.Errorf("abort %d: %w", id, err)
	}
	return Cut{Finishes: fs, InStep: len(fs) == 0}, nil
}

// Stalled says the plan runs nothing while nothing holds KV: the waiting
// queue's head may wait on pages its followers' cached prefixes hold
// (Unstall decides which give them up).
func (c *Core) Stalled(plan sched.Plan) bool { return len(plan.Run) == 0 && c.sched.Admitted() == 0 }

// DropVoided removes from a plan made ahead the items of requests the
// landed step ended (they stopped or were cut in it): the scheduler's
// StepDone voids the same.
func DropVoided(plan sched.Plan, voided []uint64) sched.Plan {
	if len(voided) > 0 {
		plan.Run = slices.DeleteFunc(slices.Clone(plan.Run), func(it sched.Item) bool { return slices.Contains(voided, it.ID) })
	}
	return plan
}

// Retracted marks the plan's retracted requests as prefilling again.
func (c *Core) Retracted(plan sched.Plan) {
	for _, rt := range plan.Retract {
		if s := c.seqs[rt.ID]; s != nil {
			s.Decoding = false
		}
	}
}

// Uncache lets a waiting request give up its cached prefix down to cached
// tokens (the host part, or all of it).
func (c *Core) Uncache(id uint64, cached int) error { return c.sched.Uncache(id, cached, c.now) }

// Append adds the step's sampled tokens to their requests, those cut in
// the step (by an earlier cut or one of cuts) excepted, and returns the
// requests whose token ends them: the part of landing a step the next
// step's batch needs first (the overlap loop).
func (c *Core) Append(plan sched.Plan, toks []Sampled, cuts []uint64) ([]uint64, error) {
	var stopped []uint64
	j := 0
	for _, it := range plan.Run {
		s := c.seqs[it.ID]
		if !it.WantLogits || s.Cut || slices.Contains(cuts, it.ID) {
			continue
		}
		if j == len(toks) {
			return nil, fmt.Errorf("%d sampled tokens for more items", len(toks))
		}
		t := toks[j]
		j += 1 + c.forks.Pending(it.ID)
		s.Tokens = append(s.Tokens, t.Tok)
		s.Decoding = true
		if t.Stop {
			stopped = append(stopped, it.ID)
		}
	}
	return stopped, nil
}

// Landed is a step's outcome as every rank applies it.
type Landed struct {
	Outcomes []sched.Outcome  // per Run item, for StepDone
	Tokens   map[uint64]int32 // each sampling item's token (a prefill's first token goes to its decode)
	Forks    []Forked         // parents whose first token came: their samples fork now
}

// Forked is a parent whose first token the step sampled, with its later
// samples' first tokens.
type Forked struct {
	Parent uint64
	Toks   []Sampled
}

// Land applies the step's sampled tokens (rank 0's, broadcast) to the
// plan's items: each sampling item gets its token unless it was cut in
// the step, and a parent spends its fork budget. The executor forks,
// sends the step's KV, then calls StepDone with the outcomes.
func (c *Core) Land(plan sched.Plan, toks []Sampled) (Landed, error) {
	return c.land(plan, toks, false)
}

// LandAppended is Land for a step whose tokens Append already added (the
// overlap loop, which appends them before the next step starts).
func (c *Core) LandAppended(plan sched.Plan, toks []Sampled) (Landed, error) {
	return c.land(plan, toks, true)
}

func (c *Core) land(plan sched.Plan, toks []Sampled, appended bool) (Landed, error) {
	ld := Landed{Outcomes: make([]sched.Outcome, 0, len(plan.Run))}
	j := 0
	for _, it := range plan.Run {
		s := c.seqs[it.ID]
		switch {
		case !it.WantLogits:
			ld.Outcomes = append(ld.Outcomes, sched.Outcome{ID: it.ID})
		case s.Cut:
			// Aborted in the step: its outcome is ignored.
			ld.Outcomes = append(ld.Outcomes, sched.Outcome{ID: it.ID, Emitted: 1})
		default:
			if j == len(toks) {
				return Landed{}, fmt.Errorf("%d sampled tokens for more items", len(toks))
			}
			t := toks[j]
			j++
			if !appended {
				s.Tokens = append(s.Tokens, t.Tok)
				s.Decoding = true
			}
			if ld.Tokens == nil {
				ld.Tokens = make(map[uint64]int32)
			}
			ld.Tokens[it.ID] = t.Tok
			ld.Outcomes = append(ld.Outcomes, sched.Outcome{ID: it.ID, Emitted: 1, Stop: t.Stop})
			if k := c.forks.Take(it.ID); k > 0 {
				if j+k > len(toks) {
					return Landed{}, fmt.Errorf("%d sampled tokens for more samples", len(toks))
				}
				ld.Forks = append(ld.Forks, Forked{Parent: it.ID, Toks: toks[j : j+k]})
				j += k
			}
		}
	}
	if j != len(toks) {
		return Landed{}, fmt.Errorf("%d sampled tokens for %d items", len(toks), j)
	}
	return ld, nil
}

// Firsts are the facts PlanFirstForks plans the step's forks from.
func (c *Core) Firsts(fs []Forked) []First {
	out := make([]First, len(fs))
	for i, f := range fs {
		s := c.seqs[f.Parent]
		stops := make([]bool, len(f.Toks))
		for j, t := range f.Toks {
			stops[j] = t.Stop
		}
		out[i] = First{Parent: f.Parent, Prompt: len(s.Tokens) - 1, MaxTokens: s.MaxTokens, Stops: stops}
	}
	return out
}

// ForkJoin is what sample d of a first-token fork joins the scheduler as
// (d waits or forks; one that ends joins nothing), t its first token of
// fs: one that forks holds a copy of the prompt's KV and decodes from its
// first token; one that waits computes prompt and first token once
// admitted.
func (c *Core) ForkJoin(d Sample, fs []Forked) (sched.Request, Seq) {
	s := c.seqs[d.Parent]
	prompt, t := s.Tokens[:len(s.Tokens)-1], fs[d.Of].Toks[d.Index]
	if d.Act == ActWait {
		tokens, maxTokens := append(slices.Clone(prompt), t.Tok), s.MaxTokens-1
		return sched.Request{ID: d.ID, PromptLen: len(tokens), MaxTokens: maxTokens},
			Seq{Tokens: append(make([]int32, 0, len(tokens)+maxTokens), tokens...), MaxTokens: maxTokens, IgnoreEOS: s.IgnoreEOS, Stop: slices.Clone(s.Stop)}
	}
	all := append(make([]int32, 0, len(prompt)+s.MaxTokens), prompt...)
	return sched.Request{ID: d.ID, PromptLen: len(prompt) + 1, MaxTokens: s.MaxTokens - 1, Transferred: len(prompt)},
		Seq{Tokens: append(all, t.Tok), MaxTokens: s.MaxTokens, IgnoreEOS: s.IgnoreEOS, Stop: slices.Clone(s.Stop), Decoding: true}
}

// StepDone hands the landed outcomes to the scheduler: what finished.
func (c *Core) StepDone(outcomes []sched.Outcome) ([]sched.Finish, error) {
	return c.sched.StepDone(c.now, outcomes)
}

// The scheduler's state, read by the executor's decisions on agreed
// values and by the debug API.

// Scheduled is the number of requests in the scheduler.
func (c *Core) Scheduled() int { return c.sched.Len() }

// Admitted is the number of requests holding or being given KV.
func (c *Core) Admitted() int { return c.sched.Admitted() }

// InFlight says a step is planned and not done.
func (c *Core) InFlight() bool { return c.sched.InFlight() }

// Voided are the items of the step ahead that the landed step ended.
func (c *Core) Voided() []uint64 { return c.sched.Voided() }

// FreeSlots is the number of requests the scheduler could still admit.
func (c *Core) FreeSlots() int { return c.sched.Config().MaxRunning - c.sched.Admitted() }

// Reserve is the pages the admitted requests' next growth tokens need,
// which PD grants leave to the scheduler.
func (c *Core) Reserve(growth int) int { return c.sched.Reserve(growth) }

// Head is the waiting queue's head and the pages it needs.
func (c *Core) Head() (id uint64, need int, ok bool) { return c.sched.Head() }

// WaitingIDs are the waiting requests, head first.
func (c *Core) WaitingIDs() []uint64 { return c.sched.WaitingIDs() }

// Snapshot is the scheduler's state as plain values.
func (c *Core) Snapshot() sched.Snapshot { return c.sched.Snapshot() }
