package prefix

import (
	"slices"
	"testing"
)

// TestLoadBackKeepsSharedNodesOnDevice: a waiting request's host match
// whose first nodes another request loaded back (and let go of) since its
// MatchHost shares them; LoadBack's eviction for the rest must not take
// those shared nodes off the device, or the loaded nodes hang below a
// host-only one and the returned path holds no page for it.
func TestLoadBackKeepsSharedNodesOnDevice(t *testing.T) {
	r := newTierRig(t, 4, 16, WriteThrough)
	a := toks(3*tierPS+1, 1)
	r.serve(a)
	r.hitOnce(a) // backs all three pages up
	r.c.Evict(r.pool.TotalPages())
	r.where(a, OnHost, OnHost, OnHost)

	w := r.matchHost(a, 0, 3*tierPS) // waits, pinning all three on host
	q := r.admit(a[:2*tierPS+1], 0, 2*tierPS, 2*tierPS)
	r.finish(q) // the first two pages are device nodes nobody locks
	r.where(a, OnBoth, OnBoth, OnHost)

	// Take the free pages, so that loading the third page needs an eviction.
	r.nextID++
	s, err := r.pool.NewSeq(r.nextID)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.pool.Reserve(s, r.pool.FreePages()*tierPS); err != nil {
		t.Fatal(err)
	}
	pages, n, err := r.c.LoadBack(ctxT(t), a, w, 3*tierPS)
	if err != nil {
		t.Fatal(err)
	}
	if n == 3*tierPS && slices.Contains(pages, -1) {
		t.Fatalf("LoadBack = %v (%d tokens): a shared node went off the device", pages, n)
	}
	if err := r.c.Check(); err != nil {
		t.Fatal(err)
	}
	if err := r.c.Settle(ctxT(t), r.c.Gate(pages)); err != nil {
		t.Fatal(err)
	}
	if err := r.c.Unlock(pages); err != nil {
		t.Fatal(err)
	}
	if err := r.pool.Release(s); err != nil {
		t.Fatal(err)
	}
	r.check()
}
