package serve

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/steprate"
	"github.com/pdkit/pdkit/kernels"
)

// View is the engine as any goroutine may read it: what the loops
// published (step records, rank 0's snapshot, heartbeats, decision logs),
// the communicators' lock-free state, the incarnation's failures, the
// inbox's counts and the live settings. It is its own type, apart from the
// Engine that acts, because its readers (the HTTP debug API, metrics,
// health probes, pdctl's bundles) must answer while a loop is stuck: a View
// holds no lock but a decision log's (held by a loop for a few stores) and
// none of the state rank 0's loop owns (streams), and its fields say all it
// can reach. Engine.View returns it; Engine.PD reads the PD side.
type View struct {
	cfg    *Config // immutable once New returns
	m      *model.Model
	sup    *supervisor // the incarnation serving now, and the failures
	inbox  *inbox      // its counts only
	snap   *atomic.Pointer[EngineSnapshot]
	faults *faultSet
	// The settings an operator changes live (SetIndexK,
	// SetHiCacheBandwidth).
	indexK           *atomic.Int32
	hicacheBandwidth *atomic.Int64
	rates            *steprate.Tracker
}

// StepRecord describes one loop iteration of one rank. It is immutable once
// published. Step counts iterations, idle ones (no batch, Phase "idle")
// included; ranks in lock-step have equal Step, Digest, ControlSeq and ForwardSeq
// after each iteration.
type StepRecord struct {
	Rank int
	// Loop is the event loop the rank runs: LoopLockstep or LoopOverlap.
	Loop        string
	Step        uint64
	Phase       string // idle, prefill, decode or mixed
	BatchSize   int    // requests in the batch
	BatchTokens int    // tokens in the batch
	Retracted   int    // requests retracted by the plan
	Finished    int    // requests that finished in the iteration
	Digest      uint64 // FNV-1a of (id, start, tokens) of every batch item, in order
	// ControlSeq and ForwardSeq are the sequence numbers of the rank's
	// last collective on each communicator when the iteration ended.
	ControlSeq, ForwardSeq uint64
	Start, End             time.Time
	// ForwardStart and ForwardEnd bound the step's forward pass on this
	// rank (zero when none ran): in the overlap loop it runs while the
	// next iteration has started, so it is not inside Start..End.
	ForwardStart, ForwardEnd time.Time
}

// EngineSnapshot is the engine's state as the loop last published it.
// Readers must not modify it.
type EngineSnapshot struct {
	Taken  time.Time
	Step   StepRecord
	Queue  sched.Snapshot
	Totals Totals
	Err    string // the error that stopped the engine, if any
}

// Totals count since the engine started.
type Totals struct {
	Steps        uint64 // forward steps run
	Tokens       uint64 // tokens run through the model (prefill and decode)
	Sampled      uint64 // tokens sampled
	Retractions  uint64 // requests retracted to free KV
	Aborts       uint64 // requests finished by an abort
	AbortsInStep uint64 // of those, aborted while in the step in flight
	Finished     uint64 // requests finished, by any reason
	// Prefix cache: prompt tokens of admitted requests, and of those the
	// ones read from cached pages instead of computed.
	PromptTokens    uint64
	CachedTokens    uint64
	PrefixHits      uint64 // requests that matched at least one cached page
	PrefixEvictions uint64 // cached pages evicted (rank 0)
	IndexKSwitches  uint64 // live index-K precision switches done
	// PlannedAhead counts steps the overlap loop planned while the step
	// before them was in flight (and ran).
	PlannedAhead uint64
	// Unstalls counts waiting requests that gave their cached prefix up
	// because nothing ran and the queue's head did not fit (loop.go).
	Unstalls uint64
	// Restarts counts the rank group's rebuilds after a stalled
	// collective or a broken group (recover.go).
	Restarts uint64
}

// LoopLockstep names the rank loop that runs each iteration's forward pass
// in line with the rest of it (the engine's only loop today).
const LoopLockstep = "lockstep"

// Health reports progress, not only liveness.
type Health struct {
	LoopAge       time.Duration // since the least recent start of an iteration over the ranks
	Step          uint64
	Waiting       int           // requests queued in the scheduler
	Running       int           // admitted requests (prefilling and decoding)
	Pending       int           // submitted, not yet taken by the loop
	OldestWaiting time.Duration // age of the oldest waiting or pending request
	Err           string
}

// The names of the two communicators of the TP group (see New).
const (
	CommControl = "control"
	CommForward = "forward"
)

// Snapshot returns the state rank 0's loop last published.
func (v *View) Snapshot() *EngineSnapshot { return v.snap.Load() }

// Now is the engine's time (Config.Clock): the now to pass to Health and
// Stalls, whose ages are measured from times stamped on it.
func (v *View) Now() time.Time { return v.cfg.Clock.Now() }

// Health reports the loops' liveness and the age of the oldest request
// that waits, as of now (View.Now).
func (v *View) Health(now time.Time) Health {
	s := v.snap.Load()
	h := Health{
		Step:    s.Step.Step,
		Waiting: len(s.Queue.Waiting),
		Running: len(s.Queue.Prefilling) + len(s.Queue.Running),
		Err:     s.Err,
	}
	for _, l := range v.sup.cur().loops {
		h.LoopAge = max(h.LoopAge, now.Sub(time.Unix(0, l.beat.Load())))
	}
	for _, w := range s.Queue.Waiting {
		h.OldestWaiting = max(h.OldestWaiting, w.Age+now.Sub(s.Taken))
	}
	pending, oldest := v.inbox.counts()
	h.Pending = pending
	if oldest != 0 {
		h.OldestWaiting = max(h.OldestWaiting, now.Sub(time.Unix(0, oldest)))
	}
	return h
}

// LastStep returns the record of rank 0's last finished iteration.
func (v *View) LastStep() StepRecord { return *v.sup.cur().loops[0].last.Load() }

// RankSteps returns every rank's last step record, in rank order.
func (v *View) RankSteps() []StepRecord {
	loops := v.sup.cur().loops
	out := make([]StepRecord, len(loops))
	for i, l := range loops {
		out[i] = *l.last.Load()
	}
	return out
}

// Ranks is the number of tensor-parallel ranks.
func (v *View) Ranks() int { return len(v.sup.cur().loops) }

// KVPages reports rank r's KV pool: pages in use (by sequences or the
// prefix cache), pages the prefix cache holds, and pages in all. It reads
// the pool's atomic counters, so it is safe from any goroutine and answers
// while the loop is stuck.
func (v *View) KVPages(r int) (used, cached, total int) {
	p := v.sup.cur().shards.Rank(r).Pool()
	total = p.TotalPages()
	return total - p.FreePages(), p.CachedPages(), total
}

// HiCache is every rank's host tier snapshot, rank order; nil when the
// prefix cache is off.
func (v *View) HiCache() []TierSnapshot {
	var out []TierSnapshot
	for _, l := range v.sup.cur().loops {
		if s := l.tier.snap.Load(); s != nil {
			out = append(out, *s)
		}
	}
	return out
}

// Collectives copies both communicators' state (control, then forward):
// every rank's flight recorder, the call it waits in, whether the group
// broke. Lock-free.
func (v *View) Collectives() []dist.Snapshot { return v.sup.cur().collectives() }

// Stalls lists the collectives of either communicator that have waited
// longer than threshold at now (View.Now), with the ranks that have not
// arrived; each names its communicator.
func (v *View) Stalls(now time.Time, threshold time.Duration) []dist.Stall {
	var out []dist.Stall
	for _, g := range v.sup.cur().groups() {
		out = append(out, g.Stuck(now, threshold)...)
	}
	return out
}

// StallsReported counts the collectives the watchdog reported as stalled.
func (v *View) StallsReported() uint64 { return v.sup.stalls.Load() }

// CollectiveWait is the time rank r has spent inside collectives of the
// communicator named comm (CommControl or CommForward).
func (v *View) CollectiveWait(comm string, r int) time.Duration {
	for _, g := range v.sup.cur().groups() {
		if g.Name() == comm {
			return g.Rank(r).WaitTotal()
		}
	}
	return 0
}

// LastFailure returns the last failure the engine recovered from, nil when
// none.
func (v *View) LastFailure() *Failure { return v.sup.lastFailure.Load() }

// StepRates are rank 0's step times by phase and batch size: the recent
// average against the baseline (engine/steprate).
func (v *View) StepRates() []steprate.Rate { return v.rates.Rates() }

// Restarts counts the rank group's rebuilds.
func (v *View) Restarts() uint64 { return v.sup.restarts.Load() }

// Decisions reads every rank's decision log, in rank order: the records of
// steps after since (0: all the log keeps), each rank's open iteration and
// the collective it waits in. It takes only the logs' mutexes (held by the
// loops for a few stores) and the communicators' lock-free snapshots, so it
// answers while a loop is stuck.
func (v *View) Decisions(since uint64) []RankDecisions {
	inc := v.sup.cur()
	out := make([]RankDecisions, len(inc.loops))
	snaps := v.Collectives()
	for r := range inc.loops {
		out[r] = v.rankDecisions(r, since, snaps)
	}
	return out
}

// RankDecisions reads rank r's decision log (see Decisions).
func (v *View) RankDecisions(r int, since uint64) RankDecisions {
	return v.rankDecisions(r, since, v.Collectives())
}

func (v *View) rankDecisions(r int, since uint64, snaps []dist.Snapshot) RankDecisions {
	inc := v.sup.cur()
	l := inc.loops[r]
	entered := inc.control.Rank(r).LastSeq() // before the log: see below
	recs, open, last, lastC := l.ag.log.read(since)
	rd := RankDecisions{Rank: r, Records: make([]DecisionRecord, len(recs)), LastStep: last}
	for i := range recs {
		rd.Records[i] = recs[i].record(r)
	}
	for _, g := range snaps {
		if r < len(g.Ranks) {
			if w := g.Ranks[r].Waiting; w != nil {
				rd.Waiting = &DecisionWait{Comm: g.Name, Seq: w.Seq, Op: w.Op, Since: w.Start}
			}
		}
	}
	switch {
	case open != nil:
		o := open.record(r)
		rd.Open = &o
	case entered > lastC:
		// The rank had entered a collective after its last record's
		// before the log was read, so it is still in the next
		// iteration: its input broadcast, nothing agreed yet.
		rd.Open = &DecisionRecord{Rank: r, Step: last + 1, Agreed: []Agreement{}}
	}
	return rd
}

// IndexK is the precision the index keys are stored in now.
func (v *View) IndexK() kernels.IndexKDType { return kernels.IndexKDType(v.indexK.Load()) }

// Faults lists every fault switch with its state on this engine (those of
// other roles listed as off).
func (v *View) Faults() []FaultInfo {
	out := slices.Clone(faultSpecs)
	for i := range out {
		out[i].On = v.faults.on[i].Load()
	}
	return out
}

// Settings returns the engine's effective settings, as GET
// /debug/v1/settings publishes them: its Config after the defaults, the
// fault switches on now, and whether the model has an indexer. It reads
// only the immutable config and the switches' atomics, so it answers while
// a loop is stuck. The server-level fields (StallAfterMS, MaxQueueAgeMS)
// are the HTTP server's to fill.
func (v *View) Settings() debug.Settings {
	var on []string
	for _, f := range v.Faults() {
		if f.On {
			on = append(on, f.Name)
		}
	}
	s := settingsOf(*v.cfg, v.m != nil && v.m.Config.Indexer != nil, on)
	s.IndexK = v.IndexK().String() // settable live (SetIndexK): the value now
	if v.m != nil {
		hs := v.decodeInfo()
		s.Handshake, s.PDProtocol = &hs, int(pdproto.Version)
		if fc := v.m.CheckFile(time.Now(), modelCheckEvery); fc.Path != "" {
			s.ModelFile = &debug.ModelFile{Path: fc.Path, Fingerprint: fc.Fingerprint, SHA256: fc.SHA256, Changed: fc.Changed, Why: fc.Why}
			if !fc.Checked.IsZero() {
				t := fc.Checked
				s.ModelFile.Checked = &t
			}
			if !fc.Verified.IsZero() {
				t := fc.Verified
				s.ModelFile.Verified = &t
			}
		}
	}
	if s.HiCache != nil {
		// Settable live (SetHiCacheBandwidth): the value now.
		s.HiCache.LoadBandwidthBytesPerSecond = v.hicacheBandwidth.Load()
	}
	return s
}

// indexKName is the index-K precision's name as the PD handshake and
// machine compare it, "" for a model without an indexer.
func (v *View) indexKName() string {
	if v.m.Config.Indexer == nil {
		return ""
	}
	return indexKName(v.IndexK())
}

// modelCheckEvery bounds how often the settings re-check the model's file
// (model.CheckFile): a stat and about 256 KiB read.
const modelCheckEvery = 5 * time.Second

// decodeInfo is this server as a PD peer checks it: the shapes and types
// its KV moves in.
func (v *View) decodeInfo() pdproto.DecodeInfo {
	c := &v.m.Config
	// KVDType is how the pools store K and V (Config.KVType): a prefill
	// and a decode that differ would move rows of the wrong size, so the
	// bootstrap compare refuses the pair by name.
	// Model names the weights by their fingerprint too: a pair serving
	// different weights (another seed, a file changed between the two
	// starts) is refused as a mismatch, not left to give other tokens.
	name := v.m.Name
	if fp := v.m.Fingerprint(); fp != "" {
		name += "@" + fp
	}
	// A rank's rows are its KV heads' share, or with latent attention
	// the one latent row every rank holds whole.
	kvHeads, headDim := c.KVHeads/v.cfg.TP, c.HeadDim
	if c.MLA != nil {
		kvHeads, headDim = 1, c.KVDim()
	}
	return pdproto.DecodeInfo{TPSize: v.cfg.TP, PageSize: v.cfg.PageSize, KVDType: kernels.KVName(v.cfg.KVType), IndexKDType: v.indexKName(),
		Model: name, Layers: c.Layers, KVHeads: kvHeads, HeadDim: headDim}
}
