package hicache

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache/kvtest"

	"github.com/pdkit/pdkit/engine/kvcache"
)

// Seeded random sequences of backups, loads, loads aborted mid-way (with
// backups under pressure while the load pins its entry), removals and
// touches. After every step the host and device accounting hold, the host
// holds exactly the keys a model says with exactly their bytes, nothing is
// pinned or in flight, and every completed load matched its backup.
func TestRandomSequences(t *testing.T) {
	for _, dt := range dtypes {
		for seed := range uint64(3) {
			t.Run(fmt.Sprintf("%s/seed%d", dtName(dt), seed), func(t *testing.T) {
				randomSequence(t, devConfig(dt), seed)
			})
		}
	}
}

func randomSequence(t *testing.T, c kvcache.Config, seed uint64) {
	r := newRig(t, c, 10, 2)
	rng := rand.New(rand.NewPCG(seed, 0x41c))
	onHost := map[Key][][]byte{}
	var loads, aborts, evictions int
	next := Key(1)
	keys := func() []Key {
		ks := make([]Key, 0, len(onHost))
		for k := range onHost {
			ks = append(ks, k)
		}
		slices.Sort(ks)
		return ks
	}
	pick := func() (Key, bool) {
		ks := keys()
		if len(ks) == 0 {
			return 0, false
		}
		return ks[rng.IntN(len(ks))], true
	}
	// backup backs up a fresh key; pinned must not be evicted.
	backup := func(pinned Key) {
		n := 1 + rng.IntN(3)
		s := r.newSeq(n, true)
		snap := kvtest.PageBytes(r.dev, s.Pages())
		key := next
		next++
		evicted, err := r.host.Backup(key, r.dev, s.Pages())
		r.release(s)
		if errors.Is(err, ErrHostFull) && pinned != 0 {
			return // the pinned entry may leave too little room
		}
		if err != nil {
			t.Fatal(err)
		}
		evictions += len(evicted)
		for _, k := range evicted {
			if k == pinned {
				t.Fatalf("evicted key %d while a load pins it", k)
			}
			if _, ok := onHost[k]; !ok {
				t.Fatalf("evicted key %d that was not on host", k)
			}
			delete(onHost, k)
		}
		onHost[key] = snap
	}
	ctx := ctxT(t)
	for step := range 250 {
		switch op := rng.IntN(7); {
		case op <= 1:
			backup(0)
		case op <= 3: // a whole load
			key, ok := pick()
			if !ok {
				continue
			}
			dst := r.newSeq(r.host.Len(key), rng.IntN(2) == 0)
			l, err := r.ld.Submit(key, dst.Pages())
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if !equalBytes(kvtest.PageBytes(r.dev, dst.Pages()), onHost[key]) {
				t.Fatalf("step %d: load of key %d differs from its backup", step, key)
			}
			r.release(dst)
			loads++
		case op == 4: // a load aborted mid-way, with pressure on the host tier
			key, ok := pick()
			if !ok {
				continue
			}
			layer := rng.IntN(c.Layers)
			r.ld.HoldBeforeLayer(layer)
			dst := r.newSeq(r.host.Len(key), true)
			l, err := r.ld.Submit(key, dst.Pages())
			if err != nil {
				t.Fatal(err)
			}
			if rng.IntN(2) == 0 {
				j, _ := r.ld.Join(key)
				if err := j.Abort(ctx); err != nil {
					t.Fatal(err)
				}
			}
			waitHeld(t, r.ld, layer)
			for range rng.IntN(4) {
				backup(key)
			}
			if err := l.Abort(ctx); err != nil {
				t.Fatal(err)
			}
			if err := l.Wait(ctx); !errors.Is(err, ErrAborted) {
				t.Fatalf("step %d: aborted load ended with %v", step, err)
			}
			r.ld.ReleaseHold()
			r.release(dst)
			aborts++
		case op == 5:
			if key, ok := pick(); ok {
				if err := r.host.Remove(key); err != nil {
					t.Fatal(err)
				}
				delete(onHost, key)
			}
		default:
			if key, ok := pick(); ok && !r.host.Touch(key) {
				t.Fatalf("touch of key %d on host failed", key)
			}
		}
		check(t, r)
		used := 0
		for _, k := range keys() {
			if !r.host.Has(k) || r.host.Pinned(k) {
				t.Fatalf("step %d: key %d missing or pinned", step, k)
			}
			used += r.host.Len(k)
		}
		if used != r.host.UsedPages() || r.host.UsedPages()+r.host.FreePages() != r.host.TotalPages() {
			t.Fatalf("step %d: %d used (model %d) + %d free != %d", step, r.host.UsedPages(), used, r.host.FreePages(), r.host.TotalPages())
		}
		if r.ld.InFlight() != 0 || r.dev.FreePages() != r.dev.TotalPages() {
			t.Fatalf("step %d: %d loads in flight, %d of %d device pages free", step, r.ld.InFlight(), r.dev.FreePages(), r.dev.TotalPages())
		}
	}
	t.Logf("%d loads, %d aborted mid-way, %d evictions", loads, aborts, evictions)
	if loads == 0 || aborts == 0 || evictions == 0 {
		t.Fatal("the sequence exercised too little")
	}
	for _, k := range keys() {
		if !equalBytes(hostBytes(r.host, k), onHost[k]) {
			t.Fatalf("key %d's host bytes changed", k)
		}
	}
}
