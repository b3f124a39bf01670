package rankcore

import (
	"fmt"
	"slices"

	"github.com/pdkit/pdkit/engine/dist"
)

// Entry is one collective in a rank's log of its control communicator:
// the flight recorder's seq, operation and tag.
type Entry struct {
	Seq uint64
	Op  dist.Op
	Tag string // the phase's name
}

// CheckLog holds the control communicator's log of every rank (rank
// order; each oldest first, as a flight recorder keeps the last calls)
// against table t. It reports, first, the lowest seq at which two ranks
// were in different phases or operations (the ranks parted there: it
// names the phase of each); then, rank by rank, a call whose operation is
// not its phase's, a gap in the seqs, or a phase out of the table's order.
// A log may begin anywhere in an iteration: its first phase is taken at
// its first row in the table.
func CheckLog(t *Table, logs [][]Entry) error {
	if err := checkAgree(logs); err != nil {
		return err
	}
	for r, log := range logs {
		if err := checkRank(t, r, log); err != nil {
			return err
		}
	}
	return nil
}

// checkAgree finds the lowest seq at which ranks' entries differ.
func checkAgree(logs [][]Entry) error {
	type at struct {
		rank int
		e    Entry
	}
	first := map[uint64]at{}
	var bad []uint64
	diff := map[uint64][2]at{}
	for r, log := range logs {
		for _, e := range log {
			f, ok := first[e.Seq]
			switch {
			case !ok:
				first[e.Seq] = at{r, e}
			case f.e.Tag != e.Tag || f.e.Op != e.Op:
				if _, seen := diff[e.Seq]; !seen {
					bad = append(bad, e.Seq)
					diff[e.Seq] = [2]at{f, {r, e}}
				}
			}
		}
	}
	if len(bad) == 0 {
		return nil
	}
	s := slices.Min(bad)
	d := diff[s]
	return fmt.Errorf("rankcore: the ranks parted at control seq %d: rank %d in %s (%v), rank %d in %s (%v)",
		s, d[0].rank, tagName(d[0].e.Tag), d[0].e.Op, d[1].rank, tagName(d[1].e.Tag), d[1].e.Op)
}

func tagName(tag string) string {
	if tag == "" {
		return "an untagged call"
	}
	return tag
}

// checkRank walks one rank's log through the table.
func checkRank(t *Table, r int, log []Entry) error {
	var c *Cursor
	for i, e := range log {
		p, err := ParsePhase(e.Tag)
		if err != nil || p.Comm() != Control {
			return fmt.Errorf("rankcore: rank %d, control seq %d: %v call tagged %q, which is no control phase", r, e.Seq, e.Op, e.Tag)
		}
		if e.Op != p.Op() {
			return fmt.Errorf("rankcore: rank %d, control seq %d: %s ran %v, the %s table says %v", r, e.Seq, p, e.Op, t.Name, p.Op())
		}
		if i > 0 && e.Seq != log[i-1].Seq+1 {
			return fmt.Errorf("rankcore: rank %d: control seq jumps from %d to %d", r, log[i-1].Seq, e.Seq)
		}
		if c == nil {
			c = NewCursor(t)
			c.at = t.index(p)
			continue
		}
		if err := c.Enter(p); err != nil {
			return fmt.Errorf("rank %d, control seq %d: %w", r, e.Seq, err)
		}
	}
	return nil
}
