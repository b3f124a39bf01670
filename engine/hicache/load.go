package hicache

import (
	"context"
	"fmt"
	"slices"
	"time"
)

type loadState uint8

const (
	loadQueued loadState = iota
	loadRunning
	loadDone    // every layer is on the device
	loadAborted // stopped before the last layer; err says why
)

// Load is one queued or running copy of a host entry into device pages. It
// names its ring slot and that slot's generation, so a reader holding it is
// never answered by a later load that reuses the slot. Every method is safe
// from any goroutine.
type Load struct {
	ld        *Loader
	key       Key      // keys[0]
	keys      []Key    // the entries loaded, in device page order
	entries   []*entry // pinned while the load is queued or running
	hostPages []int32  // the entries' host pages, one after another
	devPages  []int32
	slot      int
	gen       uint64
	abort     chan struct{} // closed when the last holder aborts
	end       chan struct{} // closed once the loader has let go of the pages

	// Guarded by ld.mu.
	state   loadState
	err     error
	holders int // Submit and each Join; the load stops when all abort
}

// Key is the host entry being loaded (the first, for SubmitKeys).
func (l *Load) Key() Key { return l.key }

// Keys are the host entries being loaded, in device page order.
func (l *Load) Keys() []Key { return slices.Clone(l.keys) }

// forget drops l's keys from the loader's in-flight map, so that a later hit
// does not Join it. ld.mu is held.
func (l *Load) forget() {
	for _, k := range l.keys {
		if l.ld.inFlight[k] == l {
			delete(l.ld.inFlight, k)
		}
	}
}

// Slot is the index of the ring slot the load occupies.
func (l *Load) Slot() int { return l.slot }

// DevicePages are the device pages the load writes, in entry order.
func (l *Load) DevicePages() []int32 { return append([]int32(nil), l.devPages...) }

// Progress is how many layers' KV and index-K are on the device, and whether
// the load is over (done or aborted).
func (l *Load) Progress() (kvLayers, indexLayers int, over bool) {
	l.ld.mu.Lock()
	defer l.ld.mu.Unlock()
	switch l.state {
	case loadDone:
		return l.ld.layers, l.ld.layers, true
	case loadAborted:
		return 0, 0, true
	}
	s := &l.ld.ring.slots[l.slot]
	return s.kvDone, s.idxDone, false
}

// WaitKV blocks until layer's K and V rows are on the device. It returns
// ErrAborted (wrapped) when the load stopped first, or ctx's error.
// Attention's read of the pool waits here.
func (l *Load) WaitKV(ctx context.Context, layer int) error {
	return l.wait(ctx, layer, false)
}

// WaitIndexK blocks until layer's index-K rows and scales are on the device.
// The sparse indexer's read of index-K waits here; it runs before attention,
// so it needs its own gate.
func (l *Load) WaitIndexK(ctx context.Context, layer int) error {
	return l.wait(ctx, layer, true)
}

// Wait blocks until the whole load is over and returns its outcome.
func (l *Load) Wait(ctx context.Context) error {
	select {
	case <-l.end:
		l.ld.mu.Lock()
		defer l.ld.mu.Unlock()
		return l.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (l *Load) wait(ctx context.Context, layer int, index bool) error {
	if layer < 0 || layer >= l.ld.layers {
		return fmt.Errorf("hicache: wait for layer %d of %d", layer, l.ld.layers)
	}
	for {
		ready, ch, err := l.layerReady(layer, index)
		if ready {
			return err
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// layerReady reports whether the layer's part is on the device (or the load
// is over), else the channel that closes at the next change.
func (l *Load) layerReady(layer int, index bool) (bool, <-chan struct{}, error) {
	l.ld.mu.Lock()
	defer l.ld.mu.Unlock()
	switch l.state {
	case loadDone:
		return true, nil, nil
	case loadAborted:
		return true, nil, l.err
	}
	s := &l.ld.ring.slots[l.slot]
	done := s.kvDone
	if index {
		done = s.idxDone
	}
	if done > layer {
		return true, nil, nil
	}
	return false, s.changed, nil
}

// Abort gives up this holder's interest. When the last holder aborts before
// the load finished, the loader stops at its next step, frees the slot and
// unpins the host entry (which stays on host, intact). Abort returns once the
// loader no longer writes the device pages (so the caller may free them), or
// with ctx's error: the abort still goes on, and Wait tells when the pages
// are the caller's again. Aborting a finished load only drops the holder.
func (l *Load) Abort(ctx context.Context) error {
	ld := l.ld
	ld.mu.Lock()
	if l.holders <= 0 {
		ld.mu.Unlock()
		return fmt.Errorf("hicache: load of key %d aborted more often than held", l.key)
	}
	l.holders--
	switch {
	case l.holders > 0 || l.state == loadDone || l.state == loadAborted:
		ld.mu.Unlock()
		return nil
	case l.state == loadQueued:
		ld.dequeue(l)
		ld.finish(l, fmt.Errorf("%w: key %d before it started", ErrAborted, l.key))
		ld.mu.Unlock()
		return nil
	}
	close(l.abort)
	l.forget() // a later hit must not Join a stopping load
	ld.mu.Unlock()
	select {
	case <-l.end:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Loads are the loads a sequence's pages wait for (several requests' loads
// may lie along one prefix); as a model.LayerGate each read waits for its
// part of the layer in every one of them.
type Loads []*Load

// WaitKV waits for layer's K and V in every load.
func (ls Loads) WaitKV(ctx context.Context, layer int) error {
	for _, l := range ls {
		if err := l.WaitKV(ctx, layer); err != nil {
			return err
		}
	}
	return nil
}

// WaitIndexK waits for layer's index-K rows and scales in every load.
func (ls Loads) WaitIndexK(ctx context.Context, layer int) error {
	for _, l := range ls {
		if err := l.WaitIndexK(ctx, layer); err != nil {
			return err
		}
	}
	return nil
}

// Gate is the forward pass's gate over a sequence's unsettled loads, as a
// server runs it: Waited (if set) is told how long each read waited, and
// when IndexKUngated (if set) reports true the layer waits for its KV as it
// begins (WaitLayer) and the index-K read does not wait at all: the HiCache
// index-K race of production incident 3, on a switch. The incident's code
// waited once per layer, at its top, for the layer's KV alone; the indexer
// then read the index-K sidecar, which lands after the KV, once the layer's
// projections were computed, and scored whatever the pages held at that
// moment. It is exposed when the layer's index-K takes longer to land than
// those projections take to compute.
type Gate struct {
	Loads         Loads
	IndexKUngated func() bool
	Waited        func(layer int, indexK bool, d time.Duration)
}

// WaitKV waits for layer's K and V of every load.
func (g Gate) WaitKV(ctx context.Context, layer int) error {
	start := time.Now()
	err := g.Loads.WaitKV(ctx, layer)
	if g.Waited != nil {
		g.Waited(layer, false, time.Since(start))
	}
	return err
}

// WaitLayer waits, under IndexKUngated, for layer's K and V of every load
// as the layer begins (see Gate); otherwise each read waits for itself.
func (g Gate) WaitLayer(ctx context.Context, layer int) error {
	if g.IndexKUngated != nil && g.IndexKUngated() {
		return g.WaitKV(ctx, layer)
	}
	return nil
}

// WaitIndexK waits for layer's index-K of every load, unless IndexKUngated.
func (g Gate) WaitIndexK(ctx context.Context, layer int) error {
	if g.IndexKUngated != nil && g.IndexKUngated() {
		return nil
	}
	start := time.Now()
	err := g.Loads.WaitIndexK(ctx, layer)
	if g.Waited != nil {
		g.Waited(layer, true, time.Since(start))
	}
	return err
}
