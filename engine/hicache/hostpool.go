package hicache

import (
	"container/list"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/pdkit/pdkit/engine/kvcache"
)

// Key names one backed-up entry: the pages of one cached prefix node. The
// caller chooses it (e.g. a radix node's id); loads are deduplicated by it.
type Key uint64

// entry is the host pages backed up under one key, in the order the device
// pages were given.
type entry struct {
	key     Key
	pages   []int32
	pins    int           // loads in flight that read the pages
	writing bool          // Backup is copying into the pages; not yet visible
	elem    *list.Element // in lru once published
}

// HostPool is one rank's host tier: whole pages in host memory, in the page
// layout of Layout, grouped into entries by key and evicted least recently
// used first. It is safe for concurrent use. Its memory is mapped outside
// the Go heap and returned to the OS by Close.
type HostPool struct {
	layout Layout
	total  int
	mem    []byte // total * layout.PageBytes; nil once closed

	mu      sync.Mutex
	closed  bool
	copiers int     // open Loaders and Writers, the pool's only copiers
	free    []int32 // stack of free host pages; top is the end
	used    int
	entries map[Key]*entry
	lru     *list.List // of *entry, most recently used at the front
}

// NewHostPool makes a host pool of pages pages shaped for device pool
// configuration dev. It refuses a pool whose bytes exceed available (the
// host memory the caller grants the tier).
func NewHostPool(dev kvcache.Config, pages int, available int64) (*HostPool, error) {
	l, err := LayoutOf(dev)
	if err != nil {
		return nil, err
	}
	if pages <= 0 || pages > math.MaxInt32 {
		return nil, fmt.Errorf("hicache: host pool of %d pages, want 1..%d", pages, math.MaxInt32)
	}
	if int64(pages) > math.MaxInt64/int64(l.PageBytes) || int64(pages)*int64(l.PageBytes) > available {
		return nil, fmt.Errorf("%w: %d pages of %d bytes, %d bytes available", ErrHostMemory, pages, l.PageBytes, available)
	}
	mem, err := mapHost(pages * l.PageBytes)
	if err != nil {
		return nil, fmt.Errorf("%w: mapping %d pages of %d bytes: %v", ErrHostMemory, pages, l.PageBytes, err)
	}
	mapped.Add(int64(len(mem)))
	h := &HostPool{
		layout:  l,
		total:   pages,
		mem:     mem,
		free:    make([]int32, pages),
		entries: make(map[Key]*entry),
		lru:     list.New(),
	}
	for i := range h.free {
		h.free[i] = int32(pages - 1 - i) // page 0 first
	}
	return h, nil
}

// Closed reports whether Close gave the pool's memory back.
func (h *HostPool) Closed() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.closed
}

// addCopier counts a new Loader or Writer on the pool (d 1) or one closed
// (d -1); a closed pool takes none.
func (h *HostPool) addCopier(d int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed && d > 0 {
		return ErrPoolClosed
	}
	h.copiers += d
	return nil
}

// mapped is the bytes of every open host pool in the process.
var mapped atomic.Int64

// MappedBytes is the host memory the process's open host pools hold: what
// a tier switched off or a rebuilt rank group must have given back.
func MappedBytes() int64 { return mapped.Load() }

// Close returns the pool's memory to the OS; every later Backup or load is
// refused. It refuses, and keeps the memory, while a Loader or Writer on
// the pool is open or a Backup is copying, since they read and write the
// memory off the caller's goroutine; pins are bookkeeping and go with the
// entries. Closing twice is a no-op.
func (h *HostPool) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	if h.copiers > 0 {
		return fmt.Errorf("hicache: closing the host pool with %d loaders and writers open", h.copiers)
	}
	for _, e := range h.entries {
		if e.writing {
			return fmt.Errorf("%w: closing the host pool while key %d is being written", ErrPinned, e.key)
		}
	}
	if err := unmapHost(h.mem); err != nil {
		return fmt.Errorf("hicache: unmapping the host pool: %w", err)
	}
	mapped.Add(-int64(len(h.mem)))
	h.closed, h.mem = true, nil
	clear(h.entries)
	h.lru.Init()
	h.free, h.used = nil, 0
	return nil
}

// Layout is the pool's page layout.
func (h *HostPool) Layout() Layout { return h.layout }

// Bytes is the host memory the pool's pages take.
func (h *HostPool) Bytes() int64 { return int64(h.total) * int64(h.layout.PageBytes) }

// TotalPages is the number of host pages.
func (h *HostPool) TotalPages() int { return h.total }

// UsedPages is the number of host pages held by entries (including ones
// being written).
func (h *HostPool) UsedPages() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.used
}

// FreePages is the number of host pages no entry holds.
func (h *HostPool) FreePages() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.free)
}

// Has reports whether key is backed up and readable.
func (h *HostPool) Has(key Key) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.entries[key]
	return ok && !e.writing
}

// Len is the number of pages backed up under key, 0 when it is not on host.
func (h *HostPool) Len(key Key) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	if e, ok := h.entries[key]; ok && !e.writing {
		return len(e.pages)
	}
	return 0
}

// Pinned reports whether a load in flight pins key's entry.
func (h *HostPool) Pinned(key Key) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.entries[key]
	return ok && e.pins > 0
}

// Touch marks key as just used (a hit), moving it away from eviction. It
// reports whether key is on host.
func (h *HostPool) Touch(key Key) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.entries[key]
	if !ok || e.writing {
		return false
	}
	h.lru.MoveToFront(e.elem)
	return true
}

// Backup copies device pages devPages of dev (every layer's K, V, index-K
// rows and scales) into fresh host pages under key, evicting least recently
// used unpinned entries if it must; their keys are returned so that the
// caller can forget them. It is all or nothing: on error nothing is evicted.
// A closed pool refuses it (ErrPoolClosed).
//
// The device pages must hold committed KV that nobody writes during the copy
// (e.g. pages the prefix cache holds); Backup only reads them and may run off
// the pool's loop.
func (h *HostPool) Backup(key Key, dev *kvcache.Pool, devPages []int32) (evicted []Key, err error) {
	if err := h.layout.check(dev.Config()); err != nil {
		return nil, err
	}
	if err := checkDevicePages(devPages, dev.TotalPages()); err != nil {
		return nil, err
	}
	e, evicted, err := h.reserve(key, len(devPages))
	if err != nil {
		return nil, err
	}
	if err := h.copyFromDevice(e.pages, dev, devPages); err != nil {
		h.mu.Lock()
		h.drop(e)
		h.mu.Unlock()
		return evicted, err
	}
	h.mu.Lock()
	e.writing = false
	e.elem = h.lru.PushFront(e)
	h.mu.Unlock()
	return evicted, nil
}

// reserve takes n host pages for a new entry under key, in the writing
// state, evicting unpinned entries from the LRU end as needed.
func (h *HostPool) reserve(key Key, n int) (*entry, []Key, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, nil, ErrPoolClosed
	}
	if _, ok := h.entries[key]; ok {
		return nil, nil, fmt.Errorf("%w: %d", ErrExists, key)
	}
	evictable := len(h.free)
	for el := h.lru.Back(); el != nil && evictable < n; el = el.Prev() {
		if e := el.Value.(*entry); e.pins == 0 {
			evictable += len(e.pages)
		}
	}
	if evictable < n {
		return nil, nil, fmt.Errorf("%w: %d pages wanted, %d free or evictable of %d", ErrHostFull, n, evictable, h.total)
	}
	var evicted []Key
	for el := h.lru.Back(); el != nil && len(h.free) < n; {
		e := el.Value.(*entry)
		el = el.Prev()
		if e.pins == 0 {
			h.drop(e)
			evicted = append(evicted, e.key)
		}
	}
	e := &entry{key: key, writing: true, pages: append([]int32(nil), h.free[len(h.free)-n:]...)}
	h.free = h.free[:len(h.free)-n]
	h.used += n
	h.entries[key] = e
	return e, evicted, nil
}

// Remove drops key's entry and frees its pages; a pinned entry (or one being
// written) stays and ErrPinned is returned.
func (h *HostPool) Remove(key Key) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.entries[key]
	switch {
	case !ok:
		return fmt.Errorf("%w: %d", ErrNotOnHost, key)
	case e.pins > 0 || e.writing:
		return fmt.Errorf("%w: %d", ErrPinned, key)
	}
	h.drop(e)
	return nil
}

// drop frees e's pages and forgets it. h.mu is held.
func (h *HostPool) drop(e *entry) {
	if e.elem != nil {
		h.lru.Remove(e.elem)
		e.elem = nil
	}
	delete(h.entries, e.key)
	h.used -= len(e.pages)
	h.free = append(h.free, e.pages...)
	e.pages = nil
}

// pinAll pins keys' entries, which must be distinct and hold n pages
// together, all or nothing, and returns them and their pages in order.
func (h *HostPool) pinAll(keys []Key, n int) ([]*entry, []int32, error) {
	if len(keys) == 0 {
		return nil, nil, fmt.Errorf("%w: a load of no entries", ErrShape)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, nil, ErrPoolClosed
	}
	entries := make([]*entry, 0, len(keys))
	var pages []int32
	for _, k := range keys {
		e, ok := h.entries[k]
		if !ok || e.writing {
			return nil, nil, fmt.Errorf("%w: %d", ErrNotOnHost, k)
		}
		if slices.Contains(entries, e) {
			return nil, nil, fmt.Errorf("%w: key %d listed twice", ErrShape, k)
		}
		entries = append(entries, e)
		pages = append(pages, e.pages...)
	}
	if len(pages) != n {
		return nil, nil, fmt.Errorf("%w: keys %v have %d host pages, load into %d device pages", ErrShape, keys, len(pages), n)
	}
	for _, e := range entries {
		e.pins++
		h.lru.MoveToFront(e.elem)
	}
	return entries, pages, nil
}

// Pin pins key's entry against eviction and removal, as a load does, and
// reports whether it could (the key is on host and readable; never on a
// closed pool). A caller that
// has counted an entry for a load it will submit later pins it meanwhile
// (the host pool evicts on other goroutines); each Pin needs one Unpin.
func (h *HostPool) Pin(key Key) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.entries[key]
	if !ok || e.writing {
		return false
	}
	e.pins++
	h.lru.MoveToFront(e.elem)
	return true
}

// Unpin lets go of one Pin of key.
func (h *HostPool) Unpin(key Key) {
	h.mu.Lock()
	e, ok := h.entries[key]
	h.mu.Unlock()
	if !ok {
		panic(fmt.Sprintf("hicache: unpin of key %d, which is not on host", key))
	}
	h.unpin(e)
}

func (h *HostPool) unpin(e *entry) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if e.pins <= 0 {
		panic(fmt.Sprintf("hicache: unpin of key %d with %d pins", e.key, e.pins))
	}
	e.pins--
}

// copyFromDevice appends each device page's rows, layer by layer, straight
// into its host page: every destination slice has exactly the room the rows
// need, so append writes in place and a wrong length means a shape bug.
func (h *HostPool) copyFromDevice(hostPages []int32, dev *kvcache.Pool, devPages []int32) error {
	l := h.layout
	slots := make([]int32, l.PageSize)
	for i, hp := range hostPages {
		pageSlots(slots, devPages[i], l.PageSize)
		for layer := range l.Layers {
			ko, vo, io, so := l.layerOffsets(hp, layer)
			k, v := dev.AppendKV(layer, slots, h.mem[ko:ko:vo], h.mem[vo:vo:io])
			rows, scales := dev.AppendIndexK(layer, slots, h.mem[io:io:so], h.mem[so:so:so+l.ScaleBytes])
			if len(k) != l.KVBytes || len(v) != l.VBytes || len(rows) != l.IndexBytes || len(scales) != l.ScaleBytes {
				return fmt.Errorf("%w: layer %d of device page %d gave %d/%d/%d/%d bytes, host page holds %d/%d/%d/%d",
					ErrShape, layer, devPages[i], len(k), len(v), len(rows), len(scales), l.KVBytes, l.VBytes, l.IndexBytes, l.ScaleBytes)
			}
		}
	}
	return nil
}

// hostKV and hostIndexK are the bytes of layer of host page hp, in the
// formats PutKV and PutIndexK take.
func (h *HostPool) hostKV(hp int32, layer int) (k, v []byte) {
	ko, vo, io, _ := h.layout.layerOffsets(hp, layer)
	return h.mem[ko:vo:vo], h.mem[vo:io:io]
}

func (h *HostPool) hostIndexK(hp int32, layer int) (rows, scales []byte) {
	_, _, io, so := h.layout.layerOffsets(hp, layer)
	end := so + h.layout.ScaleBytes
	return h.mem[io:so:so], h.mem[so:end:end]
}

// Check verifies the accounting: used + free = total, every page is free or
// held by exactly one entry, entries are in the LRU exactly when published,
// and pins are never negative.
func (h *HostPool) Check() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		if h.used != 0 || len(h.entries) != 0 || h.lru.Len() != 0 {
			return fmt.Errorf("hicache: closed pool holds %d pages in %d entries", h.used, len(h.entries))
		}
		return nil
	}
	if h.used+len(h.free) != h.total {
		return fmt.Errorf("hicache: %d used + %d free != %d total", h.used, len(h.free), h.total)
	}
	owner := make([]int8, h.total) // 0 unseen, 1 free, 2 in an entry
	mark := func(p int32, how int8, what string) error {
		if p < 0 || int(p) >= h.total {
			return fmt.Errorf("hicache: %s page %d out of range (%d pages)", what, p, h.total)
		}
		if owner[p] != 0 {
			return fmt.Errorf("hicache: page %d counted twice (%s)", p, what)
		}
		owner[p] = how
		return nil
	}
	for _, p := range h.free {
		if err := mark(p, 1, "free"); err != nil {
			return err
		}
	}
	used, published := 0, 0
	for k, e := range h.entries {
		if e.key != k {
			return fmt.Errorf("hicache: entry under %d says key %d", k, e.key)
		}
		if e.pins < 0 {
			return fmt.Errorf("hicache: key %d has %d pins", k, e.pins)
		}
		if len(e.pages) == 0 {
			return fmt.Errorf("hicache: key %d holds no pages", k)
		}
		if e.writing != (e.elem == nil) {
			return fmt.Errorf("hicache: key %d writing=%v but in LRU=%v", k, e.writing, e.elem != nil)
		}
		if !e.writing {
			published++
		}
		for _, p := range e.pages {
			if err := mark(p, 2, fmt.Sprintf("key %d", k)); err != nil {
				return err
			}
		}
		used += len(e.pages)
	}
	if used != h.used {
		return fmt.Errorf("hicache: entries hold %d pages, used says %d", used, h.used)
	}
	if h.lru.Len() != published {
		return fmt.Errorf("hicache: LRU has %d entries, %d published", h.lru.Len(), published)
	}
	for el := h.lru.Front(); el != nil; el = el.Next() {
		e := el.Value.(*entry)
		if h.entries[e.key] != e {
			return fmt.Errorf("hicache: LRU holds key %d that the pool forgot", e.key)
		}
	}
	return nil
}

// checkDevicePages rejects an empty, out-of-range or repeating page list.
func checkDevicePages(pages []int32, total int) error {
	if len(pages) == 0 {
		return fmt.Errorf("%w: no device pages", ErrShape)
	}
	seen := make(map[int32]bool, len(pages))
	for _, p := range pages {
		if p < 0 || int(p) >= total || seen[p] {
			return fmt.Errorf("%w: device page %d (of %d) out of range or repeated", ErrShape, p, total)
		}
		seen[p] = true
	}
	return nil
}

// pageSlots fills slots with the slots of device page p.
func pageSlots(slots []int32, p int32, pageSize int) {
	for i := range slots {
		slots[i] = p*int32(pageSize) + int32(i)
	}
}
