// Package prefix is a radix prefix cache over one rank's paged KV pool:
// requests whose prompts start alike reuse the KV of the common prefix
// instead of computing it again.
//
// The tree is keyed by token IDs in page-sized steps. Each node below the
// root holds one page: the PageSize tokens it covers and the pool page whose
// slots hold their KV; its children are keyed by their token blocks. So a
// path from the root spells a prompt prefix a whole number of pages long, and
// the pages along it are that prefix's KV, in position order. Index keys of
// the sparse indexer live in the same slots as K and V, so a cached page
// carries its index keys too and sharing the page shares them.
//
// A request's life with the cache:
//
//	pages, n := c.Match(prompt[:len(prompt)-1]) // locks the matched nodes
//	s, err := pool.NewSeqWithPrefix(id, pages, n)
//	... run prompt[n:], decode ...
//	err = c.Finish(s, tokens, pages)            // full pages into the tree, unlock
//
// (Match a prompt without its last token to leave at least one token whose
// logits must be computed.) Cached pages are held by the pool's cache owner
// (kvcache.Pool.ReleaseTo, FreeCached): a cached page is read-only, and the
// pool's Check proves every page is free or held, with the right reference
// count, by sequences and/or the cache. Eviction frees least-recently-used
// leaves that no match has locked, under a logical clock (no wall time), so
// the cache is deterministic.
//
// An optional host tier (engine/hicache, HiCache) keeps evicted pages' KV in
// host memory and loads it back: see AttachHost in tier.go. Without one the
// cache behaves as described above.
//
// A Cache serves one Pool, is the only cache of that pool, and like the pool
// belongs to the rank's loop: it is not safe for concurrent use.
package prefix

import (
	"container/heap"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
)

// Cache is a radix tree of cached pages over a pool.
type Cache struct {
	pool   *kvcache.Pool
	ps     int
	root   *node
	byPage map[int32]*node
	clock  uint64
	locks  map[*node]int // deepest node of each locked match -> matches

	tier tierState // the host tier; zero (host nil) until AttachHost
}

type node struct {
	parent   *node
	key      []int32 // the page's PageSize tokens; nil at the root
	page     int32   // -1 at the root and on a host-only node (tier.go)
	children map[string]*node
	lock     int    // locked matches whose path passes through this node
	last     uint64 // logical time of the last Match or Insert through it

	// The host tier (tier.go); zero while none is attached.
	hkey    hicache.Key     // the node's host entry key; 0 until it needs one
	onHost  bool            // a host entry of key holds the page's KV
	hits    int             // Matches that passed through the node
	loading *hicache.Load   // an unsettled load into the node's page
	backup  *hicache.Backup // a backup of the node's page in flight
}

// New returns an empty cache over pool. The pool must hold no cached pages
// yet: the cache accounts for all of them.
func New(pool *kvcache.Pool) *Cache {
	return &Cache{
		pool:   pool,
		ps:     pool.Config().PageSize,
		root:   &node{page: -1, children: map[string]*node{}},
		byPage: map[int32]*node{},
		locks:  map[*node]int{},
	}
}

// Pool is the pool whose pages the cache holds.
func (c *Cache) Pool() *kvcache.Pool { return c.pool }

// Pages is the number of pages the cache holds.
func (c *Cache) Pages() int { return len(c.byPage) }

// blockKey is the child-map key of one page's tokens: their bytes.
func blockKey(b []int32) string {
	buf := make([]byte, 0, 4*len(b))
	for _, t := range b {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
	}
	return string(buf)
}

// Match returns the longest cached prefix of tokens that is a whole number
// of pages: its pages in position order and its length n in tokens
// (len(pages)*PageSize, 0 when nothing matches). The matched nodes are locked
// against eviction until Unlock(pages) (or Finish); each Match that returns
// pages needs its own Unlock.
func (c *Cache) Match(tokens []int32) (pages []int32, n int) {
	c.reap()
	c.clock++
	nd := c.root
	for len(tokens)-n >= c.ps {
		child := nd.children[blockKey(tokens[n:n+c.ps])]
		if child == nil || child.page < 0 { // absent, or on host only
			break
		}
		nd = child
		nd.last = c.clock
		pages = append(pages, nd.page)
		n += c.ps
	}
	if nd != c.root {
		c.locks[nd]++
		for x := nd; x != c.root; x = x.parent {
			x.lock++
		}
		c.hit(nd)
	}
	return pages, n
}

// Unlock releases the lock a Match that returned pages took. Unlock(nil) does
// nothing. It fails, changing nothing, when pages are not a cached path from
// the root or no match of exactly that path is locked.
func (c *Cache) Unlock(pages []int32) error {
	if len(pages) == 0 {
		return nil
	}
	nd, err := c.path(pages)
	if err != nil {
		return fmt.Errorf("prefix: unlock: %w", err)
	}
	if c.locks[nd] == 0 {
		return fmt.Errorf("prefix: unlock: no match of these %d pages is locked", len(pages))
	}
	if c.locks[nd]--; c.locks[nd] == 0 {
		delete(c.locks, nd)
	}
	for x := nd; x != c.root; x = x.parent {
		x.lock--
	}
	if len(c.tier.loads) > 0 {
		c.abandon()
	}
	return nil
}

// path returns the node at the end of pages, which must be a path from the
// root.
func (c *Cache) path(pages []int32) (*node, error) {
	nd := c.byPage[pages[len(pages)-1]]
	if nd == nil {
		return nil, fmt.Errorf("page %d is not cached", pages[len(pages)-1])
	}
	x := nd
	for i := len(pages) - 1; i >= 0; i-- {
		if x == c.root || x.page != pages[i] {
			return nil, fmt.Errorf("pages %v are not a cached path from the root", pages)
		}
		x = x.parent
	}
	if x != c.root {
		return nil, fmt.Errorf("pages %v are not a cached path from the root", pages)
	}
	return nd, nil
}

// Insert indexes pages, which the cache holds (kvcache.Pool.ReleaseTo handed
// them over), under tokens: page i holds the KV of tokens[i*PageSize :
// (i+1)*PageSize]. tokens may run past the pages; only the pages' worth is
// used. Where the tree already has a node for a block, that node is kept: if
// its page is the one given (a sequence that started from the cache hands its
// shared pages back), nothing changes; otherwise the given page is a
// duplicate and is freed. Insert returns the number of pages it added to the
// tree. It fails, changing nothing, when tokens are too short, a page is not
// held by the cache, or a page is already cached elsewhere in the tree or
// listed twice.
func (c *Cache) Insert(tokens, pages []int32) (added int, err error) {
	return c.insert(tokens, pages, false)
}

// insert is Insert; cold leaves the nodes' recency as it was and makes
// new nodes the least recently used of all, first to evict.
func (c *Cache) insert(tokens, pages []int32, cold bool) (added int, err error) {
	if len(tokens) < len(pages)*c.ps {
		return 0, fmt.Errorf("prefix: insert: %d tokens for %d pages of %d", len(tokens), len(pages), c.ps)
	}
	// Validate without changing anything.
	seen := make(map[int32]bool, len(pages))
	nd := c.root
	for i, pg := range pages {
		switch {
		case !c.pool.Cached(pg):
			return 0, fmt.Errorf("prefix: insert: page %d: %w", pg, kvcache.ErrNotCached)
		case seen[pg]:
			return 0, fmt.Errorf("prefix: insert: page %d listed twice", pg)
		}
		seen[pg] = true
		var child *node
		if nd != nil {
			child = nd.children[blockKey(tokens[i*c.ps:(i+1)*c.ps])]
		}
		if at := c.byPage[pg]; at != nil && at != child {
			return 0, fmt.Errorf("prefix: insert: page %d is already cached for other tokens", pg)
		}
		nd = child
	}
	// Apply.
	c.clock++
	var dups []int32
	nd = c.root
	for i, pg := range pages {
		blk := tokens[i*c.ps : (i+1)*c.ps]
		k := blockKey(blk)
		child := nd.children[k]
		switch {
		case child == nil:
			child = &node{parent: nd, key: append([]int32(nil), blk...), page: pg, children: map[string]*node{}}
			nd.children[k] = child
			c.byPage[pg] = child
			added++
		case child.page < 0:
			// A host-only node: pg holds the same tokens' KV, so the node
			// is on the device again (and still on host).
			child.page = pg
			c.byPage[pg] = child
			added++
		case child.page != pg:
			dups = append(dups, pg)
		}
		if !cold {
			child.last = c.clock
			c.inserted(child)
		}
		nd = child
	}
	if err := c.pool.FreeCached(dups); err != nil {
		// Only a sequence that adopted a page outside the tree can hold a
		// duplicate; that breaks the pool's contract.
		panic(fmt.Sprintf("prefix: insert: freeing duplicate pages %v: %v", dups, err))
	}
	return added, nil
}

// Finish releases s, which started from the matched pages of a Match (nil if
// it matched nothing or did not use the cache), into the cache: its full
// pages are indexed under tokens (the tokens whose KV s holds, from position
// 0; at least its full pages' worth), duplicates are freed, the rest of its
// pages are freed, and the match is unlocked.
func (c *Cache) Finish(s *kvcache.Seq, tokens, matched []int32) error {
	return c.finish(s, tokens, matched, false)
}

// FinishCold is Finish for a sequence whose pages should not keep
// anything in the cache: a correctness probe's. Its new pages are indexed
// as the least recently used of all, first to evict, and the pages it
// shares with the tree keep the recency they had.
func (c *Cache) FinishCold(s *kvcache.Seq, tokens, matched []int32) error {
	return c.finish(s, tokens, matched, true)
}

func (c *Cache) finish(s *kvcache.Seq, tokens, matched []int32, cold bool) error {
	if full := s.Len() / c.ps * c.ps; len(tokens) < full {
		return fmt.Errorf("prefix: finish seq %d: %d tokens for %d full pages' worth", s.ID(), len(tokens), full)
	}
	var ierr error
	err := c.pool.ReleaseTo(s, func(full []int32) {
		if _, ierr = c.insert(tokens, full, cold); ierr != nil {
			// Give back what the tree does not index, so nothing leaks.
			var orphans []int32
			for _, pg := range full {
				if c.byPage[pg] == nil {
					orphans = append(orphans, pg)
				}
			}
			ierr = errors.Join(ierr, c.pool.FreeCached(orphans))
		}
	})
	if err != nil {
		return err // s was not released: the match stays locked
	}
	return errors.Join(ierr, c.Unlock(matched))
}

// Evict frees least-recently-used cached pages until n are freed or none is
// left to free, and returns how many it freed. Only leaves go, so a prefix
// stays cached as long as a longer one is; locked nodes, and nodes whose
// page a sequence still uses, stay.
//
// With a host tier attached (AttachHost), "leaf" means a node with no child
// on the device, and a node whose KV is on host (or, under WriteBack, is
// backed up now) stays in the tree as host-only instead of going; see
// tier.go.
func (c *Cache) Evict(n int) int {
	if n <= 0 {
		return 0
	}
	c.reap()
	h := &lru{}
	for _, nd := range c.byPage {
		if !c.hasDeviceChild(nd) && c.evictable(nd) {
			*h = append(*h, nd)
		}
	}
	heap.Init(h)
	var freed []int32
	for len(freed) < n && h.Len() > 0 {
		nd := heap.Pop(h).(*node)
		p := nd.parent
		freed = append(freed, nd.page)
		delete(c.byPage, nd.page)
		if c.evictOff(nd) {
			nd.page = -1
		} else {
			c.drop(nd)
		}
		if p != c.root && !c.hasDeviceChild(p) && c.evictable(p) {
			heap.Push(h, p)
		}
	}
	if err := c.pool.FreeCached(freed); err != nil {
		panic(fmt.Sprintf("prefix: evict: %v", err)) // evictable pages are held by the cache alone
	}
	return len(freed)
}

// Evictable counts the cached pages Evict could free now: those no match
// locks and no sequence holds. (A sequence or lock on a page pins every page
// above it, so repeated leaf eviction reaches all of them.)
func (c *Cache) Evictable() int {
	n := 0
	for _, nd := range c.byPage {
		if c.evictable(nd) {
			n++
		}
	}
	return n
}

// evictable: no match locks nd and no sequence holds its page.
func (c *Cache) evictable(nd *node) bool {
	return nd.lock == 0 && c.pool.Refs(nd.page) == 1
}

// lru is a min-heap of nodes by last use, then page.
type lru []*node

func (h lru) Len() int { return len(h) }
func (h lru) Less(i, j int) bool {
	if h[i].last != h[j].last {
		return h[i].last < h[j].last
	}
	return h[i].page < h[j].page
}
func (h lru) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *lru) Push(x any)   { *h = append(*h, x.(*node)) }
func (h *lru) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// Check verifies the tree and its agreement with the pool and returns the
// first broken invariant:
//
//   - every node below the root covers PageSize tokens, is filed under its
//     own token block in its parent, and records that parent;
//   - the nodes' pages are distinct, each held by the cache in the pool, and
//     they are all the pages the pool counts as cached (none leaked outside
//     the tree);
//   - every node's lock count is the number of locked matches whose path
//     passes through it, and a node whose page a sequence uses is locked;
//   - a node was used no earlier than any of its children.
//
// It costs O(pages) and is meant for tests.
func (c *Cache) Check() error {
	if c.root.parent != nil || c.root.key != nil || c.root.page != -1 || c.root.lock != 0 {
		return errors.New("prefix: root is not an empty node")
	}
	want := make(map[*node]int, len(c.locks))
	for nd, k := range c.locks {
		if k <= 0 {
			return fmt.Errorf("prefix: match lock count %d on page %d", k, nd.page)
		}
		if c.byPage[nd.page] != nd {
			return fmt.Errorf("prefix: a locked match ends at page %d, which is not in the tree", nd.page)
		}
		for x := nd; x != c.root; x = x.parent {
			want[x] += k
		}
	}
	count := 0
	var walk func(nd *node) error
	walk = func(nd *node) error {
		for k, ch := range nd.children {
			if ch.page < 0 {
				// Host-only (tier.go checks where it is); nothing below it
				// is on the device.
				if ch.parent != nd || len(ch.key) != c.ps || blockKey(ch.key) != k {
					return fmt.Errorf("prefix: a host-only node is misfiled")
				}
				if err := c.checkHostOnly(ch); err != nil {
					return err
				}
				continue
			}
			count++
			switch {
			case ch.parent != nd:
				return fmt.Errorf("prefix: page %d does not record its parent", ch.page)
			case len(ch.key) != c.ps:
				return fmt.Errorf("prefix: page %d covers %d tokens, page size %d", ch.page, len(ch.key), c.ps)
			case blockKey(ch.key) != k:
				return fmt.Errorf("prefix: page %d filed under another token block", ch.page)
			case c.byPage[ch.page] != ch:
				return fmt.Errorf("prefix: page %d is in the tree twice or not indexed", ch.page)
			case !c.pool.Cached(ch.page):
				return fmt.Errorf("prefix: page %d is in the tree but the pool's cache does not hold it", ch.page)
			case ch.lock != want[ch]:
				return fmt.Errorf("prefix: page %d has lock %d, %d locked matches pass through it", ch.page, ch.lock, want[ch])
			case ch.lock == 0 && c.pool.Refs(ch.page) > 1:
				return fmt.Errorf("prefix: page %d is used by %d sequences but not locked", ch.page, c.pool.Refs(ch.page)-1)
			case nd != c.root && ch.last > nd.last:
				return fmt.Errorf("prefix: page %d used at %d, after its parent page %d (%d)", ch.page, ch.last, nd.page, nd.last)
			}
			if err := walk(ch); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(c.root); err != nil {
		return err
	}
	if count != len(c.byPage) {
		return fmt.Errorf("prefix: %d nodes in the tree, %d indexed by page", count, len(c.byPage))
	}
	if got := c.pool.CachedPages(); got != count {
		return fmt.Errorf("prefix: the pool's cache holds %d pages, the tree %d (leak)", got, count)
	}
	return c.checkTier()
}
