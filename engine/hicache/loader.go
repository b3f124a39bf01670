package hicache

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
)

// DefaultRingSlots is the number of load slots, as in the reference's
// LayerDoneCounter.
const DefaultRingSlots = 3

// Loader copies host entries back into device pages on its own goroutine,
// one load at a time in submission order, layer by layer. It owns that
// goroutine: NewLoader starts it and Close stops it.
type Loader struct {
	host   *HostPool
	dev    *kvcache.Pool
	layers int

	bandwidth atomic.Int64 // bytes per second per copy; 0 is unlimited
	hold      holdHook

	mu       sync.Mutex
	ring     ring
	queue    []*Load
	inFlight map[Key]*Load // queued or running, by key
	closed   bool

	worker
	tally copyTally // loads that landed
}

// NewLoader starts a loader from host into dev with slots ring slots
// (DefaultRingSlots when slots <= 0).
func NewLoader(host *HostPool, dev *kvcache.Pool, slots int) (*Loader, error) {
	if err := host.layout.check(dev.Config()); err != nil {
		return nil, err
	}
	if slots <= 0 {
		slots = DefaultRingSlots
	}
	if err := host.addCopier(1); err != nil {
		return nil, err
	}
	ld := &Loader{
		host:     host,
		dev:      dev,
		layers:   host.layout.Layers,
		ring:     newRing(slots),
		inFlight: make(map[Key]*Load),
		worker:   newWorker(),
	}
	ld.hold.init()
	go ld.run()
	return ld, nil
}

// SetBandwidth paces later copies to bytesPerSecond (0: unlimited). Each
// layer's KV copy and index-K copy takes at least its bytes divided by the
// budget; the loader sleeps out the rest, deterministically. On a CPU build
// this restores a GPU's copy-to-compute ratio. Safe live.
func (ld *Loader) SetBandwidth(bytesPerSecond int64) {
	ld.bandwidth.Store(max(bytesPerSecond, 0))
}

// Stats are the loader's totals: loads that landed, their bytes, seconds
// spent running loads (paced sleeps included), and loads that stopped
// before their last layer (aborted, closed).
func (ld *Loader) Stats() (loads, bytes, failures uint64, seconds float64) {
	return ld.tally.totals()
}

// Bandwidth is the current pacing budget in bytes per second, 0 unlimited.
func (ld *Loader) Bandwidth() int64 { return ld.bandwidth.Load() }

// Submit queues a load of key's host entry into devPages (one device page per
// host page, in entry order). The caller must hold devPages as one sequence's
// own pages and leave them to the loader until the load is over. It pins the
// entry; it fails with ErrLoading when key is already loading (use Join),
// ErrSlotBusy when the ring's next slot is still in use, ErrNotOnHost or
// ErrClosed.
func (ld *Loader) Submit(key Key, devPages []int32) (*Load, error) {
	return ld.SubmitKeys([]Key{key}, devPages)
}

// SubmitKeys is Submit of several host entries as one load, in one ring
// slot: devPages are the device pages of keys' entries one after another, in
// keys' order, and the loader copies each layer of all of them before
// marking that layer done, so that a reader of layer i waits for layer i of
// the whole run, not for every layer of the entries before it (e.g. a radix
// path of single-page nodes loaded back at once). Join by any of the keys
// joins the load. It fails with ErrLoading when any key is already loading.
func (ld *Loader) SubmitKeys(keys []Key, devPages []int32) (*Load, error) {
	l, _, err := ld.submit(keys, devPages)
	return l, err
}

// SubmitKeysWait is SubmitKeys that waits for the ring's next slot instead
// of failing with ErrSlotBusy: a slot frees once its load's last layer has
// landed, which needs nothing but the loader's own goroutine, so the wait is
// at most one load. It returns ctx's error if ctx ends first.
func (ld *Loader) SubmitKeysWait(ctx context.Context, keys []Key, devPages []int32) (*Load, error) {
	for {
		l, busy, err := ld.submit(keys, devPages)
		if busy == nil {
			return l, err
		}
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, fmt.Errorf("hicache: waiting for a load slot: %w", ctx.Err())
		}
	}
}

// submit is SubmitKeys; when the ring's next slot is busy it also returns
// the channel that closes at that slot's next change.
func (ld *Loader) submit(keys []Key, devPages []int32) (*Load, <-chan struct{}, error) {
	if err := checkDevicePages(devPages, ld.dev.TotalPages()); err != nil {
		return nil, nil, err
	}
	entries, hostPages, err := ld.host.pinAll(keys, len(devPages))
	if err != nil {
		return nil, nil, err
	}
	ld.mu.Lock()
	defer ld.mu.Unlock()
	var slot int
	var gen uint64
	if ld.closed {
		err = ErrClosed
	}
	for _, k := range keys {
		if err == nil && ld.inFlight[k] != nil {
			err = fmt.Errorf("%w: %d", ErrLoading, k)
		}
	}
	if err == nil {
		slot, gen, err = ld.ring.take()
	}
	if err != nil {
		for _, e := range entries {
			ld.host.unpin(e)
		}
		if errors.Is(err, ErrSlotBusy) {
			return nil, ld.ring.slots[ld.ring.next].changed, err
		}
		return nil, nil, err
	}
	l := &Load{
		ld: ld, key: keys[0], keys: slices.Clone(keys), entries: entries, hostPages: hostPages,
		devPages: slices.Clone(devPages), slot: slot, gen: gen,
		holders: 1, abort: make(chan struct{}), end: make(chan struct{}),
	}
	ld.queue = append(ld.queue, l)
	for _, k := range keys {
		ld.inFlight[k] = l
	}
	ld.wake()
	return l, nil, nil
}

// Join returns the load in flight for key, counting the caller as one more
// holder (each holder aborts once), so that concurrent hits on one node share
// one load. It reports false when no load for key is queued or running.
func (ld *Loader) Join(key Key) (*Load, bool) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	l := ld.inFlight[key]
	if l == nil || l.holders <= 0 {
		return nil, false
	}
	l.holders++
	return l, true
}

// InFlight is the number of loads queued or running.
func (ld *Loader) InFlight() int {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	n := 0
	for k, l := range ld.inFlight {
		if l.key == k { // a load of several keys once
			n++
		}
	}
	return n
}

// Close aborts every queued and running load (their waiters get ErrClosed),
// stops the goroutine and returns once it has exited. It needs no context:
// the loader checks for Close before every layer part, in a hold and in a
// paced sleep, so the wait is at most one layer's copy. Later calls do
// nothing.
func (ld *Loader) Close() {
	ld.mu.Lock()
	if !ld.closed {
		ld.closed = true
		close(ld.stop)
		for _, l := range ld.queue {
			ld.finish(l, fmt.Errorf("%w: key %d", ErrClosed, l.key))
		}
		ld.queue = nil
	}
	ld.mu.Unlock()
	<-ld.exited
}

// run is the loader's goroutine.
func (ld *Loader) run() {
	defer close(ld.exited)
	defer ld.host.addCopier(-1)
	for {
		l := ld.next()
		if l == nil {
			return
		}
		start := time.Now()
		err := ld.copyLayers(l)
		ld.tally.record(start, len(l.hostPages)*ld.host.layout.PageBytes, err)
		ld.mu.Lock()
		ld.finish(l, err)
		ld.mu.Unlock()
	}
}

// next takes the oldest queued load, waiting for one; nil once closed.
func (ld *Loader) next() *Load {
	for {
		ld.mu.Lock()
		if ld.closed {
			ld.mu.Unlock()
			return nil
		}
		if len(ld.queue) > 0 {
			l := ld.queue[0]
			ld.queue = ld.queue[1:]
			l.state = loadRunning
			ld.mu.Unlock()
			return l
		}
		ld.mu.Unlock()
		ld.idle()
	}
}

// copyLayers copies l layer by layer: layer i's K and V (or latent rows) of
// every page, then layer i's index-K rows and scales, marking each part
// done once all of it has landed. It stops before any step once l is
// aborted or the loader closes.
func (ld *Loader) copyLayers(l *Load) error {
	lay := ld.host.layout
	slots := make([]int32, lay.PageSize)
	for layer := range ld.layers {
		for _, index := range []bool{false, true} {
			if err := ld.hold.park(holdPoint{layer: layer, index: index}, l, ld.stop); err != nil {
				return err
			}
			if err := ld.stopped(l); err != nil {
				return err
			}
			if err := ld.copyPart(l, layer, index, slots); err != nil {
				return err
			}
			ld.mark(l, layer, index)
		}
	}
	return nil
}

// copyPart copies one part of layer (its K and V rows, or with index its
// index-K rows and scales) of every page of l, as a DMA engine lands it:
// page after page, each page's bytes paced at the loader's bandwidth from
// the part's start (see pace), so that a reader that does not wait at the
// part's gate sees the pages landed so far new and the rest stale, and the
// part takes its bytes' time: the bigger the part, the longer its window.
func (ld *Loader) copyPart(l *Load, layer int, index bool, slots []int32) error {
	lay := ld.host.layout
	pageBytes := lay.KVBytes + lay.VBytes
	if index {
		pageBytes = lay.IndexBytes + lay.ScaleBytes
	}
	if pageBytes == 0 {
		return nil // no index-K in this model
	}
	start := time.Now()
	for i, hp := range l.hostPages { // fixed while pinned
		pageSlots(slots, l.devPages[i], lay.PageSize)
		var err error
		if index {
			rows, scales := ld.host.hostIndexK(hp, layer)
			err = ld.dev.FillIndexK(layer, slots, rows, scales)
		} else {
			k, v := ld.host.hostKV(hp, layer)
			err = ld.dev.FillKV(layer, slots, k, v)
		}
		if err != nil {
			return err
		}
		if err := ld.pace(l, (i+1)*pageBytes, start); err != nil {
			return err
		}
	}
	return nil
}

// stopped is the abort error once l is aborted or the loader closes.
func (ld *Loader) stopped(l *Load) error {
	select {
	case <-l.abort:
		return fmt.Errorf("%w: key %d mid-way", ErrAborted, l.key)
	case <-ld.stop:
		return fmt.Errorf("%w: key %d mid-way", ErrClosed, l.key)
	default:
		return nil
	}
}

// mark records that layer's KV (or index-K) part of l is on the device.
func (ld *Loader) mark(l *Load, layer int, index bool) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	s := &ld.ring.slots[l.slot]
	if index {
		s.idxDone = layer + 1
	} else {
		s.kvDone = layer + 1
	}
	s.wake()
}

// pace sleeps out what is left of bytes' time at the bandwidth budget since
// start, waking early on abort or close.
func (ld *Loader) pace(l *Load, bytes int, start time.Time) error {
	bw := ld.bandwidth.Load()
	if bw <= 0 || bytes == 0 {
		return nil
	}
	budget := time.Duration(float64(bytes) / float64(bw) * float64(time.Second))
	rest := budget - time.Since(start)
	if rest <= 0 {
		return nil
	}
	t := time.NewTimer(rest)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-l.abort:
	case <-ld.stop:
	}
	return ld.stopped(l)
}

// finish ends l (done when err is nil, else aborted): frees its ring slot,
// unpins its host entry, forgets it and wakes its waiters. ld.mu is held.
func (ld *Loader) finish(l *Load, err error) {
	if l.state == loadDone || l.state == loadAborted {
		panic(fmt.Sprintf("hicache: load of key %d finished twice", l.key))
	}
	if err != nil {
		l.state, l.err = loadAborted, err
	} else {
		l.state = loadDone
	}
	s := &ld.ring.slots[l.slot]
	if s.gen == l.gen {
		s.busy = false
		s.wake()
	}
	for _, e := range l.entries {
		ld.host.unpin(e)
	}
	l.forget()
	close(l.end)
}

// dequeue removes queued load l from the queue. ld.mu is held.
func (ld *Loader) dequeue(l *Load) {
	if i := slices.Index(ld.queue, l); i >= 0 {
		ld.queue = slices.Delete(ld.queue, i, i+1)
	}
}
