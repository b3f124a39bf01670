// Package waitfor is how a test waits for something that happens in real
// time: a real ZeroMQ socket (its timers run in C, on the wall clock), a
// child process, a real HTTP server, a goroutine the test cannot join. A
// test waits on a condition, never on a sleep: it says what it waits for
// and the longest it may take, and polls until the condition holds. A
// sleep guesses how long the machine needs and is wrong on a loaded one;
// a poll rechecks the condition and goes on as soon as it holds, so the
// bound can be generous without slowing a passing test.
//
// A poll first retries back to back, for up to Spin or SpinTries tries,
// whichever ends first, yielding the processor between tries
// (runtime.Gosched): most conditions hold within microseconds of being
// checked, once the goroutine that makes them hold has run. Then
// it sleeps between tries, MinPause first, doubling up to MaxPause: a long
// wait costs a wake-up every MaxPause rather than a core (the tests run
// with -race on two cores), and sees the condition at most MaxPause (plus
// scheduling) after it comes to hold. Inside a testing/synctest bubble the
// clock is the bubble's: it stands still while a poll spins (hence the
// bound on tries) and its sleeps let the bubble's clock move, so a poll
// there ends too, on the bubble's time.
//
// Code that can wait on an event instead (a channel, a WaitGroup, a
// returned call) should: Recv waits on a channel with the same bound.
package waitfor

import (
	"runtime"
	"testing"
	"time"
)

// The backoff of a poll (see the package doc).
const (
	Spin      = time.Millisecond
	SpinTries = 1000
	MinPause  = 50 * time.Microsecond
	MaxPause  = 5 * time.Millisecond
)

// Poll calls cond until it returns true, and reports whether it did
// within the bound; cond is always called at least once, and once more
// after the bound has passed. It is the loop the other functions share,
// for a caller that reports a failure its own way.
func Poll(within time.Duration, cond func() bool) bool {
	start := time.Now()
	deadline := start.Add(within)
	pause := MinPause
	for try := 1; ; try++ {
		if cond() {
			return true
		}
		now := time.Now()
		if now.After(deadline) {
			return false
		}
		if try < SpinTries && now.Sub(start) < Spin {
			runtime.Gosched()
			continue
		}
		// The poll's pace, not a wait for a condition: cond is checked
		// again after it.
		time.Sleep(min(pause, deadline.Sub(now)+time.Microsecond))
		pause = min(2*pause, MaxPause)
	}
}

// For waits until cond holds, and fails the test with "what: not within
// D" if it does not within the bound. Like t.Fatal it must be called from
// the goroutine running the test; Check may be called from any.
func For(t testing.TB, what string, within time.Duration, cond func() bool) {
	t.Helper()
	if !Poll(within, cond) {
		t.Fatalf("%s: not within %v", what, within)
	}
}

// Check is For that reports the failure with t.Errorf and returns false
// instead of ending the test, so that it may be called from any
// goroutine.
func Check(t testing.TB, what string, within time.Duration, cond func() bool) bool {
	t.Helper()
	if !Poll(within, cond) {
		t.Errorf("%s: not within %v", what, within)
		return false
	}
	return true
}

// NoError waits until f returns nil, and fails the test with "what: not
// within D: err", err being f's last error, if it does not within the
// bound. f says in its error what it saw, for the failure to show.
func NoError(t testing.TB, what string, within time.Duration, f func() error) {
	t.Helper()
	var last error
	if !Poll(within, func() bool { last = f(); return last == nil }) {
		t.Fatalf("%s: not within %v: %v", what, within, last)
	}
}

// Recv waits for a value on ch (or for ch to be closed: the zero value)
// and returns it; it fails the test with "what: not within D" if none
// comes within the bound.
func Recv[T any](t testing.TB, what string, within time.Duration, ch <-chan T) T {
	t.Helper()
	timer := time.NewTimer(within)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("%s: not within %v", what, within)
		var zero T
		return zero
	}
}
