package kvcache

import "fmt"

// Check verifies the pool's accounting and returns the first broken
// invariant:
//
//   - the allocator's own accounting (PageAllocator.Check);
//   - every page a live sequence owns is allocated, and no page is owned
//     twice (by two sequences, or twice by one);
//   - the pages owned by live sequences are exactly the allocated pages (no
//     leaked page);
//   - each live sequence holds exactly the pages its Len+Reserved tokens
//     need, and its row's slots 0..Len+Reserved-1 are those of its pages;
//   - the request-to-token rows are each either free (once) or held by the
//     one live sequence that records that row, and Live matches.
//
// It costs O(Pages + MaxSeqs + live tokens) and is meant for tests and
// invariants builds, which run it after every mutating call.
func (p *Pool) Check() error {
	if err := p.alloc.Check(); err != nil {
		return err
	}
	if p.owner == nil {
		p.owner = make([]int32, p.cfg.Pages)
		p.rowSeen = make([]bool, p.cfg.MaxSeqs)
	}
	owner, rowSeen := p.owner, p.rowSeen
	clear(owner)
	clear(rowSeen)

	for _, r := range p.freeRows {
		switch {
		case r < 0 || int(r) >= len(p.rows):
			return fmt.Errorf("kvcache: free row %d out of range (%d rows)", r, len(p.rows))
		case rowSeen[r]:
			return fmt.Errorf("kvcache: row %d is free twice", r)
		case p.rows[r] != nil:
			return fmt.Errorf("kvcache: row %d is free but held by seq %d", r, p.rows[r].id)
		}
		rowSeen[r] = true
	}

	ps, mc := p.cfg.PageSize, p.cfg.MaxContext
	live, owned := 0, 0
	for r, s := range p.rows {
		if s == nil {
			if !rowSeen[r] {
				return fmt.Errorf("kvcache: row %d is neither free nor held (leaked)", r)
			}
			continue
		}
		live++
		switch {
		case s.pool != p:
			return fmt.Errorf("kvcache: row %d holds seq %d of another pool", r, s.id)
		case s.released:
			return fmt.Errorf("kvcache: row %d holds released seq %d", r, s.id)
		case s.row != r:
			return fmt.Errorf("kvcache: row %d holds seq %d, which records row %d", r, s.id, s.row)
		case p.byID[s.id] != s:
			return fmt.Errorf("kvcache: seq %d on row %d is not the live seq of that id", s.id, r)
		case s.n < 0 || s.reserved < 0 || s.n+s.reserved > mc:
			return fmt.Errorf("kvcache: seq %d: %d committed + %d reserved tokens, max context %d", s.id, s.n, s.reserved, mc)
		}
		foot := s.n + s.reserved
		if want := p.cfg.PagesFor(foot); len(s.pages) != want {
			return fmt.Errorf("kvcache: seq %d holds %d pages for %d tokens, needs %d", s.id, len(s.pages), foot, want)
		}
		for _, pg := range s.pages {
			switch {
			case !p.alloc.allocated(pg):
				return fmt.Errorf("kvcache: seq %d owns page %d, which is not allocated", s.id, pg)
			case owner[pg] != 0:
				return fmt.Errorf("kvcache: page %d owned by seq %d and seq %d", pg, p.rows[owner[pg]-1].id, s.id)
			}
			owner[pg] = int32(r) + 1
			owned++
		}
		row := p.table[r*mc : r*mc+foot]
		for pos, slot := range row {
			if want := s.pages[pos/ps]*int32(ps) + int32(pos%ps); slot != want {
				return fmt.Errorf("kvcache: seq %d position %d maps to slot %d, its page %d gives %d",
					s.id, pos, slot, s.pages[pos/ps], want)
			}
		}
	}
	if live != len(p.byID) {
		return fmt.Errorf("kvcache: %d rows held, %d live sequence ids", live, len(p.byID))
	}
	if l := p.live.Load(); l != int64(live) {
		return fmt.Errorf("kvcache: live counter %d, %d live sequences", l, live)
	}
	if used := p.alloc.UsedCount(); owned != used {
		return fmt.Errorf("kvcache: %d pages allocated, %d owned by live sequences (leak)", used, owned)
	}
	return nil
}
