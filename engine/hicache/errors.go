package hicache

import "errors"

var (
	// ErrHostMemory: the host pool asked for is larger than the memory
	// available for it.
	ErrHostMemory = errors.New("hicache: host pool exceeds available memory")
	// ErrHostFull: not enough host pages are free or evictable (pinned
	// entries and entries being written are never evicted).
	ErrHostFull = errors.New("hicache: host pool full")
	// ErrExists: the key is already on host (or being backed up).
	ErrExists = errors.New("hicache: key already on host")
	// ErrNotOnHost: no backed-up entry has the key.
	ErrNotOnHost = errors.New("hicache: key not on host")
	// ErrPinned: the entry is pinned by a load (or being written) and stays.
	ErrPinned = errors.New("hicache: entry pinned")
	// ErrShape: the device pool's shape differs from the host pool's layout,
	// or a page list does not fit.
	ErrShape = errors.New("hicache: shape mismatch")
	// ErrLoading: a load for the key is already in flight; Join it instead.
	ErrLoading = errors.New("hicache: load already in flight for key")
	// ErrSlotBusy: the ring's next slot still holds a load whose last layer
	// has not finished; the producer must not reuse it yet.
	ErrSlotBusy = errors.New("hicache: load slot busy")
	// ErrAborted: the load was aborted before its last layer finished.
	ErrAborted = errors.New("hicache: load aborted")
	// ErrPoolClosed: the host pool is closed; its memory is gone.
	ErrPoolClosed = errors.New("hicache: host pool closed")
	// ErrClosed: the loader is closed.
	ErrClosed = errors.New("hicache: loader closed")
)
