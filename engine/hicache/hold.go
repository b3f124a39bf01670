package hicache

import "sync"

// holdHook parks the loader at a chosen point so that tests can observe the
// gates with a known set of layer parts done, without sleeps.
type holdHook struct {
	mu      sync.Mutex
	at      holdPoint     // where to park; layer -1 off
	held    holdPoint     // where the loader is parked; layer -1 none
	release chan struct{} // closed by ReleaseHold
}

// holdPoint is a place in a load: before layer's K and V, or (index) after
// them and before layer's index-K rows and scales.
type holdPoint struct {
	layer int
	index bool
}

func (h *holdHook) init() {
	h.at, h.held = holdPoint{layer: -1}, holdPoint{layer: -1}
	h.release = make(chan struct{})
}

// HoldBeforeLayer makes the loader park before copying layer's K and V (so
// layers < layer are done and layer is not) in its loads until ReleaseHold.
// A test hook.
func (ld *Loader) HoldBeforeLayer(layer int) { ld.setHold(holdPoint{layer: layer}) }

// HoldBeforeIndexK makes the loader park after layer's K and V and before
// its index-K rows and scales, until ReleaseHold: the KV gate of layer
// passes, the index-K gate does not. A test hook.
func (ld *Loader) HoldBeforeIndexK(layer int) { ld.setHold(holdPoint{layer: layer, index: true}) }

func (ld *Loader) setHold(p holdPoint) {
	h := &ld.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	h.at = p
}

// HeldAt is where the loader is parked: the layer (-1 when it is not parked)
// and whether it is before that layer's index-K part rather than its KV.
// Tests poll it, with a deadline, to know the hold took effect.
func (ld *Loader) HeldAt() (layer int, indexK bool) {
	h := &ld.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held.layer, h.held.index
}

// ReleaseHold turns the hold off and lets a parked loader go on.
func (ld *Loader) ReleaseHold() {
	h := &ld.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	h.at = holdPoint{layer: -1}
	close(h.release)
	h.release = make(chan struct{})
}

// park waits at point p of l when the hold asks for it, until ReleaseHold,
// an abort of l or close; it returns the abort error, if any.
func (h *holdHook) park(p holdPoint, l *Load, stop <-chan struct{}) error {
	h.mu.Lock()
	if h.at != p {
		h.mu.Unlock()
		return nil
	}
	h.held = p
	release := h.release
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.held = holdPoint{layer: -1}
		h.mu.Unlock()
	}()
	select {
	case <-release:
	case <-l.abort:
	case <-stop:
	}
	return l.ld.stopped(l)
}
