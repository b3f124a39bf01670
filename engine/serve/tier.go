package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
)

// rankTier is one rank's host tier executor (see HiCache in hicache.go):
// on the loop's goroutine it attaches and detaches the tier, loads a
// request's host part back, gates the forward pass's reads of unsettled
// loads and settles them, offloads, and publishes the tier's snapshot. It
// holds what it acts on; the loop's per-request state comes in as
// arguments, so the loop stays the only owner of its requests.
//
// loader, snap and the wait counters are also read off the loop (the
// engine's readers, the forward pass's gates), hence the atomics.
type rankTier struct {
	r         int
	name      string // the server's, for logs
	logger    *slog.Logger
	pageSize  int
	policy    prefix.Policy
	cache     *prefix.Cache // nil when the prefix cache is off
	pool      *kvcache.Pool
	faults    *faultSet
	bandwidth *atomic.Int64 // the engine's loader pacing, bytes/s (0 unlimited)

	// gated are the loads the step's forward pass reads through gates:
	// settle waits for them after it.
	gated hicache.Loads

	loader atomic.Pointer[hicache.Loader] // the attached loader, for live pacing
	snap   atomic.Pointer[TierSnapshot]
	// Nanoseconds the forward pass's readers waited at each layer's gates.
	waitKV, waitIndexK []atomic.Int64
	// Totals of loaders and writers detached before.
	base TierTotals
	// When HostOnlyPages was last counted (loop only).
	counted time.Time
}

// newRankTier is rank r's host tier executor over its prefix cache (nil
// when that is off) and pool; it starts detached.
func newRankTier(r int, cfg *Config, cache *prefix.Cache, pool *kvcache.Pool, faults *faultSet, bandwidth *atomic.Int64) *rankTier {
	rt := &rankTier{r: r, name: cfg.Name, logger: cfg.Logger, pageSize: cfg.PageSize, policy: cfg.HiCache.Policy,
		cache: cache, pool: pool, faults: faults, bandwidth: bandwidth}
	if cache != nil {
		layers := pool.Config().Layers
		rt.waitKV, rt.waitIndexK = make([]atomic.Int64, layers), make([]atomic.Int64, layers)
	}
	return rt
}

// attach gives the rank's prefix cache a host tier of pages pages.
func (rt *rankTier) attach(pages int) error {
	pool := rt.pool
	host, err := hicache.NewHostPool(pool.Config(), pages, math.MaxInt64) // sized and checked by hostPages
	if err != nil {
		return err
	}
	ld, err := hicache.NewLoader(host, pool, 0)
	if err != nil {
		return errors.Join(err, host.Close())
	}
	w, err := hicache.NewWriter(host, pool)
	if err != nil {
		ld.Close()
		return errors.Join(err, host.Close())
	}
	if err := rt.cache.AttachHost(host, ld, w, rt.policy); err != nil {
		ld.Close()
		w.Close()
		return errors.Join(err, host.Close())
	}
	// Published first, then paced: a SetHiCacheBandwidth in between either
	// sees the loader or stored its value before this read.
	rt.loader.Store(ld)
	ld.SetBandwidth(rt.bandwidth.Load())
	return nil
}

// detach takes the rank's host tier off: waiting requests (of holds, whose
// core is core) give up the host part of their cached prefix (they will
// compute it), loads in flight finish, and the host pool's memory goes
// back to the OS.
func (rt *rankTier) detach(holds map[uint64]*hold, core *rankcore.Core) error {
	if !rt.cache.Attached() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, id := range slices.Sorted(maps.Keys(holds)) {
		h := holds[id]
		if h.hm == nil {
			continue
		}
		if err := rt.dropHostMatch(h); err != nil {
			return err
		}
		if err := core.Uncache(id, len(h.matched)*rt.pageSize); err != nil {
			return fmt.Errorf("serve: rank %d: hicache off: %w", rt.r, err)
		}
	}
	rt.addTotals(&rt.base)
	host, err := rt.cache.DetachHost(ctx)
	if err != nil {
		return fmt.Errorf("serve: rank %d: hicache off: %w", rt.r, err)
	}
	rt.loader.Store(nil)
	if err := host.Close(); err != nil { // the tier is off either way
		rt.logger.Error("serve: hicache off: host memory kept", "server", rt.name, "rank", rt.r, "err", err)
	}
	return nil
}

// dropHostMatch lets go of h's host pins from admit (its host part is not
// loaded: the request ended or the tier goes).
func (rt *rankTier) dropHostMatch(h *hold) error {
	if h == nil || h.hm == nil {
		return nil
	}
	hm := *h.hm
	h.hm = nil
	pages, _, err := rt.cache.LoadBack(ctx, nil, hm, hm.N)
	if err != nil {
		return fmt.Errorf("serve: rank %d: %w", rt.r, err)
	}
	h.matched = pages
	return nil
}

// addTotals adds the attached loader's and writer's counters (and the
// cache's, which survive detaching) to t.
func (rt *rankTier) addTotals(t *TierTotals) {
	if ld := rt.cache.Loader(); ld != nil {
		n, b, f, s := ld.Stats()
		t.Loads, t.LoadBytes, t.LoadFailures, t.LoadSeconds = t.Loads+n, t.LoadBytes+b, t.LoadFailures+f, t.LoadSeconds+s
	}
	if w := rt.cache.Writer(); w != nil {
		n, b, f, s := w.Stats()
		t.Backups, t.BackupBytes, t.BackupFailures, t.BackupSeconds = t.Backups+n, t.BackupBytes+b, t.BackupFailures+f, t.BackupSeconds+s
	}
}

// publish stores the rank's tier snapshot for readers off the loop; holds
// name the requests reading each load in flight.
func (rt *rankTier) publish(holds map[uint64]*hold) {
	if rt.cache == nil {
		return
	}
	if prev := rt.snap.Load(); prev != nil && !prev.On && !rt.cache.Attached() &&
		prev.LoadBandwidth == rt.bandwidth.Load() {
		// Off, and published so: nothing in the snapshot moves until
		// the tier comes back (its totals only change while it is on).
		return
	}
	t := rt.base
	rt.addTotals(&t)
	st := rt.cache.TierStats()
	t.HostHits, t.HitTokens, t.Abandoned, t.DroppedTokens = st.HostHits, st.HitTokens, st.Abandoned, st.DroppedTokens
	snap := &TierSnapshot{
		Rank: rt.r, On: rt.cache.Attached(), Policy: rt.policy.String(),
		LoadBandwidth: rt.bandwidth.Load(), PageSize: rt.pageSize, Totals: t,
	}
	if h := rt.cache.Host(); h != nil {
		snap.HostPages, snap.HostUsed = h.TotalPages(), h.UsedPages()
		// Counting host-only nodes walks the tree: at most once a second
		// of wall time, a bound on the walk's cost that decides nothing
		// of the engine's state (a test's still clock would freeze it).
		if prev := rt.snap.Load(); prev != nil && prev.On && time.Since(rt.counted) < time.Second {
			snap.HostOnlyPages = prev.HostOnlyPages
		} else {
			snap.HostOnlyPages, rt.counted = rt.cache.HostOnly(), time.Now()
		}
	}
	for _, li := range rt.cache.LoadsInFlight() {
		kv, idx, over := li.Load.Progress()
		ls := LoadSnapshot{Pages: len(li.Pages), KVLayers: kv, IndexLayers: idx, Layers: len(rt.waitKV), Over: over}
		for id, h := range holds {
			if readsAny(h, li.Pages) {
				ls.Requests = append(ls.Requests, id)
			}
		}
		slices.Sort(ls.Requests)
		snap.Loads = append(snap.Loads, ls)
	}
	snap.WaitKVSeconds = make([]float64, len(rt.waitKV))
	snap.WaitIndexKSeconds = make([]float64, len(rt.waitIndexK))
	for i := range rt.waitKV {
		snap.WaitKVSeconds[i] = time.Duration(rt.waitKV[i].Load()).Seconds()
		snap.WaitIndexKSeconds[i] = time.Duration(rt.waitIndexK[i].Load()).Seconds()
	}
	rt.snap.Store(snap)
}

// readsAny reports whether h's matched prefix includes one of pages.
func readsAny(h *hold, pages []int32) bool {
	for _, p := range h.matched {
		for _, q := range pages {
			if p == q {
				return true
			}
		}
	}
	return false
}

// gate is the forward pass's gate for a sequence reading unsettled loads,
// which it counts among the step's gated loads for settle: each wait is
// timed per layer, and under FaultHiCacheIndexKUngated the index-K read
// does not wait at all.
func (rt *rankTier) gate(loads hicache.Loads) hicache.Gate {
	rt.gated = append(rt.gated, loads...)
	return hicache.Gate{
		Loads:         loads,
		IndexKUngated: func() bool { return rt.faults.onAt(idxIndexKUngated) },
		Waited: func(layer int, indexK bool, d time.Duration) {
			if indexK {
				rt.waitIndexK[layer].Add(int64(d))
			} else {
				rt.waitKV[layer].Add(int64(d))
			}
		},
	}
}

// apply runs the step input's HiCache switch on this rank; switching off
// detaches (see detach for holds and core).
func (rt *rankTier) apply(op tierOp, holds map[uint64]*hold, core *rankcore.Core) error {
	if rt.cache == nil {
		return nil
	}
	if op.off {
		return rt.detach(holds, core)
	}
	if rt.cache.Attached() {
		return nil
	}
	if err := rt.attach(op.pages); err != nil {
		return fmt.Errorf("serve: rank %d: hicache on: %w", rt.r, err)
	}
	return nil
}

// loadBack loads the host part of a request's cached prefix (of tokens,
// held in h) back at its first admission, extending its locked match over
// the loaded pages. The scheduler planned their pages, so the room is
// there; a shortfall is a broken plan.
func (rt *rankTier) loadBack(it sched.Item, tokens []int32, h *hold) error {
	if h == nil || h.hm == nil {
		if h.locked()*rt.pageSize < it.Cached {
			return fmt.Errorf("serve: rank %d: admit %d: %d cached tokens planned, %d matched and nothing to load", rt.r, it.ID, it.Cached, h.locked()*rt.pageSize)
		}
		return nil
	}
	hm := *h.hm
	h.hm = nil
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	pages, got, err := rt.cache.LoadBack(ctx, tokens, hm, it.Cached)
	if err != nil {
		return fmt.Errorf("serve: rank %d: load back %d: %w", rt.r, it.ID, err)
	}
	h.matched = pages
	if got != it.Cached {
		return fmt.Errorf("serve: rank %d: load back %d: %d of %d cached tokens on the device, the plan's room did not suffice", rt.r, it.ID, got, it.Cached)
	}
	return nil
}

// settle waits, after the forward pass, for the loads it read through
// gates and makes their pages plain device pages, before the sampler, a
// PD prefill's KV chunks or Finish read them.
func (rt *rankTier) settle() error {
	if len(rt.gated) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err := rt.cache.Settle(ctx, rt.gated)
	clear(rt.gated)
	rt.gated = rt.gated[:0]
	if err != nil {
		return fmt.Errorf("serve: rank %d: %w", rt.r, err)
	}
	return nil
}

// offload runs the step input's offload on this rank. Its result is for the
// waiting Offload (rank 0 hands it over); nil when the prefix cache is off
// and there is nothing to tell. An error is the rank's own (the writer is
// stuck) and stops the loop.
func (rt *rankTier) offload(prompt []int32) (*offloadResult, error) {
	if rt.cache == nil {
		return nil, nil
	}
	var res offloadResult
	if rt.cache.Attached() {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		res.tokens, res.err = rt.cache.Offload(ctx, prompt)
		cancel()
		if res.err != nil {
			return nil, fmt.Errorf("serve: rank %d: %w", rt.r, res.err) // the writer is stuck
		}
	} else {
		// Switched off in the same step, or before: the caller hears it.
		res.err = errors.New("serve: offload: the host tier went off")
	}
	return &res, nil
}
