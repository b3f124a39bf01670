package serve

import (
	"errors"
	"fmt"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
)

// rankPrefix is one rank's prefix cache executor: it matches joining
// requests, keeps or lets go of their matches as engine/rankcore decided
// (PlanAdmit, Unstall), releases a waiting request's match, and evicts
// cached pages for a plan's room. The decisions every rank must take
// alike are rankcore's; this only locks, unlocks and loads pages. The
// core (what every rank holds alike: the scheduler, the tokens) comes in
// as an argument; what this rank's cache keeps for each request, its
// hold, is this executor's own. What it did comes back as counts, which
// rank 0's loop adds to the totals.
type rankPrefix struct {
	r     int
	cache *prefix.Cache // nil when the prefix cache is off
	pool  *kvcache.Pool
	tier  *rankTier // the cache's host tier (tier.go), for the host pins
	// holds are, by request, what the cache keeps for it: rank-local
	// pages and pins, which the core never sees.
	holds map[uint64]*hold
}

// newRankPrefix is rank r's prefix cache executor over cache (nil when
// the prefix cache is off), pool and tier.
func newRankPrefix(r int, cache *prefix.Cache, pool *kvcache.Pool, tier *rankTier) *rankPrefix {
	return &rankPrefix{r: r, cache: cache, pool: pool, tier: tier, holds: make(map[uint64]*hold)}
}

// release ends request id's sequence (of tokens): its full pages go to the
// prefix cache (which unlocks the request's matched prefix), the rest is
// freed. The request's hold stays, emptied: a retracted request is
// recomputed and keeps its host pins none.
func (px *rankPrefix) release(id uint64, tokens []int32) error {
	seq, ok := px.pool.Seq(id)
	if !ok {
		return fmt.Errorf("no live sequence %d", id)
	}
	if px.cache == nil {
		return px.pool.Release(seq)
	}
	var matched []int32
	cold := false
	if h := px.holds[id]; h != nil {
		matched, h.matched, cold = h.matched, nil, h.probe
	}
	if cold {
		// A canary's pages are kept only until a client needs the room:
		// probes hold no client's prefix out of the cache.
		return px.cache.FinishCold(seq, tokens[:seq.Len()], matched)
	}
	return px.cache.Finish(seq, tokens[:seq.Len()], matched)
}

// forget lets go of everything request id held once it ended: its
// sequence (of tokens) when it has one, else its locked match and pins.
func (px *rankPrefix) forget(id uint64, tokens []int32, hasSeq bool) error {
	var err error
	switch {
	case hasSeq:
		err = px.release(id, tokens)
	case px.cache != nil:
		err = px.unlock(px.holds[id]) // finished while waiting
	}
	delete(px.holds, id)
	return err
}

// on reports whether the prefix cache is on: only then do the ranks run
// Admit and hold matches.
func (px *rankPrefix) on() bool { return px.cache != nil }

// match matches each joining request's prompt (all but its last token:
// that one is run to sample) against the cache, device and host tier,
// locking and pinning what it finds: the matches to keep or let go once
// Admit agreed, and the facts this rank proposes. A request that skips
// the cache matches nothing.
func (px *rankPrefix) match(adds []addMsg) ([]prefix.HostMatch, []rankcore.Match) {
	hms := make([]prefix.HostMatch, len(adds))
	ms := make([]rankcore.Match, len(adds))
	for i, a := range adds {
		if a.noCache {
			continue // matches nothing: every rank admits it at 0
		}
		hm := px.cache.MatchHost(a.prompt[:len(a.prompt)-1])
		hms[i] = hm
		ms[i] = rankcore.Match{Device: hm.N, Total: hm.N + hm.Host}
	}
	return hms, ms
}

// keep applies d to the match hm of a request of prompt, into its hold h:
// the match stays whole (its host part pinned to load at the request's
// first admission, or unpinned now when nothing is to load), or, when a
// peer matched less, it goes and the agreed device part is locked again.
func (px *rankPrefix) keep(prompt []int32, hm prefix.HostMatch, d rankcore.Admission, h *hold) error {
	if d.Keep == rankcore.KeepAgreed {
		if err := px.dropMatch(&hm); err != nil {
			return err
		}
		h.matched, _ = px.cache.Match(prompt[:d.Agreed.Device])
		return nil
	}
	h.matched = hm.Pages
	h.hm = &hm
	if d.Keep == rankcore.KeepUnpin {
		return px.tier.dropHostMatch(h)
	}
	return nil
}

// dropMatch unpins hm's host part and unlocks its device match.
func (px *rankPrefix) dropMatch(hm *prefix.HostMatch) error {
	pages, _, err := px.cache.LoadBack(ctx, nil, *hm, hm.N)
	if err == nil {
		err = px.cache.Unlock(pages)
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: %w", px.r, err)
	}
	return nil
}

// unlock lets go of what a request that holds no sequence keeps in the
// cache, its hold h: its host pins and its locked match. The pages stay
// h.matched (the caller forgets them).
func (px *rankPrefix) unlock(h *hold) error {
	if px.cache == nil || h == nil {
		return nil
	}
	return errors.Join(px.tier.dropHostMatch(h), px.cache.Unlock(h.matched))
}

// unstall runs rankcore's Unstall over sc's waiting queue, when nothing
// runs and the head does not fit: each waiter it names gives its cached
// prefix up (it will compute it), in the cache and in the scheduler, and
// the cache's free pages after it go into the next decision. It returns
// how many gave up, also when it fails.
func (px *rankPrefix) unstall(core *rankcore.Core) (int, error) {
	holds := px.holds
	if px.cache == nil {
		return 0, nil
	}
	_, need, ok := core.Head()
	if !ok {
		return 0, nil
	}
	ids := core.WaitingIDs()
	ws := make([]rankcore.Waiter, len(ids))
	for i, id := range ids {
		ws[i].ID = id
		if h := holds[id]; h != nil {
			ws[i].Locked, ws[i].Pinned = len(h.matched), h.hm != nil
		}
	}
	u := rankcore.StartUnstall(need, ws)
	n := 0
	for w, ok := u.Next(px.cache.Free()); ok; w, ok = u.Next(px.cache.Free()) {
		h := holds[w.ID]
		if err := px.unlock(h); err != nil {
			return n, fmt.Errorf("serve: rank %d: unstall: %w", px.r, err)
		}
		if h != nil {
			h.matched = nil
		}
		if err := core.Uncache(w.ID, 0); err != nil {
			return n, fmt.Errorf("serve: rank %d: unstall: %w", px.r, err)
		}
		n++
	}
	return n, nil
}

// freePages is what this rank could allocate now: free pages plus cached
// pages nothing uses.
func (px *rankPrefix) freePages() int {
	n := px.pool.FreePages()
	if px.cache != nil {
		n += px.cache.Evictable()
	}
	return n
}

// evictFor evicts cached prefixes until plan's pages fit in the free pool,
// returning how many pages it evicted. Evict takes only pages no sequence
// uses, so the overlap loop calls it while the step before runs too, off
// the path between two forward passes; prepare calls it again for what
// the finishes left short.
func (px *rankPrefix) evictFor(plan sched.Plan) int {
	if short := plan.PagesNeeded - px.pool.FreePages(); short > 0 && px.cache != nil {
		return px.cache.Evict(short)
	}
	return 0
}
