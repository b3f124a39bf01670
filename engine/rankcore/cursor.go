package rankcore

import "fmt"

// Cursor follows one rank through a table: the executor enters each phase
// before its collective, and a phase the table does not allow there is an
// error before any rank waits on it. It is the table's order made binding:
// the executor cannot call a collective in another order without the
// cursor refusing it.
type Cursor struct {
	t  *Table
	at int // the control row entered last; -1 before the first
}

// NewCursor is a cursor before t's first row.
func NewCursor(t *Table) *Cursor { return &Cursor{t: t, at: -1} }

// Table is the cursor's table.
func (c *Cursor) Table() *Table { return c.t }

// At is the control row entered last, and false before the first.
func (c *Cursor) At() (Row, bool) {
	if c.at < 0 {
		return Row{}, false
	}
	return c.t.Rows[c.at], true
}

// Enter moves to phase p: to the first row of p after the current one, or,
// for the table's first phase, to a new iteration. Any other phase is out
// of the table's order.
//
// The forward pass runs on its own communicator, whose seqs are its own:
// entering it does not move the control rows' position (the overlap loop
// runs N+1's control rows beside N's forward pass), but it must come once
// the iteration's plan is agreed.
func (c *Cursor) Enter(p Phase) error {
	if p >= NumPhases {
		return fmt.Errorf("rankcore: %s table: unknown phase %d", c.t.Name, uint8(p))
	}
	if p.Comm() == Fwd {
		switch agree := c.t.index(Agree); {
		case c.t.index(p) < 0:
			return fmt.Errorf("rankcore: %s table has no %s row", c.t.Name, p)
		case c.at < agree:
			return fmt.Errorf("rankcore: %s table: %s before the plan is agreed (after %s)", c.t.Name, p, c.after())
		}
		return nil
	}
	for j := c.at + 1; j < len(c.t.Rows); j++ {
		if c.t.Rows[j].Phase == p {
			c.at = j
			return nil
		}
	}
	if p == c.t.Rows[0].Phase {
		c.at = 0
		return nil
	}
	return fmt.Errorf("rankcore: %s table: %s after %s is out of order (next: %s)", c.t.Name, p, c.after(), c.next())
}

// Runs says whether phase p's next row, the one Enter(p) would enter,
// runs on facts f: the row's condition, which reads agreed values only.
// A phase out of the table's order does not run.
func (c *Cursor) Runs(p Phase, f Facts) bool {
	j := c.find(p)
	return j >= 0 && c.t.Rows[j].If(f)
}

// find is the row Enter(p) would enter, -1 when none.
func (c *Cursor) find(p Phase) int {
	if p >= NumPhases {
		return -1
	}
	if p.Comm() == Fwd {
		return c.t.index(p)
	}
	for j := c.at + 1; j < len(c.t.Rows); j++ {
		if c.t.Rows[j].Phase == p {
			return j
		}
	}
	if p == c.t.Rows[0].Phase {
		return 0
	}
	return -1
}

// after names the row entered last.
func (c *Cursor) after() string {
	if c.at < 0 {
		return "the start"
	}
	return fmt.Sprintf("%s (row %d)", c.t.Rows[c.at].Phase, c.at+1)
}

// next lists the control phases the cursor would accept now.
func (c *Cursor) next() string {
	s := ""
	seen := map[Phase]bool{}
	for j := c.at + 1; j < len(c.t.Rows); j++ {
		if p := c.t.Rows[j].Phase; p.Comm() == Control && !seen[p] {
			seen[p] = true
			s += p.String() + ", "
		}
	}
	return s + c.t.Rows[0].Phase.String()
}

// index is the first row of p, -1 when none.
func (t *Table) index(p Phase) int {
	for i, r := range t.Rows {
		if r.Phase == p {
			return i
		}
	}
	return -1
}
