package clock

import (
	"sync"
	"testing"
	"time"
)

var start = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// TestManualTimersFireOnAdvance: a Manual clock's timers fire inside the
// Advance that passes their deadline, earliest first, and never before.
func TestManualTimersFireOnAdvance(t *testing.T) {
	m := NewManual(start)
	late, early := m.NewTimer(2*time.Second), m.NewTimer(time.Second)
	m.Advance(999 * time.Millisecond)
	select {
	case <-early.C():
		t.Fatal("timer fired before its deadline")
	default:
	}
	m.Advance(2 * time.Second)
	if got := <-early.C(); !got.Equal(start.Add(2999 * time.Millisecond)) {
		t.Errorf("early fired at %v", got)
	}
	<-late.C()
	if m.Pending() != 0 || late.Stop() {
		t.Errorf("pending %d after both fired, or Stop of a fired timer reported true", m.Pending())
	}
}

// TestManualStop: a stopped timer never fires; a timer of d <= 0 has
// fired already.
func TestManualStop(t *testing.T) {
	m := NewManual(start)
	x := m.NewTimer(time.Second)
	if !x.Stop() || x.Stop() {
		t.Fatal("Stop: want true once, then false")
	}
	m.Advance(time.Hour)
	select {
	case <-x.C():
		t.Fatal("a stopped timer fired")
	default:
	}
	if got := <-m.NewTimer(0).C(); !got.Equal(start.Add(time.Hour)) {
		t.Errorf("zero timer fired at %v", got)
	}
}

// TestManualConcurrent: Now, NewTimer, Stop and Advance from many
// goroutines (run under -race) leave the clock at the sum of the advances.
func TestManualConcurrent(t *testing.T) {
	m := NewManual(start)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				x := m.NewTimer(time.Millisecond)
				m.Advance(time.Millisecond)
				x.Stop()
				_ = m.Now()
			}
		})
	}
	wg.Wait()
	if got := m.Now().Sub(start); got != 800*time.Millisecond {
		t.Errorf("advanced %v, want 800ms", got)
	}
}

// Real satisfies Clock with package time.
var _ Clock = Real{}
