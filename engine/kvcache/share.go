package kvcache

import "fmt"

// Sharing pages with a prefix cache.
//
// Besides sequences, a page may be held by the prefix cache (one per pool,
// see engine/prefix). A page's reference count is the number of live
// sequences holding it plus one when the cache holds it; the page returns to
// the free list when the count drops to zero. Pages move into the cache only
// through ReleaseTo (a finished sequence's full pages, exactly once) and
// leave it only through FreeCached (eviction, or a duplicate the cache does
// not keep). A sequence shares cached pages by starting from them with
// NewSeqWithPrefix; those pages are read-only: neither the sequence nor anyone
// else writes a page that has more than one holder or that the cache holds.
//
// The index keys of the sparse indexer live in the same slots as K and V, so
// sharing a page shares its index keys too.

// NewSeqWithPrefix starts a sequence whose first tokens positions are already
// written: they lie on pages, which the prefix cache holds, in position
// order, and tokens must be len(pages)*PageSize. The sequence reads those
// pages without copying and never writes them; Len starts at tokens and new
// tokens go to pages of its own. It fails, changing nothing, with
// ErrBadPrefix (tokens not the pages' worth), ErrContextFull, ErrBadPage,
// ErrNotCached (a page the cache does not hold), ErrDoubleFree (a page listed
// twice), ErrDuplicateSeq or ErrNoRow.
func (p *Pool) NewSeqWithPrefix(id uint64, pages []int32, tokens int) (*Seq, error) {
	s, err := p.newSeqWithPrefix(id, pages, tokens)
	p.selfCheck()
	return s, err
}

func (p *Pool) newSeqWithPrefix(id uint64, pages []int32, tokens int) (*Seq, error) {
	ps := p.cfg.PageSize
	if tokens < 0 || tokens%ps != 0 || tokens/ps != len(pages) {
		return nil, fmt.Errorf("%w: seq %d: %d tokens on %d pages of %d", ErrBadPrefix, id, tokens, len(pages), ps)
	}
	if tokens > p.cfg.MaxContext {
		return nil, fmt.Errorf("%w: seq %d: prefix of %d tokens > max context %d", ErrContextFull, id, tokens, p.cfg.MaxContext)
	}
	if err := p.checkPages(pages, false); err != nil {
		return nil, fmt.Errorf("seq %d: prefix: %w", id, err)
	}
	s, err := p.newSeq(id)
	if err != nil {
		return nil, err
	}
	s.pages = append(make([]int32, 0, len(pages)), pages...)
	s.shared = len(pages)
	s.n = tokens
	for _, pg := range pages {
		p.refs[pg]++
	}
	row := p.row(s)
	for pos := range tokens {
		row[pos] = pages[pos/ps]*int32(ps) + int32(pos%ps)
	}
	return s, nil
}

// checkPages validates a list of pages the cache should hold: each in range,
// held by the cache, listed once and, when unused is set, held by no
// sequence.
func (p *Pool) checkPages(pages []int32, unused bool) error {
	if p.mark == nil {
		p.mark = make([]bool, p.total)
	}
	defer func() {
		for _, pg := range pages {
			if pg >= 0 && int(pg) < p.total {
				p.mark[pg] = false
			}
		}
	}()
	for _, pg := range pages {
		switch {
		case pg < 0 || int(pg) >= p.total:
			return fmt.Errorf("%w: page %d of %d", ErrBadPage, pg, p.total)
		case !p.cached[pg]:
			return fmt.Errorf("%w: page %d", ErrNotCached, pg)
		case p.mark[pg]:
			return fmt.Errorf("%w: page %d listed twice", ErrDoubleFree, pg)
		case unused && p.refs[pg] != 1:
			return fmt.Errorf("%w: page %d is still held by %d sequences", ErrSharedPage, pg, p.refs[pg]-1)
		}
		p.mark[pg] = true
	}
	return nil
}

// ReleaseTo releases s like Release, except that its full pages (the first
// Len()/PageSize, whose KV is all written) move to the prefix cache instead
// of the free list, and keep is then called with them, in position order,
// to index them (prefix.Cache.Insert). Pages s shared with the cache stay
// with it; the rest of s's pages (a partly written last page, reserved room)
// are freed. From then on the cache holds every page in full exactly once,
// and it must either keep each one or give it back with FreeCached. A nil
// keep makes ReleaseTo a plain Release.
func (p *Pool) ReleaseTo(s *Seq, keep func(full []int32)) error {
	if keep == nil {
		return p.Release(s)
	}
	full, err := p.releaseTo(s)
	p.selfCheck()
	if err != nil {
		return err
	}
	keep(full)
	return nil
}

func (p *Pool) releaseTo(s *Seq) ([]int32, error) {
	if err := p.own(s); err != nil {
		return nil, err
	}
	nf := s.n / p.cfg.PageSize
	full := append([]int32(nil), s.pages[:nf]...)
	// Free the tail first: it fails (on a corrupt pool) before anything moved.
	if err := p.unref(s.pages[nf:]); err != nil {
		return nil, fmt.Errorf("seq %d: release: %w", s.id, err)
	}
	for _, pg := range full {
		if p.cached[pg] {
			p.refs[pg]-- // the cache keeps it; s lets go
			continue
		}
		p.cached[pg] = true // s's reference becomes the cache's
		p.numCached.Add(1)
	}
	s.pages = s.pages[:0]
	if err := p.releaseSeq(s); err != nil {
		return nil, err
	}
	return full, nil
}

// FreeCached gives pages held by the prefix cache back: the cache evicted
// them or does not keep them. Each page must be held by the cache, listed
// once, and used by no live sequence (ErrNotCached, ErrDoubleFree,
// ErrSharedPage, ErrBadPage); on error nothing is freed.
func (p *Pool) FreeCached(pages []int32) error {
	err := p.freeCached(pages)
	p.selfCheck()
	return err
}

func (p *Pool) freeCached(pages []int32) error {
	if err := p.checkPages(pages, true); err != nil {
		return fmt.Errorf("free cached pages: %w", err)
	}
	if err := p.unref(pages); err != nil {
		return fmt.Errorf("free cached pages: %w", err)
	}
	for _, pg := range pages {
		p.cached[pg] = false
	}
	p.numCached.Add(-int64(len(pages)))
	return nil
}

// AllocCached allocates n free pages straight into the prefix cache's hands
// (each held by the cache alone, as if a finished sequence had handed it
// over): the cache fills them itself, e.g. by loading a prefix back from a
// host tier, and indexes or frees them like any cached page. It fails,
// allocating nothing, with ErrOutOfPages.
func (p *Pool) AllocCached(n int) ([]int32, error) {
	if n < 0 {
		return nil, fmt.Errorf("kvcache: alloc of %d cached pages", n)
	}
	pages, err := p.alloc.alloc(n)
	if err != nil {
		p.selfCheck()
		return nil, fmt.Errorf("alloc %d cached pages: %w", n, err)
	}
	for _, pg := range pages {
		p.refs[pg] = 1
		p.cached[pg] = true
	}
	p.numCached.Add(int64(len(pages)))
	p.selfCheck()
	return pages, nil
}
