package httpx

import (
	"strings"
	"testing"
	"time"
)

func TestRecentFailures(t *testing.T) {
	f := NewRecentFailures(0.5, time.Hour, 4)
	for range 3 {
		f.Record(true)
	}
	if v := f.Verdict(time.Now()); v != "" {
		t.Fatalf("3 failures, under the minimum of 4: %q", v)
	}
	f.Record(true)
	if v := f.Verdict(time.Now()); !strings.Contains(v, "4 of the last 4 requests") {
		t.Fatalf("4 of 4 failed: %q", v)
	}
	for range 4 {
		f.Record(false)
	}
	if v := f.Verdict(time.Now()); v != "" {
		t.Fatalf("half failed, not above: %q", v)
	}
	// Outcomes past the window age out; at most the last 100 count.
	if failed, total := f.Count(time.Now().Add(2 * time.Hour)); failed != 0 || total != 0 {
		t.Fatalf("after the window: %d of %d", failed, total)
	}
	for range 150 {
		f.Record(true)
	}
	if failed, total := f.Count(time.Now()); failed != 100 || total != 100 {
		t.Fatalf("after 150 more: %d of %d, want the last 100", failed, total)
	}
	off := NewRecentFailures(1, 0, 1)
	off.Record(true)
	if v := off.Verdict(time.Now()); v != "" {
		t.Fatalf("a rate of 1 judged not ready: %q", v)
	}
}
