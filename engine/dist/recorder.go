package dist

import (
	"cmp"
	"slices"
	"time"
)

// Record is one call in a rank's flight recorder. Records are immutable once
// published.
type Record struct {
	Seq   uint64
	Op    Op
	Elem  Elem
	Tag   string // what the caller called it for (WithTag)
	Bytes int    // the rank's input bytes (the root's data for BroadcastBytes, 0 on other ranks)
	Start time.Time
	End   time.Time // zero while the call waits
	// Outcome is "" while the call waits, "ok" on success, else the error text.
	Outcome string
}

// Waiting reports whether the call had not ended when recorded.
func (r Record) Waiting() bool { return r.End.IsZero() }

// begin publishes the start of call seq.
func (c *Comm) begin(seq uint64, call Call, start time.Time) {
	n := max(call.Count, 0)
	rec := &Record{Seq: seq, Op: call.Op, Elem: call.Elem, Tag: call.Tag, Bytes: n * call.Elem.size(), Start: start}
	c.ring[(seq-1)%uint64(len(c.ring))].Store(rec)
	c.last.Store(rec)
	c.waiting.Store(rec)
}

// end publishes the end of the waiting call: a new Record replaces the old.
func (c *Comm) end(err error) {
	old := c.waiting.Load()
	rec := *old
	rec.End = c.g.clock()
	if err == nil {
		rec.Outcome = "ok"
	} else {
		rec.Outcome = err.Error()
	}
	c.ring[(rec.Seq-1)%uint64(len(c.ring))].Store(&rec)
	c.last.Store(&rec)
	if err == nil {
		c.completed.Store(rec.Seq)
	}
	c.waited.Add(int64(rec.End.Sub(rec.Start)))
	c.waiting.Store(nil)
}

// LastSeq is the sequence number of the last collective the rank entered (0
// before the first). Lock-free, for step records.
func (c *Comm) LastSeq() uint64 {
	if l := c.last.Load(); l != nil {
		return l.Seq
	}
	return 0
}

// WaitTotal is the time the rank has spent inside collectives, from entering
// one until it returned (waiting for peers plus the data movement).
// Lock-free, for metrics.
func (c *Comm) WaitTotal() time.Duration { return time.Duration(c.waited.Load()) }

// Records returns the rank's flight recorder, oldest first. It takes no lock
// and may be called from any goroutine, even while the rank is stuck.
func (c *Comm) Records() []Record {
	out := make([]Record, 0, len(c.ring))
	for i := range c.ring {
		if p := c.ring[i].Load(); p != nil {
			out = append(out, *p)
		}
	}
	slices.SortFunc(out, func(a, b Record) int { return cmp.Compare(a.Seq, b.Seq) })
	return out
}

// RankState is one rank in a Snapshot.
type RankState struct {
	Rank          int
	LastEntered   uint64   // the last seq the rank entered; 0 before its first call
	LastCompleted uint64   // the last seq that ended ok
	Waiting       *Record  // the call in progress; nil when not in a collective
	Records       []Record // the flight recorder, oldest first
}

// Snapshot is the whole group's state for a debug reader.
type Snapshot struct {
	Name   string // Options.Name
	Size   int
	Closed bool
	Broken string // why the group broke; "" while healthy
	Ranks  []RankState
}

// Snapshot copies every rank's state. It takes no lock that a collective
// holds, so it answers while ranks are wedged. Ranks keep running while it
// reads: each rank's state is a near-simultaneous view, not one instant.
func (g *Group) Snapshot() Snapshot {
	s := Snapshot{Name: g.name, Size: g.size, Closed: g.closedFlag.Load(), Ranks: make([]RankState, g.size)}
	if p := g.brokenMsg.Load(); p != nil {
		s.Broken = *p
	}
	for i, c := range g.comms {
		rs := RankState{Rank: i, LastCompleted: c.completed.Load()}
		if w := c.waiting.Load(); w != nil {
			rec := *w
			rs.Waiting = &rec
		}
		if l := c.last.Load(); l != nil {
			rs.LastEntered = l.Seq
		}
		rs.Records = c.Records()
		s.Ranks[i] = rs
	}
	return s
}
