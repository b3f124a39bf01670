package prefix

import (
	"context"
	"errors"
	"fmt"

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
//     (kvcache.Pool.Reserve) and queues one Loader load per host-only node
//     into them; the returned Gate (a model.LayerGate) holds the forward
//     pass's reads of each layer until that layer has landed. The pages are
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

// seqLoad is the loads StartLoad queued for one sequence.
type seqLoad struct {
	nodes   []*node
	gate    Gate
	aborted bool // Abort has given up every load's holder
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

// Gate is the loads of one sequence's host-only prefix, a model.LayerGate:
// a layer may be read once every load has landed it.
type Gate []*hicache.Load

// WaitKV waits for layer's K and V of every load.
func (g Gate) WaitKV(ctx context.Context, layer int) error {
	for _, l := range g {
		if err := l.WaitKV(ctx, layer); err != nil {
			return err
		}
	}
	return nil
}

// WaitIndexK waits for layer's index-K rows and scales of every load.
func (g Gate) WaitIndexK(ctx context.Context, layer int) error {
	for _, l := range g {
		if err := l.WaitIndexK(ctx, layer); err != nil {
			return err
		}
	}
	return nil
}

// Wait waits until every load is over and returns the first failure.
func (g Gate) Wait(ctx context.Context) error {
	var first error
	for _, l := range g {
		if err := l.Wait(ctx); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Over reports whether every load is over (done or aborted).
func (g Gate) Over() bool {
	for _, l := range g {
		if _, _, over := l.Progress(); !over {
			return false
		}
	}
	return true
}

// StartLoad loads back the host-only nodes that follow matched (the device
// pages of a MatchHost of tokens) along tokens: s must have started from
// matched (kvcache.Pool.NewSeqWithPrefix, nothing more written or
// reserved). It reserves and commits one fresh page of s per node and
// queues one load per node into it, as many as the loader's ring takes now
// (at least one, or an error). It returns the loads as a Gate for the
// forward pass and the tokens they cover: s's Len grows by that many, and
// its KV there may be read only through the gate. The nodes stay host-only,
// pinned on host, until Finish(s) (after the gate is over) makes them device
// resident on s's pages, or Abort.
func (c *Cache) StartLoad(s *kvcache.Seq, tokens, matched []int32) (Gate, int, error) {
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
	fresh := s.Pages()[len(matched):]
	var gate Gate
	var serr error
	for i, x := range nodes {
		l, err := c.tier.loader.Submit(x.hkey, fresh[i:i+1])
		if err != nil {
			serr = err
			break
		}
		gate = append(gate, l)
	}
	k := len(gate) * c.ps
	// Keep the submitted pages (committed: the gate guards their reads),
	// give the rest back.
	if err := errors.Join(c.pool.Commit(s, k), c.pool.Truncate(s, n+k)); err != nil {
		panic(fmt.Sprintf("prefix: start load: seq %d: %v", s.ID(), err)) // s was checked above
	}
	if len(gate) == 0 {
		return nil, 0, fmt.Errorf("prefix: start load: %w", serr)
	}
	for i, l := range gate {
		nodes[i].loading = l
	}
	c.tier.loads[s.ID()] = &seqLoad{nodes: nodes[:len(gate)], gate: gate}
	return gate, k, nil
}

// Loading is the gate of s's loads, if StartLoad queued some that Finish or
// Abort has not settled.
func (c *Cache) Loading(s *kvcache.Seq) (Gate, bool) {
	sl := c.tier.loads[s.ID()]
	if sl == nil {
		return nil, false
	}
	return sl.gate, true
}

// finishLoad settles s's loads for Finish. Without loads it does nothing
// (handled false). With a load in flight it fails, changing nothing. After
// loads that all landed it lets Finish go on (the nodes become device
// resident through Insert). After a failed load it releases s, freeing the
// loaded pages, and unlocks matched: the host copies stay.
func (c *Cache) finishLoad(s *kvcache.Seq, matched []int32) (handled bool, err error) {
	sl := c.tier.loads[s.ID()]
	if sl == nil {
		return false, nil
	}
	if !sl.gate.Over() {
		return true, fmt.Errorf("prefix: finish seq %d: its load back from host is in flight (wait for the gate or Abort)", s.ID())
	}
	lerr := sl.gate.Wait(context.Background()) // over: returns at once
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

// settle forgets s's loads; every one is over.
func (c *Cache) settle(s *kvcache.Seq, sl *seqLoad) {
	for _, nd := range sl.nodes {
		nd.loading = nil
	}
	delete(c.tier.loads, s.ID())
}

// Abort gives up s's loads from StartLoad: the loader stops at its next
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
		for _, l := range sl.gate {
			_ = l.Abort(context.Background()) // waits below, under ctx
		}
	}
	for _, l := range sl.gate {
		if err := l.Wait(ctx); err != nil && ctx.Err() != nil {
			return err
		}
	}
	c.settle(s, sl)
	return errors.Join(c.pool.Release(s), c.Unlock(matched))
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
			if nd.page >= 0 || !h.Pinned(nd.hkey) {
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
		if len(sl.nodes) != len(sl.gate) || len(sl.nodes) == 0 {
			return fmt.Errorf("prefix: seq %d has %d loading nodes, %d loads", id, len(sl.nodes), len(sl.gate))
		}
		for i, nd := range sl.nodes {
			if nd.loading != sl.gate[i] {
				return fmt.Errorf("prefix: seq %d's load %d is not its node's", id, i)
			}
		}
		recorded += len(sl.nodes)
	}
	if recorded != loading {
		return fmt.Errorf("prefix: %d nodes loading, %d loads recorded", loading, recorded)
	}
	return nil
}
