package dist

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Stall is a collective that has waited longer than a threshold.
type Stall struct {
	Comm    string // the group's Options.Name
	Seq     uint64
	Op      Op
	Since   time.Time     // when the first rank entered the seq
	Waited  time.Duration // now - Since
	Arrived []int         // ranks waiting at Seq, ascending
	Missing []Peer        // the other ranks and where they are
}

// Peer is where a rank that has not arrived at a stalled seq is.
type Peer struct {
	Rank         int
	InCollective bool   // waiting in another collective (Seq, Op)
	Seq          uint64 // the call it is in, or its last entered call; 0: none yet
	Op           Op
}

func (p Peer) String() string {
	switch {
	case p.InCollective:
		return fmt.Sprintf("rank %d in seq %d %v", p.Rank, p.Seq, p.Op)
	case p.Seq == 0:
		return fmt.Sprintf("rank %d not in a collective (none entered yet)", p.Rank)
	}
	return fmt.Sprintf("rank %d not in a collective (last entered seq %d %v)", p.Rank, p.Seq, p.Op)
}

func (s Stall) String() string {
	var b strings.Builder
	if s.Comm != "" {
		fmt.Fprintf(&b, "%s ", s.Comm)
	}
	fmt.Fprintf(&b, "seq %d %v waiting %v: arrived %v; waiting for", s.Seq, s.Op, s.Waited, s.Arrived)
	for i, p := range s.Missing {
		if i > 0 {
			b.WriteByte(';')
		}
		b.WriteByte(' ')
		b.WriteString(p.String())
	}
	return b.String()
}

// Stuck returns the calls that have waited longer than threshold at now,
// one Stall per seq, by seq. Like Snapshot it takes no lock that a
// collective holds.
func (g *Group) Stuck(now time.Time, threshold time.Duration) []Stall {
	waiting := make([]*Record, g.size)
	last := make([]*Record, g.size)
	for i, c := range g.comms {
		waiting[i] = c.waiting.Load()
		last[i] = c.last.Load()
	}
	// A rank still shown waiting at a seq below one a peer has entered is
	// only finishing: that round has settled.
	var entered uint64
	for _, l := range last {
		if l != nil {
			entered = max(entered, l.Seq)
		}
	}
	var out []Stall
	for _, w := range waiting {
		if w == nil || w.Seq < entered || now.Sub(w.Start) <= threshold {
			continue
		}
		if slices.ContainsFunc(out, func(s Stall) bool { return s.Seq == w.Seq }) {
			continue
		}
		s := Stall{Comm: g.name, Seq: w.Seq, Op: w.Op, Since: w.Start}
		for r := range g.size {
			switch o := waiting[r]; {
			case o != nil && o.Seq == w.Seq:
				s.Arrived = append(s.Arrived, r)
				if o.Start.Before(s.Since) {
					s.Since = o.Start
				}
			case o != nil:
				s.Missing = append(s.Missing, Peer{Rank: r, InCollective: true, Seq: o.Seq, Op: o.Op})
			case last[r] != nil:
				s.Missing = append(s.Missing, Peer{Rank: r, Seq: last[r].Seq, Op: last[r].Op})
			default:
				s.Missing = append(s.Missing, Peer{Rank: r})
			}
		}
		s.Waited = now.Sub(s.Since)
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Stall) int { return cmp.Compare(a.Seq, b.Seq) })
	return out
}

// watch is the watchdog goroutine: every threshold/2 it reports each newly
// stalled seq once.
func (g *Group) watch(threshold time.Duration, onStall func(Stall)) {
	defer g.wg.Done()
	t := time.NewTicker(max(threshold/2, 1))
	defer t.Stop()
	var reported uint64 // the highest seq reported
	for {
		select {
		case <-g.stop:
			return
		case <-t.C:
			for _, s := range g.Stuck(g.clock(), threshold) {
				if s.Seq > reported {
					reported = s.Seq
					onStall(s)
				}
			}
		}
	}
}
