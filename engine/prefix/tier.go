package prefix

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/engine/hicache"
)

// The host tier (HiCache) of the prefix cache.
//
// AttachHost gives the cache an engine/hicache HostPool, Loader and Writer.
// From then on each node is on the device (its page in the pool, as without
// a tier), on host (a host entry under the node's key holds its page's KV),
// or both:
//
//   - Backups run on the Writer's goroutine, never on the caller's: the
//     loop's steps go on while they copy. Under WriteThrough a node is
//     queued for backup when it is inserted (a finished request's pages
//     indexed); under WriteThroughSelective once it is reused, at the first
//     Match that passes through it. Either way only when its parent is on
//     host or queued already (the writer is FIFO), so that what is on host
//     is always a path from the root. Under
//     WriteBack a node is backed up when Evict takes it off the device:
//     Evict queues the backups of the nodes it takes and waits for them
//     before it frees their pages (a page being copied stays allocated). A
//     finished backup is taken in (the node marked on host, the host pool's
//     evictions applied to the tree) at the next Match, MatchHost, Evict or
//     Check.
//   - Device eviction. Evict takes a node with no child on the device; if the
//     node is on host it stays in the tree as host-only, else it goes with
//     its host-only subtree. A node whose backup is in flight is waited for
//     first. So the nodes on the device are always a path-closed set from
//     the root, and below them hang host-only nodes.
//   - Host eviction. The host pool evicts its least recently used unpinned
//     entries when a backup needs room; the cache forgets those copies: a
//     node on both stays on the device, a host-only node goes with its
//     (host-only) subtree. Entries a MatchHost counted are pinned, and stay
//     pinned while LoadBack loads them until the load settles or is
//     abandoned, and are never evicted.
//   - Load-back. MatchHost is Match plus the host-only nodes that follow the
//     device match, pinned on host until LoadBack. LoadBack gives those nodes
//     fresh device pages that the cache holds (kvcache.Pool.AllocCached),
//     makes them device nodes at once, locked for the caller like a Match,
//     and queues one Loader load of all of them into those pages (one ring
//     slot, layer by layer across the nodes). Until the load settles the
//     nodes are "loading": anyone who matches them (concurrent hits share
//     the load) must read their pages only through the gate of Gate(pages),
//     a model.LayerGate. Settle, called once a forward pass has read through
//     the gates, waits for the load to be over and makes the nodes plain
//     device nodes. Until then the tier holds a lock of its own on the
//     load's nodes (none is evicted, even one no request reads), and their
//     host entries stay pinned. A load whose nodes lose their last
//     request's lock before it settled (its requests aborted) is abandoned:
//     the loader stops, the device pages are freed (with any unlocked pages
//     a request inserted below them) and the nodes are host-only again,
//     their host copies intact. Whether a load happened to finish first
//     does not matter: the outcome is the same on every rank.
//
// Device state stays the same on every rank that runs the same calls: the
// host tier changes only which nodes are on host, and that is what may
// differ between ranks (backups finish on each rank's own writer). Callers
// that drive several ranks agree on host hits by reducing MatchHost's counts
// before LoadBack.
//
// The cache is the only user of its host pool's entries, one host page per
// node. Without AttachHost nothing here runs and the cache behaves exactly
// as it does without a tier.

// Policy is when the cache backs a node up to host.
type Policy int

// The policies are SGLang's three, by their names (its write_through,
// write_through_selective and write_back).
const (
	// WriteThrough backs a node up as soon as it is cached (inserted):
	// the host tier then holds every prefix the device held, so that one
	// evicted before it came back still loads from host (the default).
	WriteThrough Policy = iota
	// WriteThroughSelective backs a node up once a Match reuses it: only
	// prefixes that came back once go to host.
	WriteThroughSelective
	// WriteBack backs a node up when it is evicted from the device.
	WriteBack
)

// Policies lists the policies in the order help texts name them.
var Policies = []Policy{WriteThrough, WriteThroughSelective, WriteBack}

func (p Policy) String() string {
	switch p {
	case WriteThrough:
		return "write-through"
	case WriteThroughSelective:
		return "write-through-selective"
	case WriteBack:
		return "write-back"
	}
	return fmt.Sprintf("Policy(%d)", int(p))
}

// ParsePolicy reads a policy's name.
func ParsePolicy(s string) (Policy, error) {
	for _, p := range Policies {
		if p.String() == s {
			return p, nil
		}
	}
	return 0, fmt.Errorf("prefix: unknown write policy %q (%s)", s, PolicyNames())
}

// PolicyNames is the policies' names, for a help text or an error.
func PolicyNames() string {
	names := make([]string, len(Policies))
	for i, p := range Policies {
		names[i] = p.String()
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// valid reports whether p is one of the policies.
func (p Policy) valid() bool { return slices.Contains(Policies, p) }

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

// waitBound bounds the cache's own waits for the loader and the writer:
// each waits for copies that need nothing but those goroutines, so running
// past it means one of them is stuck.
const waitBound = time.Minute

// tierState is the cache's host tier; the zero value is none.
type tierState struct {
	host    *hicache.HostPool
	loader  *hicache.Loader
	writer  *hicache.Writer
	policy  Policy
	nextKey hicache.Key
	byKey   map[hicache.Key]*node
	loads   map[*hicache.Load][]*node // unsettled loads, their nodes in path order
	backups []*node                   // nodes with a backup in flight, in submission order

	stats TierStats
}

// TierStats are the tier's counts, as the loop sees them.
type TierStats struct {
	HostHits      uint64 // LoadBacks that loaded something
	HitTokens     uint64 // tokens they loaded
	Abandoned     uint64 // loads given up because their requests went
	DroppedTokens uint64 // host-only tokens forgotten (host eviction or detach)
}

// ErrNoHost: the cache has no host tier attached.
var ErrNoHost = errors.New("prefix: no host tier attached")

// AttachHost gives the cache a host tier: host must be shaped for the
// cache's pool, empty and used by nothing else, and loader and writer must
// copy between host and the cache's pool. It fails when a tier is attached.
func (c *Cache) AttachHost(host *hicache.HostPool, loader *hicache.Loader, writer *hicache.Writer, policy Policy) error {
	switch {
	case host == nil || loader == nil || writer == nil:
		return errors.New("prefix: attach host: nil host pool, loader or writer")
	case c.tier.host != nil:
		return errors.New("prefix: attach host: a host tier is already attached")
	case !policy.valid():
		return fmt.Errorf("prefix: attach host: unknown policy %v", policy)
	case host.UsedPages() != 0:
		return errors.New("prefix: attach host: the host pool is not empty")
	}
	c.tier = tierState{
		host: host, loader: loader, writer: writer, policy: policy,
		byKey: map[hicache.Key]*node{}, loads: map[*hicache.Load][]*node{},
		stats: c.tier.stats,
	}
	return nil
}

// DetachHost takes the host tier off: loads in flight finish and settle,
// backups in flight finish, host-only nodes are forgotten, the loader and
// writer are closed, and the host pool is no longer referenced (its memory
// goes back). Device nodes stay as they are. It returns the host pool
// (empty of the cache's use) for the caller to drop, nil without a tier.
// Call it between a LoadBack and the next MatchHost (no host pins held). It
// fails when ctx ends while waiting; call it again to finish.
func (c *Cache) DetachHost(ctx context.Context) (*hicache.HostPool, error) {
	t := &c.tier
	if t.host == nil {
		return nil, nil
	}
	for l := range t.loads {
		if err := c.settle(ctx, l); err != nil {
			return nil, fmt.Errorf("prefix: detach host: %w", err)
		}
	}
	if err := c.waitBackups(ctx); err != nil {
		return nil, fmt.Errorf("prefix: detach host: %w", err)
	}
	var hostOnly []*node
	c.walkAll(func(nd *node) {
		if nd.page < 0 && (nd.parent == c.root || nd.parent.page >= 0) {
			hostOnly = append(hostOnly, nd)
		}
	})
	for _, nd := range hostOnly {
		c.tier.stats.DroppedTokens += uint64(c.ps * subtreeSize(nd))
		c.drop(nd)
	}
	c.walkAll(func(nd *node) {
		if nd.onHost {
			if err := t.host.Remove(nd.hkey); err != nil {
				panic(fmt.Sprintf("prefix: detach host: node %d: %v", nd.hkey, err)) // nothing pins it now
			}
		}
		nd.onHost, nd.hkey, nd.hits = false, 0, 0
	})
	t.loader.Close()
	t.writer.Close()
	host := t.host
	c.tier = tierState{stats: t.stats}
	return host, nil
}

func subtreeSize(nd *node) int {
	n := 1
	for _, ch := range nd.children {
		n += subtreeSize(ch)
	}
	return n
}

// Attached reports whether a host tier is attached.
func (c *Cache) Attached() bool { return c.tier.host != nil }

// Policy is the attached tier's write policy (WriteThrough without one).
func (c *Cache) Policy() Policy { return c.tier.policy }

// Host, Loader and Writer are the attached tier's parts (nil without one).
func (c *Cache) Host() *hicache.HostPool   { return c.tier.host }
func (c *Cache) Loader() *hicache.Loader   { return c.tier.loader }
func (c *Cache) Writer() *hicache.Writer   { return c.tier.writer }
func (c *Cache) TierStats() TierStats      { return c.tier.stats }
func (c *Cache) LoadsInFlight() []LoadInfo { return c.loadInfos() }

// LoadInfo is one unsettled load, for a debug API.
type LoadInfo struct {
	Load  *hicache.Load
	Pages []int32 // device pages, in path order
}

func (c *Cache) loadInfos() []LoadInfo {
	out := make([]LoadInfo, 0, len(c.tier.loads))
	for l, nodes := range c.tier.loads {
		li := LoadInfo{Load: l}
		for _, nd := range nodes {
			li.Pages = append(li.Pages, nd.page)
		}
		out = append(out, li)
	}
	slices.SortFunc(out, func(a, b LoadInfo) int { return int(a.Pages[0]) - int(b.Pages[0]) })
	return out
}

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

// walkAll calls f on every node below the root, parents before children.
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

// hit counts a Match through the path ending at nd, marks its nodes'
// host copies used and, under WriteThroughSelective, queues backups of the
// path's reused nodes, root first.
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
		if x.onHost {
			// A prefix in use on the device is one to keep on host too:
			// the host pool evicts by use, as the device does.
			c.tier.host.Touch(x.hkey)
		}
		if c.tier.policy == WriteThroughSelective {
			c.backUpInPath(x)
		}
	}
}

// backUpInPath queues a backup of device node x when it has none and its
// parent is on host or queued (the root's children always are), so that
// the host copies stay path-closed from the root.
func (c *Cache) backUpInPath(x *node) {
	if !x.onHost && x.backup == nil && x.loading == nil && x.page >= 0 &&
		(x.parent == c.root || x.parent.onHost || x.parent.backup != nil) {
		c.queueBackup(x)
	}
}

// inserted queues, under WriteThrough, the backup of a node Insert just
// put on the device (its path's nodes come root first).
func (c *Cache) inserted(x *node) {
	if c.tier.host != nil && c.tier.policy == WriteThrough {
		c.backUpInPath(x)
	}
}

// queueBackup queues a backup of device node nd's page.
func (c *Cache) queueBackup(nd *node) {
	if nd.hkey == 0 {
		c.tier.nextKey++
		nd.hkey = c.tier.nextKey
		c.tier.byKey[nd.hkey] = nd
	}
	b, err := c.tier.writer.Submit(nd.hkey, []int32{nd.page})
	if err != nil {
		return // closed: the tier is being detached; the node stays device only
	}
	nd.backup = b
	c.tier.backups = append(c.tier.backups, nd)
}

// reap takes in the backups that finished: their nodes are on host now (or
// not, if the backup failed), and the host pool's evictions are applied.
func (c *Cache) reap() {
	if c.tier.host == nil || len(c.tier.backups) == 0 {
		return
	}
	keep := c.tier.backups[:0]
	for _, nd := range c.tier.backups {
		if !nd.backup.Done() {
			keep = append(keep, nd)
			continue
		}
		c.takeBackup(nd)
	}
	clear(c.tier.backups[len(keep):])
	c.tier.backups = keep
}

// takeBackup applies nd's finished backup. It does not touch tier.backups.
func (c *Cache) takeBackup(nd *node) {
	evicted, err := nd.backup.Wait(context.Background()) // over: returns at once
	nd.backup = nil
	c.forget(evicted)
	if err == nil {
		nd.onHost = true
	}
}

// waitBackup waits for nd's backup in flight and applies it, and before it
// every backup submitted earlier (over too: the writer is FIFO), in
// submission order: a later backup may have evicted an earlier one's entry,
// and taking the earlier one in after would mark its node on host again.
func (c *Cache) waitBackup(ctx context.Context, nd *node) error {
	for len(c.tier.backups) > 0 {
		x := c.tier.backups[0]
		if _, err := x.backup.Wait(ctx); ctx.Err() != nil {
			return fmt.Errorf("waiting for the backup of node %d: %w", x.hkey, err)
		}
		c.takeBackup(x)
		c.tier.backups[0] = nil
		c.tier.backups = c.tier.backups[1:]
		if x == nd {
			break
		}
	}
	return nil
}

// waitBackups waits for every backup in flight and applies them.
func (c *Cache) waitBackups(ctx context.Context) error {
	for len(c.tier.backups) > 0 {
		if err := c.waitBackup(ctx, c.tier.backups[0]); err != nil {
			return err
		}
	}
	return nil
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
			c.tier.stats.DroppedTokens += uint64(c.ps * subtreeSize(nd))
			c.drop(nd)
		}
	}
}

// evictOff takes device node nd, being evicted, off the device: it waits
// for its backup in flight (the page must stay until copied), backs it up
// now under WriteBack, and reports whether it stays in the tree as a
// host-only node. A wait that runs past waitBound panics: the writer needs
// nothing from the loop to finish a copy.
func (c *Cache) evictOff(nd *node) bool {
	if c.tier.host == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	// Under WriteBack every node taken off the device is backed up, not
	// only those whose parent is on host: Evict takes leaves first, so a
	// parent is never on host yet and only the root's children would be.
	if nd.backup == nil && !nd.onHost && c.tier.policy == WriteBack {
		c.queueBackup(nd)
	}
	if nd.backup != nil {
		if err := c.waitBackup(ctx, nd); err != nil {
			panic(fmt.Sprintf("prefix: evict: %v", err))
		}
	}
	return nd.onHost
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
			// A backup that is over but not taken in yet may have evicted
			// the entry already; its forget finds the key gone.
			if err := c.tier.host.Remove(x.hkey); err != nil && !errors.Is(err, hicache.ErrNotOnHost) {
				// Only a load or a MatchHost pins an entry: a load's nodes
				// are on the device, and MatchHost pins whole paths from
				// the device boundary, so a pinned node's ancestors up to
				// that boundary are pinned too and never evicted.
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

// HostMatch is a Match extended by the host-only nodes that follow it.
type HostMatch struct {
	Pages []int32 // the device match's pages (locked, as Match)
	N     int     // the device match's tokens
	Host  int     // tokens past N on host only (whole pages), pinned on host
	nodes []*node // the host-only nodes, in path order
}

// MatchHost is Match plus the host-only nodes that follow the device match
// along tokens: Host tokens that LoadBack could load. Their host entries
// are pinned until LoadBack (every MatchHost needs one LoadBack, which also
// takes the device match's place). Without a host tier Host is 0.
func (c *Cache) MatchHost(tokens []int32) HostMatch {
	pages, n := c.Match(tokens)
	hm := HostMatch{Pages: pages, N: n}
	if c.tier.host == nil {
		return hm
	}
	nd := c.root
	if len(pages) > 0 {
		nd = c.byPage[pages[len(pages)-1]]
	}
	for len(tokens)-n-hm.Host >= c.ps {
		at := n + hm.Host
		child := nd.children[blockKey(tokens[at:at+c.ps])]
		if child == nil || child.page >= 0 || !c.tier.host.Pin(child.hkey) {
			break
		}
		hm.nodes = append(hm.nodes, child)
		hm.Host += c.ps
		nd = child
	}
	return hm
}

// Free is how many pages LoadBack could give a load now: free pages plus
// those Evict could free.
func (c *Cache) Free() int { return c.pool.FreePages() + c.Evictable() }

// LoadBack loads the first upTo-hm.N of hm's host tokens back (upTo is
// between hm.N and hm.N+hm.Host, whole pages; hm.N loads nothing), evicting
// cached pages for room, and lets go of hm's host pins (those of the nodes
// it loads when their load settles or is abandoned). It returns the
// locked page path of the prefix now on the device (hm.Pages extended by the
// loaded nodes; Unlock it, or Finish a sequence started from it, as after
// Match) and its length in tokens. Until Settle, read the loaded pages only
// through Gate. It loads nothing, and returns hm's own match, when the pool
// has fewer than the pages needed free or evictable (check Free first: that
// outcome is the same on every rank with the same device state). It fails
// only when the loader does (closed, or ctx ended waiting for a ring slot);
// then hm's match stays locked and nothing else changed.
func (c *Cache) LoadBack(ctx context.Context, tokens []int32, hm HostMatch, upTo int) ([]int32, int, error) {
	var kept []*node // nodes whose pins pass to the load, until it settles or is abandoned
	defer func() {
		for _, nd := range hm.nodes {
			if !slices.Contains(kept, nd) {
				c.tier.host.Unpin(nd.hkey)
			}
		}
	}()
	k := (upTo - hm.N) / c.ps
	switch {
	case upTo == hm.N:
		return hm.Pages, hm.N, nil
	case upTo < hm.N || upTo > hm.N+hm.Host || (upTo-hm.N)%c.ps != 0:
		return nil, 0, fmt.Errorf("prefix: load back to %d tokens: the match has %d on the device and %d on host", upTo, hm.N, hm.Host)
	}
	// Since MatchHost, another LoadBack (or an Insert) may have brought the
	// first of these nodes to the device: share them (a load in flight is
	// shared through Gate) and load the rest.
	path := hm.nodes[:k]
	on := 0
	for on < k && path[on].page >= 0 {
		on++
	}
	nodes := path[on:]
	// The shared nodes may be unlocked (their loader's requests went):
	// lock them while room is made, so that Evict does not take them off
	// the device from under the nodes loaded below them.
	shared := func(d int) {
		if on > 0 {
			c.lockPath(path[on-1], d)
		}
	}
	shared(1)
	if c.Free() < len(nodes) {
		shared(-1)
		return hm.Pages, hm.N, nil
	}
	c.clock++
	if len(nodes) > 0 {
		if short := len(nodes) - c.pool.FreePages(); short > 0 {
			c.Evict(short) // hm's match and the shared nodes are locked, its host nodes are not on the device
		}
		pages, err := c.pool.AllocCached(len(nodes))
		if err != nil {
			panic(fmt.Sprintf("prefix: load back: %v", err)) // Free said there was room
		}
		l, err := c.tier.loader.SubmitKeysWait(ctx, keysOf(nodes), pages)
		if err != nil {
			shared(-1)
			if ferr := c.pool.FreeCached(pages); ferr != nil {
				panic(fmt.Sprintf("prefix: load back: %v", ferr))
			}
			return nil, 0, fmt.Errorf("prefix: load back: %w", err)
		}
		for i, nd := range nodes {
			nd.page = pages[i]
			c.byPage[nd.page] = nd
			nd.loading = l
		}
		c.tier.loads[l] = slices.Clone(nodes)
		// The tier holds a lock of its own on the load's path until it
		// settles or is abandoned: a request that reads only its first
		// nodes keeps it going, and the others must not be evicted.
		c.lockPath(nodes[len(nodes)-1], 1)
		kept = nodes
		c.tier.stats.HostHits++
		c.tier.stats.HitTokens += uint64(len(nodes) * c.ps)
	}
	shared(-1)
	// The lock moves from the device match to the whole path: the new lock
	// first, so that Unlock does not abandon a load just made.
	end := path[k-1]
	c.locks[end]++
	for x := end; x != c.root; x = x.parent {
		x.lock++
		x.last = c.clock
	}
	if err := c.Unlock(hm.Pages); err != nil {
		panic(fmt.Sprintf("prefix: load back: %v", err)) // hm's match is locked
	}
	out := slices.Clone(hm.Pages)
	for _, nd := range path {
		out = append(out, nd.page)
	}
	return out, upTo, nil
}

// Gate is the gate of a sequence reading the page path pages: the unsettled
// loads along it (nil when there are none).
func (c *Cache) Gate(pages []int32) hicache.Loads {
	if len(c.tier.loads) == 0 {
		return nil
	}
	var out hicache.Loads
	for _, pg := range pages {
		if nd := c.byPage[pg]; nd != nil && nd.loading != nil && !slices.Contains(out, nd.loading) {
			out = append(out, nd.loading)
		}
	}
	return out
}

// Settle waits for each of loads (from Gate) to be over and makes its nodes
// plain device nodes. Call it after a forward pass read through the gates,
// before anything else reads the pages. A load that failed is an error: the
// forward pass that read through its gate failed too.
func (c *Cache) Settle(ctx context.Context, loads hicache.Loads) error {
	for _, l := range loads {
		if err := c.settle(ctx, l); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cache) settle(ctx context.Context, l *hicache.Load) error {
	nodes, ok := c.tier.loads[l]
	if !ok {
		return nil // settled already
	}
	if err := l.Wait(ctx); err != nil {
		return fmt.Errorf("prefix: settling a load back from host: %w", err)
	}
	for _, nd := range nodes {
		nd.loading = nil
		c.tier.host.Unpin(nd.hkey)
	}
	c.lockPath(nodes[len(nodes)-1], -1)
	delete(c.tier.loads, l)
	return nil
}

// lockPath takes (d 1) or lets go of (d -1) the tier's own match lock on the
// path that ends at end.
func (c *Cache) lockPath(end *node, d int) {
	if c.locks[end] += d; c.locks[end] == 0 {
		delete(c.locks, end)
	}
	for x := end; x != c.root; x = x.parent {
		x.lock += d
	}
}

// loadsThrough is the number of unsettled loads whose path passes through
// nd: the tier's own locks on nd.
func (c *Cache) loadsThrough(nd *node) int {
	n := 0
	for _, nodes := range c.tier.loads {
		for x := nodes[len(nodes)-1]; x != c.root; x = x.parent {
			if x == nd {
				n++
				break
			}
		}
	}
	return n
}

// abandon gives up the unsettled loads whose nodes no lock but the tier's
// holds any more (every request reading them went): the loader stops, their
// device pages are freed and the nodes are host-only again.
func (c *Cache) abandon() {
	// Deepest first: loads stacked on one path go together, and a load's
	// last node may have a device child only while the load below it stays.
	var gone []*hicache.Load
	for l, nodes := range c.tier.loads {
		if nodes[0].lock == c.loadsThrough(nodes[0]) { // a lock on a deeper node locks the first too
			gone = append(gone, l)
		}
	}
	depth := func(l *hicache.Load) int {
		d := 0
		for x := c.tier.loads[l][0]; x != c.root; x = x.parent {
			d++
		}
		return d
	}
	slices.SortFunc(gone, func(a, b *hicache.Load) int { return depth(b) - depth(a) })
	for _, l := range gone {
		nodes := c.tier.loads[l]
		c.lockPath(nodes[len(nodes)-1], -1)
		ctx, cancel := context.WithTimeout(context.Background(), waitBound)
		err := l.Abort(ctx)
		if err == nil {
			_ = l.Wait(ctx) // over; a load that landed first is given up all the same
		}
		late := ctx.Err() != nil
		cancel()
		if late {
			panic(fmt.Sprintf("prefix: abandoning a load back from host: the loader did not let go in %v", waitBound))
		}
		// A request that matched before the load and computed these nodes
		// itself may have inserted its deeper pages below them (Insert
		// keeps a loading node and frees the request's own page for it):
		// no lock holds them, and they go off the device first, as Evict
		// would take them.
		for i, nd := range nodes {
			for _, ch := range nd.children {
				if ch.page >= 0 && (i == len(nodes)-1 || ch != nodes[i+1]) {
					c.evictBelow(ch)
				}
			}
		}
		pages := make([]int32, len(nodes))
		for i, nd := range nodes {
			if c.hasDeviceChild(nd) && (i == len(nodes)-1 || c.hasOtherDeviceChild(nd, nodes[i+1])) {
				panic(fmt.Sprintf("prefix: abandoning a load: node %d has a device child nobody locks", nd.hkey))
			}
			pages[i] = nd.page
			delete(c.byPage, nd.page)
			nd.page, nd.loading = -1, nil
			c.tier.host.Unpin(nd.hkey)
		}
		if err := c.pool.FreeCached(pages); err != nil {
			panic(fmt.Sprintf("prefix: abandoning a load: %v", err)) // unlocked, so no sequence holds them
		}
		delete(c.tier.loads, l)
		c.tier.stats.Abandoned++
	}
}

// evictBelow takes device node nd and its device subtree, which no lock and
// no sequence holds, off the device as Evict would, leaves first.
func (c *Cache) evictBelow(nd *node) {
	for _, ch := range nd.children {
		if ch.page >= 0 {
			c.evictBelow(ch)
		}
	}
	pg := nd.page
	if nd.lock != 0 || nd.loading != nil || c.pool.Refs(pg) != 1 {
		panic(fmt.Sprintf("prefix: abandoning a load: page %d below it is locked, loading or in use", pg))
	}
	delete(c.byPage, pg)
	if c.evictOff(nd) {
		nd.page = -1
	} else {
		c.drop(nd)
	}
	if err := c.pool.FreeCached([]int32{pg}); err != nil {
		panic(fmt.Sprintf("prefix: abandoning a load: %v", err))
	}
}

// hasOtherDeviceChild reports whether nd has a device child besides next.
func (c *Cache) hasOtherDeviceChild(nd, next *node) bool {
	for _, ch := range nd.children {
		if ch != next && ch.page >= 0 {
			return true
		}
	}
	return false
}

func keysOf(nodes []*node) []hicache.Key {
	keys := make([]hicache.Key, len(nodes))
	for i, nd := range nodes {
		keys[i] = nd.hkey
	}
	return keys
}

// checkHostOnly verifies host-only node nd and its subtree: all off the
// device and on host, unlocked, not loading or backing up, and filed under
// their keys.
func (c *Cache) checkHostOnly(nd *node) error {
	h := c.tier.host
	switch {
	case h == nil:
		return errors.New("prefix: a node is off the device but no host tier is attached")
	case !nd.onHost:
		return fmt.Errorf("prefix: node %d is on neither tier", nd.hkey)
	case nd.lock != 0:
		return fmt.Errorf("prefix: host-only node %d has lock %d", nd.hkey, nd.lock)
	case nd.loading != nil || nd.backup != nil:
		return fmt.Errorf("prefix: host-only node %d is loading or backing up", nd.hkey)
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

// checkTier verifies the host tier's bookkeeping against the host pool,
// after waiting for the backups in flight: every node on host has a
// one-page entry there and the pool holds no other pages, keys are filed,
// a loading node is on the device, locked, recorded under its load and
// pinned on host while the load runs, and every unsettled load's nodes are
// a chain.
func (c *Cache) checkTier() error {
	h := c.tier.host
	if h != nil && h.Closed() {
		return nil // its owner closed it, entries and all: nothing to match
	}
	if h != nil {
		ctx, cancel := context.WithTimeout(context.Background(), waitBound)
		defer cancel()
		if err := c.waitBackups(ctx); err != nil {
			return fmt.Errorf("prefix: check: %w", err)
		}
	}
	var err error
	onHost, loading := 0, 0
	c.walkAll(func(nd *node) {
		if err != nil {
			return
		}
		if h == nil {
			if nd.onHost || nd.loading != nil || nd.backup != nil || nd.hkey != 0 || nd.hits != 0 {
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
			// The cache pins a loading node's entry (MatchHost's pin)
			// until the load settles or is abandoned.
			switch {
			case nd.page < 0 || nd.lock == 0 || !nd.onHost:
				err = fmt.Errorf("prefix: node %d is loading but off the device, unlocked or not on host", nd.hkey)
			case !h.Pinned(nd.hkey):
				err = fmt.Errorf("prefix: node %d is loading but not pinned on host", nd.hkey)
			case !slices.Contains(c.tier.loads[nd.loading], nd):
				err = fmt.Errorf("prefix: node %d's load is not recorded", nd.hkey)
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
	for l, nodes := range c.tier.loads {
		if len(nodes) == 0 || !slices.Equal(l.Keys(), keysOf(nodes)) {
			return fmt.Errorf("prefix: a load is of keys %v, its nodes %v", l.Keys(), keysOf(nodes))
		}
		for i, nd := range nodes {
			if nd.loading != l || (i > 0 && nd.parent != nodes[i-1]) {
				return fmt.Errorf("prefix: node %d of a load does not record it or is not a chain", nd.hkey)
			}
		}
		recorded += len(nodes)
	}
	if recorded != loading {
		return fmt.Errorf("prefix: %d nodes loading, %d recorded under loads", loading, recorded)
	}
	return nil
}

// Offload moves the cached prefix of tokens (its whole pages, as far as the
// tree has them on the device) to the host tier: every node on the path is
// backed up (the writer's copies are waited for), then what hangs below the
// path on the device goes (all of it, or nothing if some of it is in use),
// and the path is taken off the device deepest first, as Evict would take
// it, for as long as its nodes are evictable and have no other child on the
// device. A node whose backup failed (host pool full of pinned entries) goes
// instead of staying on host. Which nodes leave the device depends on the
// device state alone, so ranks that agree on it still do after Offload. It
// returns the tokens this call moved to host only (a path already there
// counts 0). Operators and tests use it to make the next request with that
// prefix load it back.
func (c *Cache) Offload(ctx context.Context, tokens []int32) (int, error) {
	if c.tier.host == nil {
		return 0, ErrNoHost
	}
	c.reap()
	var path []*node
	nd := c.root
	for n := 0; len(tokens)-n >= c.ps; n += c.ps {
		ch := nd.children[blockKey(tokens[n:n+c.ps])]
		if ch == nil || ch.page < 0 || ch.loading != nil {
			break
		}
		path = append(path, ch)
		nd = ch
	}
	for _, x := range path {
		if !x.onHost && x.backup == nil {
			c.queueBackup(x)
		}
	}
	// Every backup in flight is waited for, not only the path's: whether
	// a node below the path may leave the device must not depend on
	// whether its backup happened to finish on this rank's writer.
	if err := c.waitBackups(ctx); err != nil {
		return 0, fmt.Errorf("prefix: offload: %w", err)
	}
	var freed []int32
	takeOff := func(x *node) {
		freed = append(freed, x.page)
		delete(c.byPage, x.page)
		if x.onHost {
			x.page = -1
		} else {
			c.drop(x)
		}
	}
	// What hangs below the path on the device (the cached continuations
	// of the prompt) goes first, children before parents, if all of it
	// can: the device stays path-closed.
	if len(path) > 0 {
		var below []*node
		var walk func(*node) bool
		walk = func(x *node) bool {
			for _, ch := range x.children {
				if ch.page < 0 {
					continue
				}
				if !walk(ch) || !c.evictable(ch) || ch.loading != nil {
					return false
				}
				below = append(below, ch)
			}
			return true
		}
		if !walk(path[len(path)-1]) {
			below, path = nil, nil
		}
		for _, x := range below {
			takeOff(x)
		}
	}
	for i := len(path) - 1; i >= 0; i-- {
		x := path[i]
		if !c.evictable(x) || c.hasDeviceChild(x) {
			break
		}
		takeOff(x)
	}
	if err := c.pool.FreeCached(freed); err != nil {
		panic(fmt.Sprintf("prefix: offload: %v", err)) // evictable pages are held by the cache alone
	}
	off := 0
	for _, x := range path {
		if x.parent != nil && x.page < 0 {
			off += c.ps
		}
	}
	return off, nil
}
