package prefix

import (
	"context"
	"slices"
	"sync"
	"testing"
)

// releaseCtx is a context whose first Done call runs release: the moment a
// cache call starts to wait on it, the test lets the held writer go, so a
// wait that happens finishes and a decision taken without waiting shows.
type releaseCtx struct {
	context.Context
	once    sync.Once
	release func()
}

func (c *releaseCtx) Done() <-chan struct{} {
	c.once.Do(c.release)
	return c.Context.Done()
}

// TestOffloadDeviceOutcomeIgnoresBackupTiming: two ranks run the same calls;
// on one the backup of a node below the offloaded path is still in flight
// when Offload runs, on the other it has finished. Which pages leave the
// device must be the same on both (rank rule: device state never depends on
// a backup's timing).
func TestOffloadDeviceOutcomeIgnoresBackupTiming(t *testing.T) {
	a := toks(3*tierPS+1, 1) // three pages and a token
	prefixToks := a[:2*tierPS]
	run := func(inFlight bool) (free int, dev []bool) {
		r := newTierRig(t, 8, 16, WriteThrough)
		r.serve(a)
		r.hitOnce(prefixToks) // backs the first two pages up (check waits)
		if inFlight {
			r.w.HoldBackups()
		}
		pages, _ := r.c.Match(a) // the third page's backup is queued
		if err := r.c.Unlock(pages); err != nil {
			t.Fatal(err)
		}
		ctx := context.Context(ctxT(t))
		if inFlight {
			ctx = &releaseCtx{Context: ctx, release: r.w.ReleaseBackups}
		} else {
			r.check() // waits for the backup
		}
		if _, err := r.c.Offload(ctx, prefixToks); err != nil {
			t.Fatal(err)
		}
		r.w.ReleaseBackups()
		r.check()
		for _, l := range r.c.Where(a) {
			dev = append(dev, l&OnDevice != 0)
		}
		return r.pool.FreePages(), dev
	}
	wantFree, wantDev := run(false)
	gotFree, gotDev := run(true)
	if gotFree != wantFree || !slices.Equal(gotDev, wantDev) {
		t.Fatalf("backup in flight: %d free pages, on device %v; backup over: %d free, on device %v", gotFree, gotDev, wantFree, wantDev)
	}
}
