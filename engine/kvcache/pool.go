package kvcache

import (
	"fmt"
	"sync/atomic"

	"github.com/pdkit/pdkit/kernels"
)

// Pool is one rank's KV memory: per-layer K and V arrays of Pages*PageSize
// slots × KVDim elements of the Config's KVType (float32, or the 16-bit
// codes of BF16 or F16), per-layer index-K buffers, a page allocator and the
// request-to-token table (MaxSeqs rows × MaxContext slots).
//
// A Pool belongs to its rank's loop and is not safe for concurrent use.
// FreePages, TotalPages and Live are the exceptions: they read atomics (or
// immutable fields) so that a debug reader may call them from any goroutine,
// even while the loop is stuck.
type Pool struct {
	cfg   Config
	k, v  [][]float32 // [layer][slot*KVDim] of an F32 pool
	k16   [][]uint16  // [layer][slot*KVDim] of a BF16 or F16 pool
	v16   [][]uint16
	idx   []*kernels.IndexKeys // [layer]; nil without an indexer
	alloc *PageAllocator
	bytes int64
	total int // pages; immutable

	table    []int32         // [row*MaxContext+pos] = slot, -1 when unused
	rows     []*Seq          // [row]; nil when the row is free
	freeRows []int32         // stack; top is the end
	byID     map[uint64]*Seq // live sequences
	live     atomic.Int64    // len(byID), for readers off the loop

	// Page sharing. refs[page] counts the page's holders: the live
	// sequences that hold it plus one when the prefix cache holds it
	// (cached[page]). A page is allocated exactly when refs > 0. Only a page
	// held by one sequence and not by the cache may be written.
	refs      []int32
	cached    []bool
	numCached atomic.Int64 // pages with cached set

	holders []int32 // Check's scratch: page -> holders counted
	rowSeen []bool  // Check's scratch
	mark    []bool  // scratch for validating page lists
}

// Seq is one request's KV footprint: its pages, its row in the
// request-to-token table, how many tokens hold KV (Len) and how many more are
// reserved beyond them. Its methods are for the pool's loop only.
//
// A sequence started by NewSeqWithPrefix begins with Shared() pages that the
// prefix cache holds: full pages of committed KV, read by the sequence and
// never written (other sequences may read them too). Every later page is the
// sequence's alone.
type Seq struct {
	pool     *Pool
	id       uint64
	row      int
	pages    []int32
	shared   int // pages[:shared] are cache-held and read-only
	n        int // committed tokens
	reserved int // reserved tokens beyond n
	released bool
}

// ID is the id the sequence was created with.
func (s *Seq) ID() uint64 { return s.id }

// Len is the number of tokens whose KV is written (committed).
func (s *Seq) Len() int { return s.n }

// Reserved is the number of tokens reserved beyond Len and not yet committed.
func (s *Seq) Reserved() int { return s.reserved }

// Released reports whether Release has been called.
func (s *Seq) Released() bool { return s.released }

// Row is the sequence's row in the request-to-token table.
func (s *Seq) Row() int { return s.row }

// Slots returns the slots of positions 0..Len()+Reserved()-1: a read-only
// view of the sequence's request-to-token row, valid until the next Reserve,
// Truncate or Release of this sequence. Nil once released.
func (s *Seq) Slots() []int32 {
	if s.released {
		return nil
	}
	mc := s.pool.cfg.MaxContext
	foot := s.n + s.reserved
	base := s.row * mc
	return s.pool.table[base : base+foot : base+foot]
}

// Pages returns a copy of the sequence's pages, in position order.
func (s *Seq) Pages() []int32 { return append([]int32(nil), s.pages...) }

// Shared is the number of leading pages the sequence shares with the prefix
// cache (read-only); 0 for a sequence started by NewSeq.
func (s *Seq) Shared() int { return s.shared }

// NewPool validates cfg and allocates the pool's memory.
func NewPool(cfg Config) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.IndexK != nil {
		ik := *cfg.IndexK
		cfg.IndexK = &ik // the caller may reuse theirs
	}
	bytes, err := cfg.bytes()
	if err != nil {
		return nil, err
	}
	slots := cfg.Slots()
	p := &Pool{
		cfg:      cfg,
		alloc:    NewPageAllocator(cfg.Pages),
		bytes:    bytes,
		total:    cfg.Pages,
		table:    make([]int32, cfg.MaxSeqs*cfg.MaxContext),
		rows:     make([]*Seq, cfg.MaxSeqs),
		freeRows: make([]int32, cfg.MaxSeqs),
		byID:     make(map[uint64]*Seq),
		refs:     make([]int32, cfg.Pages),
		cached:   make([]bool, cfg.Pages),
	}
	if cfg.KVType == kernels.F32 {
		p.k, p.v = make([][]float32, cfg.Layers), make([][]float32, cfg.Layers)
		for l := range cfg.Layers {
			p.k[l] = make([]float32, slots*cfg.KVDim)
			p.v[l] = make([]float32, slots*cfg.VDim())
		}
	} else {
		p.k16, p.v16 = make([][]uint16, cfg.Layers), make([][]uint16, cfg.Layers)
		for l := range cfg.Layers {
			p.k16[l] = make([]uint16, slots*cfg.KVDim)
			p.v16[l] = make([]uint16, slots*cfg.VDim())
		}
	}
	if ic := cfg.IndexK; ic != nil {
		p.idx = newIndexKeys(cfg.Layers, slots, *ic)
	}
	for i := range p.table {
		p.table[i] = -1
	}
	for i := range p.freeRows {
		p.freeRows[i] = int32(cfg.MaxSeqs - 1 - i) // row 0 first
	}
	return p, nil
}

// newIndexKeys allocates layers index-K buffers of slots slots.
func newIndexKeys(layers, slots int, ic IndexKConfig) []*kernels.IndexKeys {
	idx := make([]*kernels.IndexKeys, layers)
	for l := range idx {
		ik := &kernels.IndexKeys{DType: ic.DType, Dim: ic.Dim}
		switch ic.DType {
		case kernels.IndexFP8:
			ik.FP8 = make([]uint8, slots*ic.Dim)
			ik.Scales = make([]float32, slots)
		case kernels.IndexBF16:
			ik.BF16 = make([]uint16, slots*ic.Dim)
		}
		idx[l] = ik
	}
	return idx
}

// SetIndexK reallocates the index-K buffers in precision dt (a live
// precision switch). The pool must be empty: no live sequence and no cached
// page, since every index key written so far is in the old precision. The
// old buffers go.
func (p *Pool) SetIndexK(dt kernels.IndexKDType) error {
	switch {
	case p.idx == nil:
		return fmt.Errorf("kvcache: set index-K %v: the pool has no indexer", dt)
	case dt != kernels.IndexFP8 && dt != kernels.IndexBF16:
		return fmt.Errorf("kvcache: set index-K: unknown precision %v", dt)
	case p.Live() != 0 || p.CachedPages() != 0 || p.alloc.FreeCount() != p.total:
		return fmt.Errorf("kvcache: set index-K %v: %d live sequences, %d cached pages, %d of %d pages free: the pool is not empty",
			dt, p.Live(), p.CachedPages(), p.alloc.FreeCount(), p.total)
	}
	ic := *p.cfg.IndexK
	ic.DType = dt
	p.idx = nil // the old buffers can go before the new ones are made
	p.idx = newIndexKeys(p.cfg.Layers, p.cfg.Slots(), ic)
	p.cfg.IndexK = &ic
	if b, err := p.cfg.bytes(); err == nil {
		p.bytes = b
	}
	p.selfCheck()
	return nil
}

// Config returns the pool's configuration.
func (p *Pool) Config() Config {
	c := p.cfg
	if c.IndexK != nil {
		ik := *c.IndexK
		c.IndexK = &ik
	}
	return c
}

// KVType is the element type the pool stores K and V in.
func (p *Pool) KVType() kernels.DType { return p.cfg.KVType }

// K is layer's key array, [slot*KVDim], of an F32 pool; nil for a 16-bit
// pool (see K16).
func (p *Pool) K(layer int) []float32 {
	if p.k == nil {
		return nil
	}
	return p.k[layer]
}

// V is layer's value array, [slot*KVDim], of an F32 pool; nil for a 16-bit
// pool (see V16).
func (p *Pool) V(layer int) []float32 {
	if p.v == nil {
		return nil
	}
	return p.v[layer]
}

// K16 is layer's key array, [slot*KVDim] codes of KVType, of a BF16 or F16
// pool; nil for an F32 pool.
func (p *Pool) K16(layer int) []uint16 {
	if p.k16 == nil {
		return nil
	}
	return p.k16[layer]
}

// V16 is layer's value array as K16 is its key array.
func (p *Pool) V16(layer int) []uint16 {
	if p.v16 == nil {
		return nil
	}
	return p.v16[layer]
}

// AttentionKV points a at layer's K and V arrays, whatever their type: K
// and V for an F32 pool, K16 and V16 for a 16-bit one, and KVType. A latent
// pool's rows are its keys and its values both.
func (p *Pool) AttentionKV(layer int, a *kernels.AttentionArgs) {
	a.KVType = p.cfg.KVType
	a.K, a.V, a.K16, a.V16 = p.K(layer), p.V(layer), p.K16(layer), p.V16(layer)
	if p.cfg.Latent {
		a.V, a.V16 = a.K, a.K16
	}
}

// ReadKV widens the K and V rows stored at slot of layer into k and v
// (KVDim and VDim each; v is empty for a latent pool): exactly what
// attention reads.
func (p *Pool) ReadKV(layer int, slot int32, k, v []float32) {
	d, vd := p.cfg.KVDim, p.cfg.VDim()
	if len(k) != d || len(v) != vd {
		panic(fmt.Sprintf("kvcache: ReadKV: K row of %d and V row of %d, want %d and %d", len(k), len(v), d, vd))
	}
	off, voff := int(slot)*d, int(slot)*vd
	if p.k != nil {
		copy(k, p.k[layer][off:off+d])
		copy(v, p.v[layer][voff:voff+vd])
		return
	}
	kernels.DecodeKV(k, p.k16[layer][off:off+d], p.cfg.KVType)
	kernels.DecodeKV(v, p.v16[layer][voff:voff+vd], p.cfg.KVType)
}

// IndexKeys is layer's index-K buffer, nil when the model has no indexer.
func (p *Pool) IndexKeys(layer int) *kernels.IndexKeys {
	if p.idx == nil {
		return nil
	}
	return p.idx[layer]
}

// Bytes is the memory held by the KV arrays, the index keys and their scales.
func (p *Pool) Bytes() int64 { return p.bytes }

// TableBytes is the memory held by the request-to-token table.
func (p *Pool) TableBytes() int64 { return 4 * int64(len(p.table)) }

// FreePages is the number of free pages. Safe from any goroutine.
func (p *Pool) FreePages() int { return p.alloc.FreeCount() }

// TotalPages is the number of pages in the pool. Safe from any goroutine.
func (p *Pool) TotalPages() int { return p.total }

// Live is the number of live (unreleased) sequences. Safe from any goroutine.
func (p *Pool) Live() int { return int(p.live.Load()) }

// CachedPages is the number of pages the prefix cache holds (whether or not
// sequences share them too). Safe from any goroutine.
func (p *Pool) CachedPages() int { return int(p.numCached.Load()) }

// Cached reports whether the prefix cache holds page.
func (p *Pool) Cached(page int32) bool {
	return page >= 0 && int(page) < p.total && p.cached[page]
}

// Refs is the number of holders of page: the live sequences that hold it,
// plus one when the prefix cache holds it. 0 means the page is free.
func (p *Pool) Refs(page int32) int {
	if page < 0 || int(page) >= p.total {
		return 0
	}
	return int(p.refs[page])
}

// Seq returns the live sequence with this id.
func (p *Pool) Seq(id uint64) (*Seq, bool) {
	s, ok := p.byID[id]
	return s, ok
}

// NewSeq starts an empty sequence on a free request-to-token row. It fails
// with ErrNoRow when every row is taken and ErrDuplicateSeq when a live
// sequence already has id.
func (p *Pool) NewSeq(id uint64) (*Seq, error) {
	s, err := p.newSeq(id)
	p.selfCheck()
	return s, err
}

func (p *Pool) newSeq(id uint64) (*Seq, error) {
	if _, ok := p.byID[id]; ok {
		return nil, fmt.Errorf("%w: %d is live", ErrDuplicateSeq, id)
	}
	if len(p.freeRows) == 0 {
		return nil, fmt.Errorf("%w: all %d rows in use (seq %d)", ErrNoRow, p.cfg.MaxSeqs, id)
	}
	row := p.freeRows[len(p.freeRows)-1]
	p.freeRows = p.freeRows[:len(p.freeRows)-1]
	s := &Seq{pool: p, id: id, row: int(row)}
	p.rows[row] = s
	p.byID[id] = s
	p.live.Add(1)
	return s, nil
}

// Reserve makes room for n tokens beyond Len: afterwards Len()+Reserved() is
// at least Len()+n and Slots() covers those positions. It allocates the pages
// this needs, all or nothing: on ErrOutOfPages nothing changes. A reservation
// never shrinks (Reserve with n at or below Reserved() does nothing; use
// Truncate to give reserved room back). Growing past MaxContext fails with
// ErrContextFull, again changing nothing.
func (p *Pool) Reserve(s *Seq, n int) error {
	err := p.reserve(s, n)
	p.selfCheck()
	return err
}

func (p *Pool) reserve(s *Seq, n int) error {
	if err := p.own(s); err != nil {
		return err
	}
	if n < 0 {
		return fmt.Errorf("kvcache: seq %d: reserve of %d tokens", s.id, n)
	}
	if mc := p.cfg.MaxContext; n > mc-s.n {
		return fmt.Errorf("%w: seq %d: %d tokens + %d more > max context %d", ErrContextFull, s.id, s.n, n, mc)
	}
	target, foot := s.n+n, s.n+s.reserved
	if target <= foot {
		return nil
	}
	if need := p.cfg.PagesFor(target) - len(s.pages); need > 0 {
		pages, err := p.alloc.alloc(need)
		if err != nil {
			return fmt.Errorf("seq %d: reserve %d tokens beyond %d: %w", s.id, n, s.n, err)
		}
		for _, pg := range pages {
			p.refs[pg] = 1
		}
		s.pages = append(s.pages, pages...)
	}
	row := p.row(s)
	ps := p.cfg.PageSize
	for pos := foot; pos < target; pos++ {
		row[pos] = s.pages[pos/ps]*int32(ps) + int32(pos%ps)
	}
	s.reserved = target - s.n
	return nil
}

// Commit records that the next n reserved tokens now hold KV: Len grows by n
// and Reserved shrinks by n. Committing more than is reserved fails with
// ErrNotReserved and changes nothing.
func (p *Pool) Commit(s *Seq, n int) error {
	err := p.commit(s, n)
	p.selfCheck()
	return err
}

func (p *Pool) commit(s *Seq, n int) error {
	if err := p.own(s); err != nil {
		return err
	}
	if n < 0 {
		return fmt.Errorf("kvcache: seq %d: commit of %d tokens", s.id, n)
	}
	if n > s.reserved {
		return fmt.Errorf("%w: seq %d: commit %d tokens, %d reserved", ErrNotReserved, s.id, n, s.reserved)
	}
	s.n += n
	s.reserved -= n
	return nil
}

// Truncate keeps positions 0..n-1 and drops the rest, committed or reserved,
// freeing the whole pages no longer needed. With n at or below Len, Len
// becomes n and nothing stays reserved; with n between Len and
// Len+Reserved, only reserved room is given back. n beyond Len+Reserved is an
// error.
func (p *Pool) Truncate(s *Seq, n int) error {
	err := p.truncate(s, n)
	p.selfCheck()
	return err
}

func (p *Pool) truncate(s *Seq, n int) error {
	if err := p.own(s); err != nil {
		return err
	}
	foot := s.n + s.reserved
	if n < 0 || n > foot {
		return fmt.Errorf("kvcache: seq %d: truncate to %d tokens, holds %d (%d committed)", s.id, n, foot, s.n)
	}
	keep := p.cfg.PagesFor(n)
	if keep <= s.shared && n%p.cfg.PageSize != 0 {
		// The next token would be written into a page others read.
		return fmt.Errorf("%w: seq %d: truncate to %d tokens ends inside shared page %d (%d shared pages of %d tokens)",
			ErrSharedPage, s.id, n, keep-1, s.shared, p.cfg.PageSize)
	}
	if err := p.unref(s.pages[keep:]); err != nil {
		return fmt.Errorf("seq %d: truncate to %d tokens: %w", s.id, n, err)
	}
	s.pages = s.pages[:keep]
	s.shared = min(s.shared, keep)
	row := p.row(s)
	for pos := n; pos < foot; pos++ {
		row[pos] = -1
	}
	if n <= s.n {
		s.n, s.reserved = n, 0
	} else {
		s.reserved = n - s.n
	}
	return nil
}

// Release frees the sequence's pages and row. It happens once: a second
// Release (or any later call on s) returns ErrReleased and frees nothing.
func (p *Pool) Release(s *Seq) error {
	err := p.releaseSeq(s)
	p.selfCheck()
	return err
}

func (p *Pool) releaseSeq(s *Seq) error {
	if err := p.own(s); err != nil {
		return err
	}
	if err := p.unref(s.pages); err != nil {
		return fmt.Errorf("seq %d: release: %w", s.id, err)
	}
	row := p.row(s)
	for pos := range s.n + s.reserved {
		row[pos] = -1
	}
	p.rows[s.row] = nil
	p.freeRows = append(p.freeRows, int32(s.row))
	delete(p.byID, s.id)
	p.live.Add(-1)
	s.pages, s.shared, s.n, s.reserved, s.released = nil, 0, 0, 0, true
	return nil
}

// unref drops one holder from each of pages (distinct, each held) and frees
// those left with none, in one allocator call so that the free order is that
// of a plain release. On error nothing changes.
func (p *Pool) unref(pages []int32) error {
	var free []int32
	for _, pg := range pages {
		switch {
		case pg < 0 || int(pg) >= p.total:
			return fmt.Errorf("%w: page %d of %d", ErrBadPage, pg, p.total)
		case p.refs[pg] <= 0:
			return fmt.Errorf("%w: page %d has no holder", ErrDoubleFree, pg)
		case p.refs[pg] == 1:
			free = append(free, pg)
		}
	}
	if err := p.alloc.release(free); err != nil {
		return err
	}
	for _, pg := range pages {
		p.refs[pg]--
	}
	return nil
}

// own checks that s is a live sequence of p.
func (p *Pool) own(s *Seq) error {
	switch {
	case s == nil:
		return fmt.Errorf("%w: nil", ErrForeignSeq)
	case s.pool != p:
		return fmt.Errorf("%w: seq %d", ErrForeignSeq, s.id)
	case s.released:
		return fmt.Errorf("%w: seq %d", ErrReleased, s.id)
	}
	return nil
}

// row is s's whole request-to-token row.
func (p *Pool) row(s *Seq) []int32 {
	mc := p.cfg.MaxContext
	return p.table[s.row*mc : (s.row+1)*mc]
}

// WriteKV stores one token's K and V rows (KVDim and VDim each; no V row
// for a latent pool) into slot of layer, rounded to nearest even in a
// 16-bit pool.
func (p *Pool) WriteKV(layer int, slot int32, k, v []float32) {
	d, vd := p.cfg.KVDim, p.cfg.VDim()
	if len(k) != d || len(v) != vd {
		panic(fmt.Sprintf("kvcache: WriteKV: K row of %d and V row of %d, want %d and %d", len(k), len(v), d, vd))
	}
	if invariants {
		p.checkSlot("WriteKV", slot)
	}
	off, voff := int(slot)*d, int(slot)*vd
	if p.k != nil {
		copy(p.k[layer][off:off+d], k)
		copy(p.v[layer][voff:voff+vd], v)
		return
	}
	kernels.EncodeKV(p.k16[layer][off:off+d], k, p.cfg.KVType)
	kernels.EncodeKV(p.v16[layer][voff:voff+vd], v, p.cfg.KVType)
}

// WriteIndexK stores one token's index key into slot of layer, quantized by
// b: FP8 (e4m3 and one scale, b.QuantizeFP8) or BF16 (b.ToBF16). It panics
// when the pool has no indexer.
func (p *Pool) WriteIndexK(b kernels.Backend, layer int, slot int32, key []float32) {
	if p.idx == nil {
		panic("kvcache: WriteIndexK on a pool without an indexer")
	}
	ik := p.idx[layer]
	d := ik.Dim
	if len(key) != d {
		panic(fmt.Sprintf("kvcache: WriteIndexK: key of %d, want %d", len(key), d))
	}
	if invariants {
		p.checkSlot("WriteIndexK", slot)
	}
	off := int(slot) * d
	switch ik.DType {
	case kernels.IndexFP8:
		ik.Scales[slot] = b.QuantizeFP8(ik.FP8[off:off+d], key)
	case kernels.IndexBF16:
		b.ToBF16(ik.BF16[off:off+d], key)
	}
}

// checkSlot panics unless slot lies on an allocated page that one sequence
// alone holds: a free page, a page the prefix cache holds or a page shared by
// several sequences is never written.
func (p *Pool) checkSlot(op string, slot int32) {
	if slot < 0 || int(slot) >= p.cfg.Slots() {
		panic(fmt.Sprintf("kvcache: %s: slot %d out of range (%d slots)", op, slot, p.cfg.Slots()))
	}
	page := slot / int32(p.cfg.PageSize)
	switch {
	case !p.alloc.allocated(page):
		panic(fmt.Sprintf("kvcache: %s: slot %d is on free page %d", op, slot, page))
	case p.cached[page] || p.refs[page] != 1:
		panic(fmt.Sprintf("kvcache: %s: slot %d is on shared page %d (%d holders, cached %v)",
			op, slot, page, p.refs[page], p.cached[page]))
	}
}

// selfCheck runs Check after a mutation in invariants builds and panics with
// its error: a broken invariant is a programming error.
func (p *Pool) selfCheck() {
	if invariants {
		if err := p.Check(); err != nil {
			panic(err)
		}
	}
}
