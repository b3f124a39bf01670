package serve

import (
	"slices"
	"sync"
	"time"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/rankcore"
)

// # The decision log
//
// Each rank keeps the last Config.DecisionLogLen iterations' decisions: per
// step the input it applied (a digest of the step input broadcast), every
// value it agreed on over the control communicator (what was reduced or
// broadcast, at which seq), the plan digest, the batch and the seqs the
// iteration ended at on both communicators. Ranks in lock-step log the same
// records, rank and end time apart; after the fact the first step whose
// records differ is where the ranks parted, and each record says what its
// rank saw (api/debug.FirstDivergence finds it).
//
// The rank's agreer (agree.go) notes each agreement as it happens into
// the iteration's open record and appends the record to a ring when the
// loop publishes its step. Both take the log's mutex, which a
// reader holds only to copy the ring: no allocation and no wait on a
// reader beyond that copy, and a reader answers while the loop is stuck,
// the stuck iteration's open record included.

// DefaultDecisionLogLen is Config.DecisionLogLen's default.
const DefaultDecisionLogLen = 256

// The names of the agreements an iteration makes on the control
// communicator: its phases' names, in the order of the lock-step table
// (engine/rankcore, which TestAgreeNamesArePhases holds them to).
const (
	AgreeInput   = "input"   // the step input broadcast
	AgreePoll    = "poll"    // the PD rooms' votes, MIN
	AgreeAdmit   = "admit"   // the prefix-cache matches of the requests joining, MIN
	AgreeRoom    = "room"    // free pages and free sequence rows, MIN
	AgreePDFork  = "pd_fork" // free pages and rows for a decode arrival's samples, MIN
	AgreePlan    = "agree"   // the plan digest and its negation, MAX
	AgreeResults = "results" // the step output broadcast (tokens, cuts)
	AgreeFork    = "fork"    // free pages and rows for the samples of a first token, MIN
)

// maxAgreements bounds the agreements of one iteration: each of the above
// at most once.
const maxAgreements = 8

// DecisionRecord is one rank's decisions in one iteration. Ranks in
// lock-step have equal records, Rank and End apart.
type DecisionRecord struct {
	Rank  int
	Step  uint64
	Input InputDigest
	// Agreed are the values the iteration agreed on over the control
	// communicator, in order; the first is the input broadcast.
	Agreed []Agreement
	// Plan is the plan digest agreed (StepRecord.Digest); 0 when the
	// iteration scheduled nothing.
	Plan        uint64
	Phase       string
	BatchSize   int
	BatchTokens int
	// ControlSeq and ForwardSeq are the rank's last seqs on each
	// communicator when the iteration ended; the forward pass's
	// collectives ran at ForwardFirst..ForwardSeq (none when ForwardFirst
	// is greater).
	ControlSeq, ForwardFirst, ForwardSeq uint64
	End                                  time.Time // zero while open
}

// InputDigest describes the step input a rank applied.
type InputDigest struct {
	Now           time.Duration // the agreed clock
	Adds, Aborts  int
	IDs           uint64 // FNV-1a of the adds' ids, then the aborts'
	HiCache       string // a host-tier switch: "on", "off", or ""
	IndexK        string // an index-K precision switched to, or ""
	OffloadTokens int    // an offload's prompt tokens; 0 when none
	Digest        uint64 // FNV-1a of the whole input as broadcast
}

// Agreement is one value an iteration agreed on.
type Agreement struct {
	Name   string  // AgreeInput, AgreePoll, ...
	Op     dist.Op // the collective
	Seq    uint64  // its seq on the control communicator
	Len    int     // elements reduced, or bytes broadcast
	Digest uint64  // FNV-1a of the agreed values (or bytes)
	// Values are the agreed values when there are at most two (room,
	// fork: free pages and rows; agree: the digest and its negation).
	Values []int64
}

// RankDecisions is one rank's decision log as read.
type RankDecisions struct {
	Rank int
	// Records are the finished iterations, oldest first.
	Records []DecisionRecord
	// Open is the iteration in progress: its step and what it agreed so
	// far. Nil between iterations; a rank that entered the next step's
	// input broadcast has an open record with no agreements.
	Open *DecisionRecord
	// Waiting is the collective the rank waits in, nil when none.
	Waiting *DecisionWait
	// LastStep is the step of the rank's last finished iteration (also
	// when Records omits it).
	LastStep uint64
}

// DecisionWait is a collective a rank waits in.
type DecisionWait struct {
	Comm  string // CommControl or CommForward
	Seq   uint64
	Op    dist.Op
	Since time.Time
}

// agreement is an Agreement without allocation.
type agreement struct {
	name   string
	op     dist.Op
	seq    uint64
	n      int
	digest uint64
	vals   [2]int64
	nv     uint8
}

// decision is a DecisionRecord without allocation.
type decision struct {
	step               uint64
	in                 InputDigest
	ags                [maxAgreements]agreement
	na                 int
	plan               uint64
	phase              string
	batch, tokens      int
	cseq, ffirst, fseq uint64
	end                time.Time
}

// decisionLog is a rank's ring of decisions and its open record.
type decisionLog struct {
	mu    sync.Mutex
	ring  []decision
	n     uint64 // records appended
	cur   decision
	open  bool
	last  uint64 // the step of the last appended record
	lastC uint64 // and its control seq
}

func newDecisionLog(n int) *decisionLog { return &decisionLog{ring: make([]decision, max(1, n))} }

// FNV-1a, 64 bits, without a hash.Hash (no allocation on the loop).
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func fnvByte(h uint64, b []byte) uint64 {
	for _, c := range b {
		h = (h ^ uint64(c)) * fnvPrime
	}
	return h
}

func fnvU64(h, v uint64) uint64 {
	for range 8 {
		h = (h ^ (v & 0xff)) * fnvPrime
		v >>= 8
	}
	return h
}

// openInput opens step's record with its input, which the control
// communicator broadcast at seq; the forward pass's collectives of the
// step start after fseq. buf is the caller's scratch for the input's
// encoding, returned for reuse.
func (log *decisionLog) openInput(step uint64, in stepInput, seq, fseq uint64, buf []byte) []byte {
	d := InputDigest{Now: in.now, Adds: len(in.adds), Aborts: len(in.aborts), IDs: fnvOffset, OffloadTokens: len(in.offload)}
	for _, a := range in.adds {
		d.IDs = fnvU64(d.IDs, a.id)
	}
	for _, a := range in.aborts {
		d.IDs = fnvU64(d.IDs, a.id)
	}
	if in.tier != nil {
		d.HiCache = "on"
		if in.tier.off {
			d.HiCache = "off"
		}
	}
	if in.switchIndexK {
		d.IndexK = in.indexK.String()
	}
	buf = in.encode(buf[:0])
	d.Digest = fnvByte(fnvOffset, buf)
	ag := agreement{name: AgreeInput, op: dist.OpBroadcast, seq: seq, n: len(buf), digest: d.Digest}
	log.mu.Lock()
	log.cur = decision{step: step, in: d, ffirst: fseq + 1}
	log.cur.ags[0], log.cur.na = ag, 1
	log.open = true
	log.mu.Unlock()
	return buf
}

// agreed adds phase p's agreed vector, reduced at control seq, to the
// open record.
func (log *decisionLog) agreed(p rankcore.Phase, seq uint64, vals []int64) {
	ag := agreement{name: p.String(), op: p.Op(), seq: seq, n: len(vals), digest: fnvOffset}
	for _, v := range vals {
		ag.digest = fnvU64(ag.digest, uint64(v))
	}
	if len(vals) <= len(ag.vals) {
		ag.nv = uint8(copy(ag.vals[:], vals))
	}
	log.add(ag)
}

// agreedBytes adds phase p's agreed broadcast, at control seq, to the open
// record.
func (log *decisionLog) agreedBytes(p rankcore.Phase, seq uint64, b []byte) {
	log.add(agreement{name: p.String(), op: p.Op(), seq: seq, n: len(b), digest: fnvByte(fnvOffset, b)})
}

func (log *decisionLog) add(ag agreement) {
	log.mu.Lock()
	c := &log.cur
	if c.na < len(c.ags) {
		c.ags[c.na] = ag
		c.na++
	}
	log.mu.Unlock()
}

// close closes the iteration's record with what rec published and
// appends it to the ring.
func (log *decisionLog) close(rec StepRecord) {
	log.mu.Lock()
	c := &log.cur
	if !log.open { // an iteration without an input: none today
		*c = decision{step: rec.Step}
	}
	c.plan, c.phase, c.batch, c.tokens = rec.Digest, rec.Phase, rec.BatchSize, rec.BatchTokens
	c.cseq, c.fseq, c.end = rec.ControlSeq, rec.ForwardSeq, rec.End
	log.ring[log.n%uint64(len(log.ring))] = *c
	log.n++
	log.open = false
	log.last, log.lastC = c.step, c.cseq
	log.mu.Unlock()
}

// read copies the records of steps after since, oldest first, and the open
// record; the copy is all it does under the lock.
func (log *decisionLog) read(since uint64) (recs []decision, open *decision, last, lastC uint64) {
	log.mu.Lock()
	defer log.mu.Unlock()
	k := uint64(len(log.ring))
	first := uint64(0)
	if log.n > k {
		first = log.n - k
	}
	for i := first; i < log.n; i++ {
		if d := &log.ring[i%k]; d.step > since {
			recs = append(recs, *d)
		}
	}
	if log.open {
		o := log.cur
		open = &o
	}
	return recs, open, log.last, log.lastC
}

func (d *decision) record(rank int) DecisionRecord {
	r := DecisionRecord{Rank: rank, Step: d.step, Input: d.in, Agreed: make([]Agreement, d.na), Plan: d.plan, Phase: d.phase,
		BatchSize: d.batch, BatchTokens: d.tokens, ControlSeq: d.cseq, ForwardFirst: d.ffirst, ForwardSeq: d.fseq, End: d.end}
	for i, a := range d.ags[:d.na] {
		r.Agreed[i] = Agreement{Name: a.name, Op: a.op, Seq: a.seq, Len: a.n, Digest: a.digest}
		if a.nv > 0 {
			r.Agreed[i].Values = slices.Clone(a.vals[:a.nv])
		}
	}
	return r
}
