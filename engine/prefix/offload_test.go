package prefix

import (
	"errors"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/kvcache/kvtest"
)

// Offload moves a cached path to host as far as it can go: backed up, off
// the device deepest first, the next match loads the same bytes back; a
// locked node, and the nodes above it, stay on the device.
func TestOffloadMovesAPathToHost(t *testing.T) {
	for _, policy := range Policies {
		t.Run(policy.String(), func(t *testing.T) {
			r := newTierRig(t, 16, 16, policy)
			a := toks(13, 1) // 3 whole pages and a token
			pages := r.serve(a)
			want := kvtest.PageBytes(r.pool, pages[:3])
			free := r.pool.FreePages()

			// Locked: nothing can leave the device.
			held, _ := r.c.Match(a)
			if n, err := r.c.Offload(ctxT(t), a); err != nil || n != 0 {
				t.Fatalf("Offload of a locked path = %d, %v", n, err)
			}
			r.where(a, OnBoth, OnBoth, OnBoth)
			if err := r.c.Unlock(held); err != nil {
				t.Fatal(err)
			}

			n, err := r.c.Offload(ctxT(t), a)
			if err != nil || n != 3*tierPS {
				t.Fatalf("Offload = %d, %v; want %d tokens", n, err, 3*tierPS)
			}
			r.where(a, OnHost, OnHost, OnHost)
			if r.pool.FreePages() != free+3 {
				t.Fatalf("%d free pages after offloading 3, %d before", r.pool.FreePages(), free)
			}
			r.check()

			q := r.admit(a, 0, 3*tierPS, 3*tierPS)
			r.finish(q)
			if got := kvtest.PageBytes(r.pool, q.pages[:3]); !sameBytes(got, want) {
				t.Fatal("the offloaded path came back with other bytes")
			}
			r.check()
		})
	}
}

func TestOffloadWithoutTier(t *testing.T) {
	pool, err := kvcache.NewPool(tierConfig(8))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(pool).Offload(ctxT(t), toks(8, 1)); !errors.Is(err, ErrNoHost) {
		t.Fatalf("Offload without a tier: %v", err)
	}
}
