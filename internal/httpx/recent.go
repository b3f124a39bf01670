package httpx

import (
	"fmt"
	"sync"
	"time"
)

// Readiness defaults: a server or router is not ready while more than half
// of its last requests (at most 100, none older than a minute, at least 10
// of them) failed.
const (
	DefaultReadyFailureRate = 0.5
	DefaultReadyWindow      = time.Minute
	DefaultReadyMinRequests = 10
	readySize               = 100
)

// RecentFailures keeps the outcomes of the last requests, for a readiness
// verdict that sees requests failing while every health check passes. Old
// outcomes age out, so that a process nobody sends traffic to becomes
// ready again. Safe for concurrent use.
type RecentFailures struct {
	maxRate float64
	window  time.Duration
	min     int

	mu   sync.Mutex
	ring [readySize]outcome
	next int // where the next outcome goes
	n    int // outcomes held, at most readySize
}

type outcome struct {
	at     time.Time
	failed bool
}

// NewRecentFailures judges the last outcomes within window: not ready when
// at least min of them are held and more than maxRate of those failed.
// Zero values take the defaults; maxRate 1 or more never judges not ready.
func NewRecentFailures(maxRate float64, window time.Duration, min int) *RecentFailures {
	if maxRate <= 0 {
		maxRate = DefaultReadyFailureRate
	}
	if window <= 0 {
		window = DefaultReadyWindow
	}
	if min <= 0 {
		min = DefaultReadyMinRequests
	}
	return &RecentFailures{maxRate: maxRate, window: window, min: min}
}

// Record notes one request's outcome.
func (f *RecentFailures) Record(failed bool) {
	f.mu.Lock()
	f.ring[f.next] = outcome{at: time.Now(), failed: failed}
	f.next = (f.next + 1) % readySize
	f.n = min(f.n+1, readySize)
	f.mu.Unlock()
}

// Count returns the outcomes within the window at now, and the failed ones.
func (f *RecentFailures) Count(now time.Time) (failed, total int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.n {
		o := f.ring[(f.next-1-i+readySize)%readySize]
		if now.Sub(o.at) > f.window {
			break // older ones follow
		}
		total++
		if o.failed {
			failed++
		}
	}
	return failed, total
}

// Verdict says why the process is not ready ("" when it is).
func (f *RecentFailures) Verdict(now time.Time) string {
	failed, total := f.Count(now)
	if total < f.min || f.maxRate >= 1 || float64(failed) <= f.maxRate*float64(total) {
		return ""
	}
	return fmt.Sprintf("%d of the last %d requests (within %v) failed, above the limit of %.0f%%",
		failed, total, f.window, f.maxRate*100)
}
