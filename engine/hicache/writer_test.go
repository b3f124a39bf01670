package hicache

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/kvcache/kvtest"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

func newWriter(t *testing.T, r *rig) *Writer {
	t.Helper()
	w, err := NewWriter(r.host, r.dev)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	return w
}

// A backup lands on host exactly the bytes AppendKV and AppendIndexK read
// from the device pages, in every precision and with no indexer, and the
// writer counts it.
func TestWriterBackupLandsDeviceBytes(t *testing.T) {
	for _, dt := range append([]kernels.IndexKDType{noIndexer}, dtypes...) {
		t.Run(dtName(dt), func(t *testing.T) {
			r := newRig(t, devConfig(dt), 8, 0)
			w := newWriter(t, r)
			s := r.newSeq(3, true)
			want := kvtest.PageBytes(r.dev, s.Pages())
			b, err := w.Submit(5, s.Pages())
			if err != nil {
				t.Fatal(err)
			}
			if b.Key() != 5 {
				t.Fatalf("backup key %d", b.Key())
			}
			evicted, err := b.Wait(ctxT(t))
			if err != nil || evicted != nil || !b.Done() {
				t.Fatalf("backup = %v, %v, done %v", evicted, err, b.Done())
			}
			if r.host.Len(5) != 3 || !equalBytes(hostBytes(r.host, 5), want) {
				t.Fatal("host pages differ from the device bytes")
			}
			if n, bytes, fails, secs := w.Stats(); n != 1 || bytes != uint64(3*r.host.Layout().PageBytes) || fails != 0 || secs < 0 {
				t.Fatalf("stats %d backups, %d bytes, %d failures, %v s", n, bytes, fails, secs)
			}
			// The same key again fails (and counts); bad pages are refused.
			b, err = w.Submit(5, s.Pages()[:1])
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Wait(ctxT(t)); !errors.Is(err, ErrExists) {
				t.Fatalf("second backup of a key: %v", err)
			}
			if n, _, fails, _ := w.Stats(); n != 1 || fails != 1 {
				t.Fatalf("stats %d backups, %d failures after a failed one", n, fails)
			}
			for _, bad := range [][]int32{nil, {0, 0}, {int32(r.dev.TotalPages())}} {
				if _, err := w.Submit(6, bad); !errors.Is(err, ErrShape) {
					t.Fatalf("Submit(%v): %v", bad, err)
				}
			}
			if w.Queued() != 0 {
				t.Fatalf("%d queued", w.Queued())
			}
			r.release(s)
			check(t, r)
		})
	}
	c := devConfig(kernels.IndexFP8)
	host, err := NewHostPool(c, 4, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	c.KVDim++
	dev, err := kvcache.NewPool(c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewWriter(host, dev); !errors.Is(err, ErrShape) {
		t.Fatalf("NewWriter for another shape: %v", err)
	}
}

// Backups run one at a time in submission order: one that needs room evicts
// the least recently used entry and reports its key.
func TestWriterFIFOReportsEvictions(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexBF16), 2, 0)
	w := newWriter(t, r)
	s := r.newSeq(3, true)
	var bs []*Backup
	for i, pg := range s.Pages() {
		b, err := w.Submit(Key(i+1), []int32{pg})
		if err != nil {
			t.Fatal(err)
		}
		bs = append(bs, b)
	}
	for i, b := range bs {
		evicted, err := b.Wait(ctxT(t))
		if want := map[int][]Key{2: {1}}[i]; err != nil || !slices.Equal(evicted, want) {
			t.Fatalf("backup %d: evicted %v, %v; want %v", i+1, evicted, err, want)
		}
	}
	if r.host.Has(1) || !r.host.Has(2) || !r.host.Has(3) {
		t.Fatal("the wrong entry was evicted")
	}
	r.release(s)
	check(t, r)
}

// Close fails every queued backup with ErrClosed, lets the running one
// finish, and returns once the goroutine is gone; later Submits fail.
func TestWriterCloseFailsQueued(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexFP8), 8, 0)
	w, err := NewWriter(r.host, r.dev)
	if err != nil {
		t.Fatal(err)
	}
	s := r.newSeq(3, true)
	pages := s.Pages()
	// Hold the host pool's lock: the running backup blocks in it.
	r.host.mu.Lock()
	unlocked := false
	unlock := func() {
		if !unlocked {
			unlocked = true
			r.host.mu.Unlock()
		}
	}
	t.Cleanup(unlock)
	b1, err := w.Submit(1, pages[:1])
	if err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the writer takes the first backup", 10*time.Second, func() bool { return w.Queued() == 0 })
	b2, err2 := w.Submit(2, pages[1:2])
	b3, err3 := w.Submit(3, pages[2:])
	if err2 != nil || err3 != nil || w.Queued() != 2 {
		t.Fatalf("submits %v, %v; %d queued", err2, err3, w.Queued())
	}
	closed := make(chan struct{})
	go func() {
		w.Close()
		close(closed)
	}()
	waitfor.For(t, "Close fails the queued backups", 10*time.Second, func() bool { return b2.Done() && b3.Done() })
	for _, b := range []*Backup{b2, b3} {
		if _, err := b.Wait(ctxT(t)); !errors.Is(err, ErrClosed) {
			t.Fatalf("queued backup of key %d: %v", b.Key(), err)
		}
	}
	if b1.Done() {
		t.Fatal("the running backup ended while the host pool was held")
	}
	select {
	case <-closed:
		t.Fatal("Close returned with a backup running")
	default:
	}
	unlock()
	select {
	case <-closed:
	case <-ctxT(t).Done():
		t.Fatal("Close never returned")
	}
	if _, err := b1.Wait(ctxT(t)); err != nil {
		t.Fatalf("the running backup: %v", err)
	}
	if !r.host.Has(1) || r.host.Has(2) || r.host.Has(3) {
		t.Fatal("host entries are not the running backup's alone")
	}
	if n, _, fails, _ := w.Stats(); n != 1 || fails != 2 {
		t.Fatalf("stats %d backups, %d failures", n, fails)
	}
	if _, err := w.Submit(4, pages[:1]); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Close: %v", err)
	}
	w.Close() // again: nothing
	r.release(s)
	check(t, r)
}

// A pinned entry is never evicted for a backup's room (the backup fails
// with ErrHostFull instead, or takes another), nor removed; each Pin needs
// its own Unpin; Pin moves the entry away from eviction.
func TestPinnedEntryIsNeverEvicted(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexFP8), 2, 0)
	w := newWriter(t, r)
	r.backupNew(1, 1)
	r.backupNew(2, 1) // the LRU order is 2, 1
	s := r.newSeq(2, true)
	backup := func(key Key, page int32) ([]Key, error) {
		t.Helper()
		b, err := w.Submit(key, []int32{page})
		if err != nil {
			t.Fatal(err)
		}
		return b.Wait(ctxT(t))
	}
	if r.host.Pin(9) {
		t.Fatal("Pin of a key not on host succeeded")
	}
	if !r.host.Pin(1) || !r.host.Pin(2) || !r.host.Pinned(1) || !r.host.Pinned(2) {
		t.Fatal("Pin failed")
	}
	if ev, err := backup(3, s.Pages()[0]); !errors.Is(err, ErrHostFull) || ev != nil {
		t.Fatalf("backup with every entry pinned: evicted %v, %v", ev, err)
	}
	if _, _, fails, _ := w.Stats(); fails != 1 {
		t.Fatalf("writer failures %d, want 1", fails)
	}
	// 1 pinned twice, and the least recently used.
	r.host.Unpin(2)
	if !r.host.Pin(1) || !r.host.Touch(2) {
		t.Fatal("Pin or Touch failed")
	}
	if ev, err := backup(3, s.Pages()[0]); err != nil || !slices.Equal(ev, []Key{2}) {
		t.Fatalf("backup evicted %v, %v; want the unpinned 2", ev, err)
	}
	r.host.Unpin(1)
	if !r.host.Pinned(1) || !errors.Is(r.host.Remove(1), ErrPinned) {
		t.Fatal("an entry pinned twice and unpinned once is not pinned")
	}
	r.host.Touch(3) // 1 is the least recently used
	if ev, err := backup(4, s.Pages()[1]); err != nil || !slices.Equal(ev, []Key{3}) {
		t.Fatalf("backup evicted %v, %v; want 3, not the pinned 1", ev, err)
	}
	r.host.Unpin(1)
	if r.host.Pinned(1) {
		t.Fatal("still pinned after both Unpins")
	}
	if ev, err := backup(5, s.Pages()[0]); err != nil || !slices.Equal(ev, []Key{1}) {
		t.Fatalf("backup evicted %v, %v; want 1, unpinned now", ev, err)
	}
	for _, bad := range []func(){func() { r.host.Unpin(1) }, func() { r.host.Unpin(4) }} {
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("Unpin of a key not on host or not pinned did not panic")
				}
			}()
			bad()
		}()
	}
	r.release(s)
	check(t, r)
}

// doneSpy is a context that reports the first call of Done: SubmitKeysWait
// calls it once it found the ring slot busy and starts to wait.
type doneSpy struct {
	context.Context
	once    sync.Once
	waiting chan struct{}
}

func (c *doneSpy) Done() <-chan struct{} {
	c.once.Do(func() { close(c.waiting) })
	return c.Context.Done()
}

// SubmitKeysWait waits for a busy ring slot and goes on once the load in it
// has finished; it returns ctx's error if ctx ends first, leaving nothing
// pinned or queued. InFlight counts a load of several keys once.
func TestSubmitKeysWaitWaitsForSlot(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexFP8), 8, 1) // one ring slot
	snap1, _ := r.backupNew(1, 1)
	snap2, _ := r.backupNew(2, 2)
	d1, d2 := r.newSeq(1, true), r.newSeq(2, true)
	r.ld.HoldBeforeLayer(1)
	l1, err := r.ld.SubmitKeys([]Key{1}, d1.Pages())
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, 1)
	if _, err := r.ld.SubmitKeys([]Key{2}, d2.Pages()); !errors.Is(err, ErrSlotBusy) {
		t.Fatalf("SubmitKeys with the slot busy: %v", err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := r.ld.SubmitKeysWait(ctx, []Key{2}, d2.Pages())
		errc <- err
	}()
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("SubmitKeysWait after ctx ended: %v", err)
	}
	if _, _, over := l1.Progress(); over || r.host.Pinned(2) || r.ld.InFlight() != 1 {
		t.Fatal("a SubmitKeysWait that gave up left a pin or a load, or the first load ended")
	}

	type result struct {
		l      *Load
		err    error
		l1Over bool
	}
	done := make(chan result, 1)
	spy := &doneSpy{Context: ctxT(t), waiting: make(chan struct{})}
	go func() {
		l, err := r.ld.SubmitKeysWait(spy, []Key{2}, d2.Pages())
		_, _, over := l1.Progress()
		done <- result{l, err, over}
	}()
	select {
	case <-spy.waiting: // it found the slot busy and waits
	case res := <-done:
		t.Fatalf("SubmitKeysWait returned %v with the slot busy", res.err)
	}
	r.ld.ReleaseHold()
	var res result
	select {
	case res = <-done:
	case <-ctxT(t).Done():
		t.Fatal("SubmitKeysWait never returned")
	}
	if res.err != nil || !res.l1Over || res.l.Slot() != l1.Slot() {
		t.Fatalf("SubmitKeysWait = %v (first load over %v, slot %d)", res.err, res.l1Over, res.l.Slot())
	}
	if err := res.l.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if !equalBytes(kvtest.PageBytes(r.dev, d1.Pages()), snap1) || !equalBytes(kvtest.PageBytes(r.dev, d2.Pages()), snap2) {
		t.Fatal("device pages differ from the host bytes")
	}

	r.ld.HoldBeforeLayer(0)
	both := append(d1.Pages(), d2.Pages()...)
	l, err := r.ld.SubmitKeysWait(ctxT(t), []Key{1, 2}, both)
	if err != nil {
		t.Fatal(err)
	}
	waitHeld(t, r.ld, 0)
	if n := r.ld.InFlight(); n != 1 {
		t.Fatalf("InFlight = %d for one load of two keys", n)
	}
	r.ld.ReleaseHold()
	if err := l.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if r.ld.InFlight() != 0 || r.host.Pinned(1) || r.host.Pinned(2) {
		t.Fatal("a finished load is in flight or pins")
	}
	r.release(d1)
	r.release(d2)
	check(t, r)
}
