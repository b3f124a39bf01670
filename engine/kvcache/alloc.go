package kvcache

import (
	"fmt"
	"sync/atomic"
)

// Page states in PageAllocator.state.
const (
	pageFree    uint8 = iota
	pageUsed          // handed out by Alloc
	pagePending       // transient, inside Free: seen earlier in the same call
)

// PageAllocator hands out page numbers 0..Total()-1.
//
// Allocation is deterministic: the same sequence of calls gives the same
// pages, in the same order, so greedy decoding is reproducible. Free pages sit
// on a stack; a fresh allocator hands out the lowest pages first, and freed
// pages are reused most recently freed first (Free then Alloc of the same count
// gives back the same pages in the same order).
//
// A PageAllocator is not safe for concurrent use, except FreeCount, UsedCount
// and Total, which any goroutine may call at any time.
type PageAllocator struct {
	total     int
	state     []uint8 // per page
	free      []int32 // stack of free pages; top is the end
	freeCount atomic.Int64
	seen      []bool // Check's scratch
}

// NewPageAllocator returns an allocator of total pages, all free. total must
// be at most math.MaxInt32 + 1 (pages are int32); it panics otherwise.
func NewPageAllocator(total int) *PageAllocator {
	if total < 0 || int64(total) > 1<<31 {
		panic(fmt.Sprintf("kvcache: NewPageAllocator(%d): want 0..%d pages", total, int64(1)<<31))
	}
	a := &PageAllocator{
		total: total,
		state: make([]uint8, total),
		free:  make([]int32, total),
	}
	for i := range a.free {
		a.free[i] = int32(total - 1 - i)
	}
	a.freeCount.Store(int64(total))
	return a
}

// Total is the number of pages the allocator manages.
func (a *PageAllocator) Total() int { return a.total }

// FreeCount is the number of free pages. Safe from any goroutine.
func (a *PageAllocator) FreeCount() int { return int(a.freeCount.Load()) }

// UsedCount is the number of allocated pages. Safe from any goroutine.
func (a *PageAllocator) UsedCount() int { return a.total - a.FreeCount() }

// Alloc hands out n pages, or none: with fewer than n free it returns an error
// wrapping ErrOutOfPages and changes nothing. Alloc(0) returns nil, nil.
func (a *PageAllocator) Alloc(n int) ([]int32, error) {
	pages, err := a.alloc(n)
	a.selfCheck()
	return pages, err
}

// Free returns pages to the allocator. If any page is out of range, not
// allocated, or listed twice, it returns an error naming the first such page
// (wrapping ErrBadPage or ErrDoubleFree) and frees none of them.
func (a *PageAllocator) Free(pages []int32) error {
	err := a.release(pages)
	a.selfCheck()
	return err
}

func (a *PageAllocator) alloc(n int) ([]int32, error) {
	if n < 0 {
		return nil, fmt.Errorf("kvcache: alloc of %d pages", n)
	}
	if n == 0 {
		return nil, nil
	}
	if n > len(a.free) {
		return nil, fmt.Errorf("%w: want %d pages, %d of %d free", ErrOutOfPages, n, len(a.free), a.total)
	}
	out := make([]int32, n)
	top := len(a.free)
	for i := range out {
		p := a.free[top-1-i]
		out[i] = p
		a.state[p] = pageUsed
	}
	a.free = a.free[:top-n]
	a.freeCount.Store(int64(len(a.free)))
	return out, nil
}

// release is Free without the self-check.
func (a *PageAllocator) release(pages []int32) error {
	// Validate everything first, marking pages pending so that a page listed
	// twice is caught; undo the marks on failure.
	for i, p := range pages {
		var err error
		switch {
		case p < 0 || int(p) >= a.total:
			err = fmt.Errorf("%w: page %d of %d", ErrBadPage, p, a.total)
		case a.state[p] == pageFree:
			err = fmt.Errorf("%w: page %d is not allocated", ErrDoubleFree, p)
		case a.state[p] == pagePending:
			err = fmt.Errorf("%w: page %d listed twice in one Free", ErrDoubleFree, p)
		}
		if err != nil {
			for _, q := range pages[:i] {
				a.state[q] = pageUsed
			}
			return err
		}
		a.state[p] = pagePending
	}
	for i := len(pages) - 1; i >= 0; i-- {
		p := pages[i]
		a.state[p] = pageFree
		a.free = append(a.free, p)
	}
	a.freeCount.Store(int64(len(a.free)))
	return nil
}

// allocated reports whether page p is in range and allocated.
func (a *PageAllocator) allocated(p int32) bool {
	return p >= 0 && int(p) < a.total && a.state[p] == pageUsed
}

// Check verifies the allocator's accounting: every page is either free or
// allocated, the free stack holds each free page exactly once and nothing
// else, and FreeCount + UsedCount == Total. It costs O(Total).
func (a *PageAllocator) Check() error {
	if len(a.state) != a.total {
		return fmt.Errorf("kvcache: allocator: %d page states for %d pages", len(a.state), a.total)
	}
	if fc := a.freeCount.Load(); fc != int64(len(a.free)) {
		return fmt.Errorf("kvcache: allocator: free count %d, free stack holds %d", fc, len(a.free))
	}
	if len(a.free) > a.total {
		return fmt.Errorf("kvcache: allocator: %d free pages of %d", len(a.free), a.total)
	}
	if a.seen == nil {
		a.seen = make([]bool, a.total)
	}
	seen := a.seen
	clear(seen)
	for _, p := range a.free {
		switch {
		case p < 0 || int(p) >= a.total:
			return fmt.Errorf("kvcache: allocator: free stack holds page %d of %d", p, a.total)
		case seen[p]:
			return fmt.Errorf("kvcache: allocator: page %d is on the free stack twice", p)
		case a.state[p] != pageFree:
			return fmt.Errorf("kvcache: allocator: page %d is on the free stack but in state %d", p, a.state[p])
		}
		seen[p] = true
	}
	used := 0
	for p, s := range a.state {
		switch s {
		case pageUsed:
			used++
		case pageFree:
			if !seen[p] {
				return fmt.Errorf("kvcache: allocator: page %d is free but not on the free stack (leaked)", p)
			}
		default:
			return fmt.Errorf("kvcache: allocator: page %d in state %d", p, s)
		}
	}
	if used+len(a.free) != a.total {
		return fmt.Errorf("kvcache: allocator: %d allocated + %d free != %d total", used, len(a.free), a.total)
	}
	return nil
}

// selfCheck runs Check after a mutation in invariants builds.
func (a *PageAllocator) selfCheck() {
	if invariants {
		if err := a.Check(); err != nil {
			panic(err)
		}
	}
}
