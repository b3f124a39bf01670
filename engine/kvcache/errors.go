package kvcache

import "errors"

// Sentinel errors. Returned errors wrap them with the numbers involved (pages
// wanted and free, the page freed twice, …); test with errors.Is.
var (
	// ErrOutOfPages: the allocator has fewer free pages than asked for.
	ErrOutOfPages = errors.New("kvcache: out of pages")
	// ErrNoRow: every row of the request-to-token table is in use.
	ErrNoRow = errors.New("kvcache: no free request-to-token row")
	// ErrContextFull: the sequence would exceed MaxContext tokens.
	ErrContextFull = errors.New("kvcache: context full")
	// ErrReleased: the sequence was already released.
	ErrReleased = errors.New("kvcache: sequence released")
	// ErrDoubleFree: a page being freed is not allocated.
	ErrDoubleFree = errors.New("kvcache: page freed twice")
	// ErrDuplicateSeq: a live sequence already has this id.
	ErrDuplicateSeq = errors.New("kvcache: duplicate sequence id")
	// ErrBadPage: a page number outside the allocator's range.
	ErrBadPage = errors.New("kvcache: page out of range")
	// ErrNotReserved: a commit of more tokens than are reserved.
	ErrNotReserved = errors.New("kvcache: tokens not reserved")
	// ErrForeignSeq: the sequence is nil or belongs to another pool.
	ErrForeignSeq = errors.New("kvcache: sequence not of this pool")
	// ErrNotCached: a page given as a cached prefix, or freed as cached, is
	// not held by the prefix cache.
	ErrNotCached = errors.New("kvcache: page not held by the prefix cache")
	// ErrSharedPage: the operation would write to, or the cache would free,
	// a page that others still use.
	ErrSharedPage = errors.New("kvcache: page is shared")
	// ErrBadPrefix: a prefix whose token count is not its pages' worth.
	ErrBadPrefix = errors.New("kvcache: prefix is not whole pages")
)
