package steprate

import (
	"testing"
	"time"
)

// Busy is not slow: bigger batches land in their own buckets, so a load
// that grows the batch moves no bucket's figures; a server that slows down
// at the same batch shows its recent average far above its baseline.
func TestTracker(t *testing.T) {
	var tr Tracker
	for range 2000 {
		tr.Add("decode", 8, 10*time.Millisecond)
		tr.Add("decode", 64, 40*time.Millisecond) // a busier batch: slower steps, its own bucket
		tr.Add("idle", 0, time.Second)
	}
	rs := tr.Rates()
	if len(rs) != 2 || rs[0].Tokens != 8 || rs[1].Tokens != 64 {
		t.Fatalf("buckets %+v", rs)
	}
	for _, r := range rs {
		if r.Recent != r.Baseline {
			t.Errorf("a steady bucket: %+v", r)
		}
	}
	for range 100 {
		tr.Add("decode", 7, 300*time.Millisecond) // starved: 30x at the same batch
	}
	r := tr.Rates()[0]
	if ratio := float64(r.Recent) / float64(r.Baseline); r.Tokens != 8 || ratio < 3 {
		t.Fatalf("after a slowdown: %+v (recent/baseline %.1f)", r, ratio)
	}
	if b := bucket(9); b != 16 {
		t.Errorf("bucket(9) = %d", b)
	}
}

// A throttled process spends its time between steps: the cycles show it
// where the steps do not, in the same bucket, apart from the steps'.
func TestCycles(t *testing.T) {
	var tr Tracker
	for range 500 {
		tr.Add("decode", 1, 200*time.Microsecond)
		tr.AddCycle("decode", 1, 250*time.Microsecond)
	}
	for range 100 {
		tr.Add("decode", 1, 200*time.Microsecond)     // the step itself is as fast
		tr.AddCycle("decode", 1, 20*time.Millisecond) // but the quota holds the loop between steps
	}
	tr.AddCycle("idle", 0, time.Second)
	rs := tr.Rates()
	if len(rs) != 1 {
		t.Fatalf("buckets %+v", rs)
	}
	r := rs[0]
	if r.Steps != 600 || r.Cycles != 600 || r.Recent != 200*time.Microsecond {
		t.Errorf("steps and cycles mixed: %+v", r)
	}
	if ratio := float64(r.CycleRecent) / float64(r.CycleBaseline); ratio < 3 {
		t.Errorf("cycles after the quota: %+v (recent/baseline %.1f)", r, ratio)
	}
}
