package hicache

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
)

// Writer backs device pages up to the host pool on its own goroutine, one
// backup at a time in submission order, so that the rank's loop never copies.
// It owns that goroutine: NewWriter starts it and Close stops it.
//
// The caller keeps each backup's device pages unchanged (not freed, not
// written) until the backup is over: a cached page is read-only, and the
// prefix cache waits for a node's backup before it frees the node's page.
type Writer struct {
	host *HostPool
	dev  *kvcache.Pool

	mu     sync.Mutex
	queue  []*Backup
	closed bool
	held   chan struct{} // non-nil: park before the next backup until closed (HoldBackups)

	worker
	tally copyTally // backups
}

// Backup is one queued or finished copy of device pages to the host pool.
type Backup struct {
	key      Key
	devPages []int32
	done     chan struct{} // closed when the copy is over

	// Set before done closes.
	evicted []Key
	err     error
}

// NewWriter starts a writer from dev into host.
func NewWriter(host *HostPool, dev *kvcache.Pool) (*Writer, error) {
	if err := host.layout.check(dev.Config()); err != nil {
		return nil, err
	}
	if err := host.addCopier(1); err != nil {
		return nil, err
	}
	w := &Writer{host: host, dev: dev, worker: newWorker()}
	go w.run()
	return w, nil
}

// Submit queues a backup of devPages under key (HostPool.Backup, off the
// caller's goroutine). It fails only when the writer is closed.
func (w *Writer) Submit(key Key, devPages []int32) (*Backup, error) {
	if err := checkDevicePages(devPages, w.dev.TotalPages()); err != nil {
		return nil, err
	}
	b := &Backup{key: key, devPages: slices.Clone(devPages), done: make(chan struct{})}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, ErrClosed
	}
	w.queue = append(w.queue, b)
	w.wake()
	return b, nil
}

// Queued is the number of backups not yet started.
func (w *Writer) Queued() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.queue)
}

// Key is the key the backup stores under.
func (b *Backup) Key() Key { return b.key }

// Done reports whether the backup is over.
func (b *Backup) Done() bool {
	select {
	case <-b.done:
		return true
	default:
		return false
	}
}

// Wait blocks until the backup is over, then returns HostPool.Backup's
// outcome: the keys it evicted to make room, and its error (ErrHostFull,
// ErrClosed...). It returns ctx's error if ctx ends first.
func (b *Backup) Wait(ctx context.Context) (evicted []Key, err error) {
	select {
	case <-b.done:
		return b.evicted, b.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Stats are the writer's totals: backups done, bytes copied, seconds spent
// copying and backups that failed (host pool full of pinned entries,
// writer closed).
func (w *Writer) Stats() (backups, bytes, failures uint64, seconds float64) {
	return w.tally.totals()
}

// HoldBackups makes the writer park before its next backup, leaving it
// queued (not Done), until ReleaseBackups or Close. A test hook: it lets a
// test keep a backup in flight while the cache decides.
func (w *Writer) HoldBackups() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held == nil {
		w.held = make(chan struct{})
	}
}

// ReleaseBackups lets a writer held by HoldBackups go on.
func (w *Writer) ReleaseBackups() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held != nil {
		close(w.held)
		w.held = nil
	}
}

// Close fails every queued backup with ErrClosed, lets a running one finish
// (one copy of a few pages: nothing else holds it up) and returns once the
// goroutine has exited. Later calls do nothing.
func (w *Writer) Close() {
	w.mu.Lock()
	if !w.closed {
		w.closed = true
		close(w.stop)
		for _, b := range w.queue {
			b.err = fmt.Errorf("%w: backup of key %d", ErrClosed, b.key)
			w.tally.failures.Add(1)
			close(b.done)
		}
		w.queue = nil
	}
	w.mu.Unlock()
	<-w.exited
}

func (w *Writer) run() {
	defer close(w.exited)
	defer w.host.addCopier(-1)
	for {
		w.mu.Lock()
		if w.closed {
			w.mu.Unlock()
			return
		}
		if len(w.queue) == 0 {
			w.mu.Unlock()
			w.idle()
			continue
		}
		if held := w.held; held != nil {
			w.mu.Unlock()
			select {
			case <-held:
			case <-w.stop:
			}
			continue
		}
		b := w.queue[0]
		w.queue = w.queue[1:]
		w.mu.Unlock()

		start := time.Now()
		b.evicted, b.err = w.host.Backup(b.key, w.dev, b.devPages)
		w.tally.record(start, len(b.devPages)*w.host.layout.PageBytes, b.err)
		close(b.done)
	}
}
