package hicache

import (
	"sync/atomic"
	"time"
)

// worker is the lifetime of the goroutine a Writer or a Loader owns: kick
// wakes it when something is queued, stop is closed by Close, and exited
// closes when the goroutine has returned.
type worker struct {
	kick   chan struct{} // something was queued
	stop   chan struct{} // closed by Close
	exited chan struct{} // closed when the goroutine returns
}

func newWorker() worker {
	return worker{kick: make(chan struct{}, 1), stop: make(chan struct{}), exited: make(chan struct{})}
}

// wake kicks the goroutine without blocking: a kick already pending wakes it
// as well.
func (w worker) wake() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// idle blocks until the goroutine is kicked or stopped.
func (w worker) idle() {
	select {
	case <-w.kick:
	case <-w.stop:
	}
}

// copyTally is a Writer's or a Loader's totals: copies done, their bytes,
// copies that failed, and the time spent running them.
type copyTally struct {
	done, bytes, failures atomic.Uint64
	nanos                 atomic.Int64
}

// record counts one copy that started at start and moved bytes, or failed
// with err.
func (t *copyTally) record(start time.Time, bytes int, err error) {
	t.nanos.Add(int64(time.Since(start)))
	if err != nil {
		t.failures.Add(1)
		return
	}
	t.done.Add(1)
	t.bytes.Add(uint64(bytes))
}

func (t *copyTally) totals() (done, bytes, failures uint64, seconds float64) {
	return t.done.Load(), t.bytes.Load(), t.failures.Load(), time.Duration(t.nanos.Load()).Seconds()
}
