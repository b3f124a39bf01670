package prefix

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
)

// The host tier (HiCache) of the prefix cache.
//
// AttachHost gives the cache an engine/hicache HostPool and Loader. From then
// on each node is on the device (its page in the pool, as without a tier),
// on host (a host entry under the node's key holds its page's KV), or both:
//
//   - Backups. Under WriteThrough a node is backed up once it is reused: the
//     first Match that passes through it (the reference's hit threshold of
//     1), provided its parent is on host already, so that what is on host is
//     always a path from the root (Match walks root first, so one Match backs
//     up a whole reused path). Under WriteBack a node is backed up when Evict
//     takes it off the device. Backups are synchronous here: HostPool.Backup
//     runs inside Match or Evict, on the rank's loop. (The wiring moves them
//     to a writer goroutine; then a node being copied must be pinned.)
//   - Device eviction. Evict takes a node with no child on the device; if the
//     node is on host (or was just backed up under WriteBack) it stays in the
//     tree as host-only, else it goes with its host-only subtree. So the
//     nodes on the device are always a path-closed set from the root, and
//     below them hang host-only nodes.
//   - Host eviction. HostPool evicts its least recently used unpinned entries
//     when a backup needs room; the cache forgets those copies: a node on
//     both stays on the device, a host-only node goes with its (host-only)
//     subtree. A node being loaded is pinned by its load and never evicted.
//   - Load-back. MatchHost returns, past the device prefix that Match
//     returns, how many more tokens are on host only. StartLoad extends a
//     sequence started from that device prefix by fresh pages of its own
//     (kvcache.Pool.Reserve) and queues one Loader load of those nodes into
//     them (SubmitKeys: one ring slot, each layer of every node before the
//     next layer); the returned *hicache.Load is a model.LayerGate that holds
//     the forward pass's reads of each layer until that layer has landed. The pages are
//     the sequence's own while the loader writes them, as hicache and the
//     pool require. Finish, once every load is over, hands them to the cache
//     like any full page, and Insert makes the host-only nodes device
//     resident again on those pages (on both tiers). A failed load, or Abort,
//     releases the sequence (freeing those device pages) and leaves the host
//     copies intact.
//
// The cache is the only user of its host pool's entries, one host page per
// node. Without AttachHost nothing here runs and the cache behaves exactly
// as it does without a tier.

// Policy is when the cache backs a node up to host.
type Policy int

const (
	// WriteThrough backs a node up once a Match reuses it (the default).
	WriteThrough Policy = iota
	// WriteBack backs a node up when it is evicted from the device.
	WriteBack
)

func (p Policy) String() string {
	switch p {
	case WriteThrough:
		return "write-through"
	case WriteBack:
		return "write-back"
	}
	return fmt.Sprintf("Policy(%d)", int(p))
}

// Location is where a node's KV is.
type Location int

const (
	OnDevice Location = 1 << iota // in the device pool only
	OnHost                        // in the host pool only
	OnBoth   = OnDevice | OnHost
)

func (l Location) String() string {
	switch l {
	case OnDevice:
		return "device"
	case OnHost:
		return "host"
	case OnBoth:
		return "both"
	}
	return fmt.Sprintf("Location(%d)", int(l))
}

// tierState is the cache's host tier; the zero value is none.
type tierState struct {
	host    *hicache.HostPool
	loader  *hicache.Loader
	policy  Policy
	nextKey hicache.Key
	byKey   map[hicache.Key]*node
	loads   map[uint64]*seqLoad // by sequence id
}

// seqLoad is the load StartLoad queued for one sequence.
type seqLoad struct {
	nodes   []*node // host-only, in path order
	load    *hicache.Load
	aborted bool // Abort has given up the load's holder
}

// ErrNoHost: the cache has no host tier attached.
var ErrNoHost = errors.New("prefix: no host tier attached")

// AttachHost gives the cache a host tier: host must be shaped for the
// cache's pool and used by nothing else, and loader must load from host into
// the cache's pool. It can be attached once.
func (c *Cache) AttachHost(host *hicache.HostPool, loader *hicache.Loader, policy Policy) error {
	switch {
	case host == nil || loader == nil:
		return errors.New("prefix: attach host: nil host pool or loader")
	case c.tier.host != nil:
		return errors.New("prefix: attach host: a host tier is already attached")
	case policy != WriteThrough && policy != WriteBack:
		return fmt.Errorf("prefix: attach host: unknown policy %v", policy)
	case host.UsedPages() != 0:
		return errors.New("prefix: attach host: the host pool is not empty")
	}
	c.tier = tierState{
		host: host, loader: loader, policy: policy,
		byKey: map[hicache.Key]*node{}, loads: map[uint64]*seqLoad{},
	}
	return nil
}

// Policy is the attached tier's write policy (WriteThrough without one).
func (c *Cache) Policy() Policy { return c.tier.policy }

// HostPages is the number of nodes whose KV is on host (host-only or both).
func (c *Cache) HostPages() int {
	n := 0
	c.walkAll(func(nd *node) {
		if nd.onHost {
			n++
		}
	})
	return n
}

// HostOnly is the number of nodes on host and not on the device.
func (c *Cache) HostOnly() int {
	n := 0
	c.walkAll(func(nd *node) {
		if nd.page < 0 {
			n++
		}
	})
	return n
}

// Where is the location of each node along the tree path that spells
// tokens' leading whole pages, as far as the tree has it.
func (c *Cache) Where(tokens []int32) []Location {
	var out []Location
	nd := c.root
	for n := 0; len(tokens)-n >= c.ps; n += c.ps {
		nd = nd.children[blockKey(tokens[n:n+c.ps])]
		if nd == nil {
			break
		}
		out = append(out, nd.location())
	}
	return out
}

func (nd *node) location() Location {
	var l Location
	if nd.page >= 0 {
		l |= OnDevice
	}
	if nd.onHost {
		l |= OnHost
	}
	return l
}

// walkAll calls f on every node below the root.
func (c *Cache) walkAll(f func(*node)) {
	var walk func(*node)
	walk = func(nd *node) {
		for _, ch := range nd.children {
			f(ch)
			walk(ch)
		}
	}
	walk(c.root)
}

// hasDeviceChild reports whether a child of nd is on the device. Without a
// host tier every node is, so this is "nd has children".
func (c *Cache) hasDeviceChild(nd *node) bool {
	for _, ch := range nd.children {
		if ch.page >= 0 {
			return true
		}
	}
	return false
}

// hit counts a Match through the path ending at nd and, under WriteThrough,
// backs up the path's reused nodes, root first.
func (c *Cache) hit(nd *node) {
	if c.tier.host == nil {
		return
	}
	var path []*node
	for x := nd; x != c.root; x = x.parent {
		path = append(path, x)
	}
	for i := len(path) - 1; i >= 0; i-- {
		x := path[i]
		x.hits++
		if c.tier.policy == WriteThrough && !x.onHost && (x.parent == c.root || x.parent.onHost) {
			c.backup(x)
		}
	}
}

// backup copies device node nd's page to host, synchronously, and reports
// whether it is on host now. A full host pool (every entry pinned) leaves
// it device only.
func (c *Cache) backup(nd *node) bool {
	if nd.hkey == 0 {
		c.tier.nextKey++
		nd.hkey = c.tier.nextKey
		c.tier.byKey[nd.hkey] = nd
	}
	evicted, err := c.tier.host.Backup(nd.hkey, c.pool, []int32{nd.page})
	c.forget(evicted)
	if err != nil {
		return false
	}
	nd.onHost = true
	return true
}

// forget records that the host pool evicted keys' entries: a node on both
// tiers stays on the device, a host-only node goes with its subtree.
func (c *Cache) forget(keys []hicache.Key) {
	for _, k := range keys {
		nd := c.tier.byKey[k]
		if nd == nil || !nd.onHost {
			continue
		}
		nd.onHost = false
		if nd.page < 0 {
			c.drop(nd)
		}
	}
}

// keepOnHost reports whether device node nd, being evicted, stays as a
// host-only node: it is on host, or WriteBack backs it up now.
func (c *Cache) keepOnHost(nd *node) bool {
	switch {
	case c.tier.host == nil:
		return false
	case nd.onHost:
		return true
	case c.tier.policy == WriteBack:
		return c.backup(nd)
	}
	return false
}

// drop removes nd and its subtree from the tree. Every node in it must be
// off the device, except nd itself, whose page the caller has dealt with;
// the subtree's host entries are removed.
func (c *Cache) drop(nd *node) {
	delete(nd.parent.children, blockKey(nd.key))
	var rm func(x *node)
	rm = func(x *node) {
		for _, ch := range x.children {
			rm(ch)
		}
		if x.onHost {
			if err := c.tier.host.Remove(x.hkey); err != nil {
				// Only a load pins an entry, and a node being loaded hangs
				// below locked device nodes, which are never dropped.
				panic(fmt.Sprintf("prefix: dropping host node %d: %v", x.hkey, err))
			}
			x.onHost = false
		}
		if x.hkey != 0 {
			delete(c.tier.byKey, x.hkey)
		}
		if x.page >= 0 && c.byPage[x.page] == x {
			delete(c.byPage, x.page)
		}
		x.parent = nil
	}
	rm(nd)
}

// MatchHost is Match (pages, n and the lock are Match's) plus hostTokens:
// how many tokens past n the tree holds on host only, whole pages, and
// could load back with StartLoad. It loads nothing; nodes being loaded for
// another sequence end the count. Without a host tier hostTokens is 0.
func (c *Cache) MatchHost(tokens []int32) (pages []int32, n, hostTokens int) {
	pages, n = c.Match(tokens)
	if c.tier.host == nil {
		return pages, n, 0
	}
	nd := c.root
	if len(pages) > 0 {
		nd = c.byPage[pages[len(pages)-1]]
	}
	for len(tokens)-n-hostTokens >= c.ps {
		at := n + hostTokens
		child := nd.children[blockKey(tokens[at:at+c.ps])]
		if child == nil || child.page >= 0 || child.loading != nil {
			break
		}
		c.tier.host.Touch(child.hkey)
		hostTokens += c.ps
		nd = child
	}
	return pages, n, hostTokens
}

// StartLoad loads back the host-only nodes that follow matched (the device
// pages of a MatchHost of tokens) along tokens: s must have started from
// matched (kvcache.Pool.NewSeqWithPrefix, nothing more written or
// reserved). It reserves and commits one fresh page of s per node and
// queues one load of all the nodes into them (hicache.Loader.SubmitKeys,
// one ring slot, layer by layer across the nodes). It returns the load, a
// model.LayerGate for the forward pass, and the tokens it covers: s's Len
// grows by that many, and its KV there may be read only through the load's
// gates. The nodes stay host-only, pinned on host, until Finish(s) (once the
// load is over) makes them device resident on s's pages, or Abort. It fails,
// changing nothing, when nothing follows matched on host only, s cannot
// reserve the pages (kvcache.ErrOutOfPages: evict first) or the loader
// refuses (hicache.ErrSlotBusy: the ring is full, try again later).
func (c *Cache) StartLoad(s *kvcache.Seq, tokens, matched []int32) (*hicache.Load, int, error) {
	if c.tier.host == nil {
		return nil, 0, ErrNoHost
	}
	n := len(matched) * c.ps
	switch {
	case c.tier.loads[s.ID()] != nil:
		return nil, 0, fmt.Errorf("prefix: start load: seq %d is already loading", s.ID())
	case s.Len() != n || s.Reserved() != 0 || s.Shared() != len(matched):
		return nil, 0, fmt.Errorf("prefix: start load: seq %d holds %d tokens (%d reserved, %d shared pages), not just the %d matched pages",
			s.ID(), s.Len(), s.Reserved(), s.Shared(), len(matched))
	}
	nd := c.root
	if len(matched) > 0 {
		var err error
		if nd, err = c.path(matched); err != nil {
			return nil, 0, fmt.Errorf("prefix: start load: %w", err)
		}
	}
	var nodes []*node
	for at := n; len(tokens)-at >= c.ps; at += c.ps {
		child := nd.children[blockKey(tokens[at:at+c.ps])]
		if child == nil || child.page >= 0 || child.loading != nil {
			break
		}
		nodes = append(nodes, child)
		nd = child
	}
	if len(nodes) == 0 {
		return nil, 0, fmt.Errorf("prefix: start load: nothing on host only after %d tokens", n)
	}
	if err := c.pool.Reserve(s, len(nodes)*c.ps); err != nil {
		return nil, 0, fmt.Errorf("prefix: start load: %w", err)
	}
	keys := make([]hicache.Key, len(nodes))
	for i, x := range nodes {
		keys[i] = x.hkey
	}
	k := len(nodes) * c.ps
	l, err := c.tier.loader.SubmitKeys(keys, s.Pages()[len(matched):])
	if err != nil {
		if terr := c.pool.Truncate(s, n); terr != nil {
			panic(fmt.Sprintf("prefix: start load: seq %d: %v", s.ID(), terr)) // s was checked above
		}
		return nil, 0, fmt.Errorf("prefix: start load: %w", err)
	}
	// Committed now: the load's gates guard the reads of these positions.
	if err := c.pool.Commit(s, k); err != nil {
		panic(fmt.Sprintf("prefix: start load: seq %d: %v", s.ID(), err))
	}
	for _, x := range nodes {
		x.loading = l
	}
	c.tier.loads[s.ID()] = &seqLoad{nodes: nodes, load: l}
	return l, k, nil
}

// Loading is s's load from StartLoad, if Finish or Abort has not settled it.
func (c *Cache) Loading(s *kvcache.Seq) (*hicache.Load, bool) {
	sl := c.tier.loads[s.ID()]
	if sl == nil {
		return nil, false
	}
	return sl.load, true
}

// finishLoad settles s's load for Finish. Without one it does nothing
// (handled false). With a load in flight it fails, changing nothing. After
// a load that landed it lets Finish go on (the nodes become device
// resident through Insert). After a failed load it releases s, freeing the
// loaded pages, and unlocks matched: the host copies stay.
func (c *Cache) finishLoad(s *kvcache.Seq, matched []int32) (handled bool, err error) {
	sl := c.tier.loads[s.ID()]
	if sl == nil {
		return false, nil
	}
	if _, _, over := sl.load.Progress(); !over {
		return true, fmt.Errorf("prefix: finish seq %d: its load back from host is in flight (wait for it or Abort)", s.ID())
	}
	lerr := sl.load.Wait(context.Background()) // over: returns at once
	c.settle(s, sl)
	if lerr == nil && !sl.aborted {
		return false, nil
	}
	if lerr == nil {
		lerr = hicache.ErrAborted // Abort gave up after the last layer landed
	}
	return true, errors.Join(fmt.Errorf("prefix: finish seq %d: load back failed: %w", s.ID(), lerr),
		c.pool.Release(s), c.Unlock(matched))
}

// settle forgets s's load, which is over.
func (c *Cache) settle(s *kvcache.Seq, sl *seqLoad) {
	for _, nd := range sl.nodes {
		nd.loading = nil
	}
	delete(c.tier.loads, s.ID())
}

// Abort gives up s's load from StartLoad: the loader stops at its next
// step, the host copies stay intact, and once the loader has let go of the
// pages s is released (freeing them and the rest of s) and matched is
// unlocked. If ctx ends first it returns ctx's error and changes nothing
// else; call Abort again later to finish.
func (c *Cache) Abort(ctx context.Context, s *kvcache.Seq, matched []int32) error {
	sl := c.tier.loads[s.ID()]
	if sl == nil {
		return fmt.Errorf("prefix: abort seq %d: no load back in flight", s.ID())
	}
	if !sl.aborted {
		sl.aborted = true
		if err := sl.load.Abort(ctx); err != nil {
			return err // the abort goes on; Wait below tells when it is over
		}
	}
	if err := sl.load.Wait(ctx); err != nil && ctx.Err() != nil {
		return err
	}
	c.settle(s, sl)
	return errors.Join(c.pool.Release(s), c.Unlock(matched))
}

func keysOf(nodes []*node) []hicache.Key {
	keys := make([]hicache.Key, len(nodes))
	for i, nd := range nodes {
		keys[i] = nd.hkey
	}
	return keys
}

// checkHostOnly verifies host-only node nd and its subtree: all off the
// device and on host, unlocked, filed under their keys, and pinned on host
// exactly while loading.
func (c *Cache) checkHostOnly(nd *node) error {
	h := c.tier.host
	switch {
	case h == nil:
		return errors.New("prefix: a node is off the device but no host tier is attached")
	case !nd.onHost:
		return fmt.Errorf("prefix: node %d is on neither tier", nd.hkey)
	case nd.lock != 0:
		return fmt.Errorf("prefix: host-only node %d has lock %d", nd.hkey, nd.lock)
	case c.tier.byKey[nd.hkey] != nd:
		return fmt.Errorf("prefix: host-only node %d is not filed under its key", nd.hkey)
	}
	for k, ch := range nd.children {
		switch {
		case ch.page >= 0:
			return fmt.Errorf("prefix: page %d is on the device below host-only node %d", ch.page, nd.hkey)
		case ch.parent != nd || len(ch.key) != c.ps || blockKey(ch.key) != k:
			return fmt.Errorf("prefix: host-only node %d is misfiled", ch.hkey)
		}
		if err := c.checkHostOnly(ch); err != nil {
			return err
		}
	}
	return nil
}

// checkTier verifies the host tier's bookkeeping against the host pool:
// every node on host has a one-page entry there and the pool holds no other
// pages, keys are filed, a node being loaded is host-only and pinned, and
// the loads are those of live sequences' records.
func (c *Cache) checkTier() error {
	h := c.tier.host
	var err error
	onHost, loading := 0, 0
	c.walkAll(func(nd *node) {
		if err != nil {
			return
		}
		if h == nil {
			if nd.onHost || nd.loading != nil || nd.hkey != 0 || nd.hits != 0 {
				err = fmt.Errorf("prefix: node of page %d has host-tier state without a host tier", nd.page)
			}
			return
		}
		if nd.hkey != 0 && c.tier.byKey[nd.hkey] != nd {
			err = fmt.Errorf("prefix: node %d is not filed under its key", nd.hkey)
			return
		}
		if nd.onHost {
			onHost++
			if h.Len(nd.hkey) != 1 {
				err = fmt.Errorf("prefix: node %d is on host, the host pool holds %d pages for it", nd.hkey, h.Len(nd.hkey))
				return
			}
		} else if nd.hkey != 0 && h.Len(nd.hkey) != 0 {
			err = fmt.Errorf("prefix: node %d is not on host, the host pool holds it", nd.hkey)
			return
		}
		if nd.loading != nil {
			loading++
			// The loader unpins the entry when the load ends, on its own
			// goroutine, before the cache hears of it (at Finish): unpinned
			// is fine once the load is over. Pinned is read first; the
			// loader marks the load over before it unpins.
			if nd.page >= 0 || (!h.Pinned(nd.hkey) && !loadOver(nd.loading)) {
				err = fmt.Errorf("prefix: node %d is loading but on the device or not pinned on host", nd.hkey)
				return
			}
		}
	})
	if err != nil || h == nil {
		return err
	}
	if used := h.UsedPages(); used != onHost {
		return fmt.Errorf("prefix: %d nodes on host, the host pool uses %d pages", onHost, used)
	}
	for k, nd := range c.tier.byKey {
		if nd.hkey != k || (nd.parent == nil && nd != c.root) {
			return fmt.Errorf("prefix: key %d files a node not in the tree", k)
		}
	}
	recorded := 0
	for id, sl := range c.tier.loads {
		if len(sl.nodes) == 0 || !slices.Equal(sl.load.Keys(), keysOf(sl.nodes)) {
			return fmt.Errorf("prefix: seq %d's load is of keys %v, its nodes %v", id, sl.load.Keys(), keysOf(sl.nodes))
		}
		for _, nd := range sl.nodes {
			if nd.loading != sl.load {
				return fmt.Errorf("prefix: seq %d's node %d does not record its load", id, nd.hkey)
			}
		}
		recorded += len(sl.nodes)
	}
	if recorded != loading {
		return fmt.Errorf("prefix: %d nodes loading, %d loads recorded", loading, recorded)
	}
	return nil
}

// loadOver reports whether l has ended (done or aborted).
func loadOver(l *hicache.Load) bool {
	_, _, over := l.Progress()
	return over
}
