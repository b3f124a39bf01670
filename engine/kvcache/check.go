package kvcache

import "fmt"

// Check verifies the pool's accounting and returns the first broken
// invariant:
//
//   - the allocator's own accounting (PageAllocator.Check);
//   - every page a live sequence owns is allocated, and no sequence owns a
//     page twice;
//   - a sequence's first Shared() pages are held by the prefix cache and
//     lie within its committed tokens; each of its other pages is held by it
//     alone (not by another sequence, not by the cache), so only those are
//     ever written;
//   - every page's reference count is the number of live sequences holding
//     it plus one if the cache holds it, a page is allocated exactly when
//     that count is positive (no leaked page, no page free while held), and
//     the cached-page counter matches;
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
	if p.holders == nil {
		p.holders = make([]int32, p.cfg.Pages)
		p.rowSeen = make([]bool, p.cfg.MaxSeqs)
	}
	holders, rowSeen := p.holders, p.rowSeen
	clear(holders)
	clear(rowSeen)
	if len(p.refs) != p.total || len(p.cached) != p.total {
		return fmt.Errorf("kvcache: %d reference counts and %d cache flags for %d pages", len(p.refs), len(p.cached), p.total)
	}

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
	live := 0
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
		if s.shared < 0 || s.shared*ps > s.n {
			return fmt.Errorf("kvcache: seq %d shares %d pages of %d tokens but has %d committed", s.id, s.shared, ps, s.n)
		}
		for i, pg := range s.pages {
			switch {
			case !p.alloc.allocated(pg):
				return fmt.Errorf("kvcache: seq %d owns page %d, which is not allocated", s.id, pg)
			case i < s.shared && !p.cached[pg]:
				return fmt.Errorf("kvcache: seq %d shares page %d, which the cache does not hold", s.id, pg)
			case i >= s.shared && p.cached[pg]:
				return fmt.Errorf("kvcache: seq %d owns page %d, which the cache holds too", s.id, pg)
			case i >= s.shared && holders[pg] != 0:
				return fmt.Errorf("kvcache: page %d owned by seq %d and another sequence", pg, s.id)
			}
			holders[pg]++
		}
		for _, pg := range s.pages {
			if holders[pg] < 0 {
				return fmt.Errorf("kvcache: seq %d owns page %d twice", s.id, pg)
			}
			holders[pg] = -holders[pg] // mark: seen in this sequence
		}
		for _, pg := range s.pages {
			if holders[pg] < 0 {
				holders[pg] = -holders[pg]
			}
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
	cached, held := 0, 0
	for pg := range p.total {
		h := holders[pg]
		if p.cached[pg] {
			h++
			cached++
		}
		switch {
		case h != p.refs[pg]:
			return fmt.Errorf("kvcache: page %d has reference count %d, but %d holders (cached %v)", pg, p.refs[pg], h, p.cached[pg])
		case (h > 0) != p.alloc.allocated(int32(pg)):
			return fmt.Errorf("kvcache: page %d has %d holders but allocated is %v (leak)", pg, h, p.alloc.allocated(int32(pg)))
		}
		if h > 0 {
			held++
		}
	}
	if c := p.numCached.Load(); c != int64(cached) {
		return fmt.Errorf("kvcache: cached counter %d, %d pages cached", c, cached)
	}
	if used := p.alloc.UsedCount(); held != used {
		return fmt.Errorf("kvcache: %d pages allocated, %d held by live sequences or the cache (leak)", used, held)
	}
	return nil
}
