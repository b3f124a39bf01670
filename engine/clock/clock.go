// Package clock is the engine's time, passed in rather than read from the
// time package: a server runs on [Real]; a test runs on a [Manual] clock
// and reaches a timeout, a lease or a watchdog's threshold by advancing it,
// without waiting for it and without depending on how loaded the machine
// is.
//
// A clock gives the time and the timers whose expiry is a decision (a
// bound that gives something up when it passes). A wait that only paces a
// loop (a heartbeat, a poll) may stay on a real timer as long as what the
// loop then decides reads the clock: on a Manual clock such a loop sees an
// advance at its next wake-up.
package clock

import (
	"slices"
	"sync"
	"time"
)

// Clock is a source of time. Implementations are safe for concurrent use.
type Clock interface {
	// Now is the clock's current time.
	Now() time.Time
	// NewTimer returns a timer that fires once d has passed on this
	// clock (at once when d <= 0).
	NewTimer(d time.Duration) Timer
}

// Timer is a one-shot timer of a Clock.
type Timer interface {
	// C receives the clock's time once the timer fires; it has room for
	// that one value, so firing never blocks the clock.
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it did so,
	// false when the timer had already fired or been stopped.
	Stop() bool
}

// Real is the wall clock: package time's Now and timers.
type Real struct{}

// Now is time.Now.
func (Real) Now() time.Time { return time.Now() }

// NewTimer is time.NewTimer.
func (Real) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time { return t.t.C }
func (t realTimer) Stop() bool          { return t.t.Stop() }

// Manual is a clock that moves only when told to (Advance, Set), for tests:
// the same calls give the same times however the goroutines are scheduled.
// Its timers fire, in the order of their deadlines, inside the call that
// moves the clock past them. The zero value is not usable; see NewManual.
type Manual struct {
	mu     sync.Mutex
	now    time.Time
	timers []*manualTimer // pending, any order
}

// NewManual returns a Manual clock that reads start until moved.
func NewManual(start time.Time) *Manual { return &Manual{now: start} }

// Now is the clock's time.
func (m *Manual) Now() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.now
}

// Advance moves the clock forward by d (negative d is refused with a
// panic: a clock that goes back breaks every deadline judged on it) and
// fires the timers it passes.
func (m *Manual) Advance(d time.Duration) {
	if d < 0 {
		panic("clock: Advance by a negative duration")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.moveTo(m.now.Add(d))
}

// Set moves the clock forward to t (a t before Now is refused with a
// panic) and fires the timers it passes.
func (m *Manual) Set(t time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if t.Before(m.now) {
		panic("clock: Set to a time before Now")
	}
	m.moveTo(t)
}

// moveTo sets now and fires the timers due at it, earliest first; m.mu is
// held.
func (m *Manual) moveTo(t time.Time) {
	m.now = t
	var due []*manualTimer
	m.timers = slices.DeleteFunc(m.timers, func(x *manualTimer) bool {
		if x.at.After(t) {
			return false
		}
		due = append(due, x)
		return true
	})
	slices.SortStableFunc(due, func(a, b *manualTimer) int { return a.at.Compare(b.at) })
	for _, x := range due {
		x.c <- t // room for one: a timer fires once
	}
}

// NewTimer returns a timer that fires when the clock reaches Now()+d.
func (m *Manual) NewTimer(d time.Duration) Timer {
	m.mu.Lock()
	defer m.mu.Unlock()
	x := &manualTimer{m: m, at: m.now.Add(d), c: make(chan time.Time, 1)}
	if d <= 0 {
		x.c <- m.now
		return x
	}
	m.timers = append(m.timers, x)
	return x
}

// Pending is the number of timers waiting to fire: a test can wait until
// the code under test has set its timer before it advances past it.
func (m *Manual) Pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.timers)
}

type manualTimer struct {
	m  *Manual
	at time.Time
	c  chan time.Time
}

func (x *manualTimer) C() <-chan time.Time { return x.c }

func (x *manualTimer) Stop() bool {
	x.m.mu.Lock()
	defer x.m.mu.Unlock()
	n := len(x.m.timers)
	x.m.timers = slices.DeleteFunc(x.m.timers, func(y *manualTimer) bool { return y == x })
	return len(x.m.timers) < n
}
