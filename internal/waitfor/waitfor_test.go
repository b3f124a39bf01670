package waitfor_test

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// fakeTB records what a helper reports instead of failing the test that
// runs it. Fatalf ends the calling goroutine, as testing's does.
type fakeTB struct {
	testing.TB // for the methods the helpers do not call
	mu         sync.Mutex
	msgs       []string
	fatal      bool
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.msgs = append(f.msgs, fmt.Sprintf(format, args...))
}

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.Errorf(format, args...)
	f.mu.Lock()
	f.fatal = true
	f.mu.Unlock()
	runtime.Goexit()
}

// run calls call on a goroutine of its own, as a test's body, and reports
// whether call returned (false: it ended through Fatalf).
func (f *fakeTB) run(call func()) (returned bool) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		call()
		returned = true
	}()
	<-done
	return returned
}

// check fails t unless f recorded exactly want and, with fatal, ended
// through Fatalf.
func (f *fakeTB) check(t *testing.T, fatal bool, want ...string) {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fatal != fatal || strings.Join(f.msgs, "\n") != strings.Join(want, "\n") {
		t.Errorf("reported %q (fatal %v), want %q (fatal %v)", f.msgs, f.fatal, want, fatal)
	}
}

func never() bool { return false }

// A condition that holds already is checked once, and nothing is reported.
func TestHoldingConditionReturnsAtOnce(t *testing.T) {
	f := &fakeTB{TB: t}
	calls := 0
	cond := func() bool { calls++; return true }
	if !f.run(func() { waitfor.For(f, "x", time.Hour, cond) }) {
		t.Fatal("For ended the test on a condition that holds")
	}
	if !waitfor.Check(f, "x", time.Hour, cond) {
		t.Error("Check returned false on a condition that holds")
	}
	f.run(func() { waitfor.NoError(f, "x", time.Hour, func() error { calls++; return nil }) })
	if calls != 3 {
		t.Errorf("cond called %d times, want once per wait", calls)
	}
	f.check(t, false)
}

// A condition that another goroutine makes hold is seen.
func TestConditionMadeToHoldIsSeen(t *testing.T) {
	var set atomic.Bool
	release := make(chan struct{})
	go func() {
		<-release
		set.Store(true)
	}()
	first := true
	waitfor.For(t, "the flag", time.Minute, func() bool {
		if first {
			first = false
			close(release)
		}
		return set.Load()
	})
}

// For fails the test with what and the bound, through Fatalf, once the
// condition has not held within it.
func TestForFailsWhenTheConditionNeverHolds(t *testing.T) {
	f := &fakeTB{TB: t}
	start := time.Now()
	if f.run(func() { waitfor.For(f, "the peer to connect", 20*time.Millisecond, never) }) {
		t.Error("For returned on a condition that never held")
	}
	if d := time.Since(start); d < 20*time.Millisecond {
		t.Errorf("For gave up after %v, before its bound", d)
	}
	f.check(t, true, "the peer to connect: not within 20ms")
}

// Check reports with Errorf and returns false, from a goroutine other
// than the test's.
func TestCheckReportsAndReturnsFalse(t *testing.T) {
	f := &fakeTB{TB: t}
	var ok bool
	if !f.run(func() { ok = waitfor.Check(f, "the drain", 10*time.Millisecond, never) }) {
		t.Fatal("Check ended its goroutine")
	}
	if ok {
		t.Error("Check returned true on a condition that never held")
	}
	f.check(t, false, "the drain: not within 10ms")
}

// NoError shows the last error its function returned.
func TestNoErrorShowsTheLastError(t *testing.T) {
	f := &fakeTB{TB: t}
	n := 0
	f.run(func() {
		waitfor.NoError(f, "health", 10*time.Millisecond, func() error {
			n++
			if n == 1 {
				return errors.New("first")
			}
			return errors.New("status 503")
		})
	})
	f.check(t, true, "health: not within 10ms: status 503")
}

// Recv returns the value sent, the zero value of a closed channel, and
// fails the test when nothing comes within the bound.
func TestRecv(t *testing.T) {
	ch := make(chan int, 1)
	ch <- 7
	if v := waitfor.Recv(t, "a value", time.Minute, ch); v != 7 {
		t.Errorf("Recv = %d, want 7", v)
	}
	close(ch)
	if v := waitfor.Recv(t, "the close", time.Minute, ch); v != 0 {
		t.Errorf("Recv on a closed channel = %d, want 0", v)
	}

	f := &fakeTB{TB: t}
	if f.run(func() { waitfor.Recv(f, "the result", 10*time.Millisecond, make(chan string)) }) {
		t.Error("Recv returned with nothing sent")
	}
	f.check(t, true, "the result: not within 10ms")
}

// A poll that waits long does not burn a core: past the spin it sleeps
// between tries. Sleeps last at least what they ask for, so the count of
// tries has an upper bound however loaded the machine is.
func TestPollBacksOff(t *testing.T) {
	const within = 50 * time.Millisecond
	calls := 0
	if waitfor.Poll(within, func() bool { calls++; return false }) {
		t.Fatal("Poll reported a condition that never held")
	}
	// The spin, then the doubling pauses up to MaxPause and MaxPause
	// pauses for the rest of the bound, and the try after it.
	sleeps, slept := 0, time.Duration(0)
	for p := waitfor.MinPause; slept < within; p = min(2*p, waitfor.MaxPause) {
		sleeps++
		slept += p
	}
	if limit := waitfor.SpinTries + sleeps + 1; calls > limit {
		t.Errorf("%d tries in %v, want at most %d", calls, within, limit)
	}
}

// In a synctest bubble a poll runs on the bubble's clock: it sees a
// condition a bubble timer makes hold, and fails after the bubble's bound.
func TestPollInABubble(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var set atomic.Bool
		time.AfterFunc(3*time.Second, func() { set.Store(true) })
		start := time.Now()
		waitfor.For(t, "the timer", 10*time.Second, set.Load)
		if d := time.Since(start); d < 3*time.Second || d > 3*time.Second+waitfor.MaxPause {
			t.Errorf("seen after %v, want 3s and at most one pause more", d)
		}

		start = time.Now()
		if waitfor.Poll(time.Minute, never) {
			t.Fatal("Poll reported a condition that never held")
		}
		if d := time.Since(start); d <= time.Minute || d > time.Minute+waitfor.MaxPause {
			t.Errorf("gave up after %v, want just past 1m", d)
		}
	})
}
