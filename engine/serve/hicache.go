package serve

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/sched"
)

// HiCache: every rank's prefix cache gets a host tier (engine/prefix
// AttachHost, engine/hicache). The loop's part of it:
//
//   - admit: each rank's MatchHost counts device and host tokens; the ranks
//     MIN-reduce the device tokens, the total and the negated device tokens
//     (one vector with the admit reduction), so they agree on how much of a
//     prompt is cached and how much of that is loaded back. Host state may
//     differ between ranks (backups finish on each rank's own writer); the
//     reduction is what makes a host hit a shared decision.
//   - prepare: a request's first admission loads its host part back
//     (LoadBack, its pages in the scheduler's plan) and starts its sequence
//     on the whole prefix; every batch item reading unsettled loads gets
//     their gate, through which the forward pass's indexer and attention
//     wait per layer.
//   - after the forward pass: the loads it read are settled (waited for,
//     made plain device pages) before anything else reads the pages: the
//     sampler's results, a PD prefill's KV chunks, Finish.
//   - on/off live: the switch travels in the step input, so every rank
//     attaches or detaches its tier in the same iteration.

// HiCacheConfig configures the host tier. Zero values take the defaults
// noted per field.
type HiCacheConfig struct {
	Enabled bool
	// Bytes is the host pool's size per rank; 0 sizes it by Ratio.
	Bytes int64
	// Ratio sizes the host pool as Ratio × the device pool's pages when
	// Bytes is 0 (default 2, as the reference's hicache ratio).
	Ratio float64
	// Policy is when prefix pages are backed up (default write-through).
	Policy prefix.Policy
	// LoadBandwidth paces the loader's copies in bytes/second per rank (0:
	// unlimited). On a CPU build it restores a GPU's copy-to-compute
	// ratio; see hicache.Loader.SetBandwidth. Settable live.
	LoadBandwidth int64
	// Available is the host memory the tier may take per rank; 0 reads the
	// machine's available memory (/proc/meminfo) and divides it among the
	// ranks. A host pool larger than this is refused.
	Available int64 `json:"-"`
}

func (c *HiCacheConfig) setDefaults() {
	if c.Ratio == 0 {
		c.Ratio = 2
	}
}

func (c HiCacheConfig) validate(disablePrefix bool, bad func(string, ...any)) {
	switch {
	case c.Enabled && disablePrefix:
		bad("hicache needs the prefix cache: it is its host tier (drop --no-prefix-cache or --hicache)")
	case c.Bytes < 0 || c.Ratio < 0 || math.IsNaN(c.Ratio) || math.IsInf(c.Ratio, 0):
		bad("hicache size %d bytes / ratio %v (--hicache-size, --hicache-ratio): want non-negative", c.Bytes, c.Ratio)
	case c.LoadBandwidth < 0:
		bad("hicache load bandwidth %d (--hicache-load-bandwidth): want non-negative (0 is unlimited)", c.LoadBandwidth)
	case c.Policy != prefix.WriteThrough && c.Policy != prefix.WriteBack:
		bad("hicache policy %v (--hicache-write-policy): want write-through or write-back", c.Policy)
	}
}

// FaultHiCacheIndexKUngated makes the index-K read path skip its per-layer
// wait for a load back from host while the KV read keeps its own: the
// sparse indexer scores what was in the pages before the load landed
// (production incident 3, the HiCache index-K race).
const FaultHiCacheIndexKUngated = "hicache-indexk-ungated"

var idxIndexKUngated = faultIndex(FaultHiCacheIndexKUngated)

// hostPages is the host pool size in pages for device pool dev, refused
// beyond available bytes (0: the machine's available memory over tp ranks).
func (c HiCacheConfig) hostPages(dev kvcache.Config, tp int) (int, error) {
	var pages int
	var err error
	if c.Bytes > 0 {
		pages, err = hicache.PagesForBytes(dev, c.Bytes)
	} else {
		pages, err = hicache.PagesForRatio(dev, c.Ratio)
	}
	if err != nil {
		return 0, err
	}
	if pages < 1 {
		return 0, fmt.Errorf("hicache: a host pool of %d bytes / ratio %v holds no page", c.Bytes, c.Ratio)
	}
	avail := c.Available
	if avail <= 0 {
		if avail, err = memAvailable(); err != nil {
			return 0, fmt.Errorf("hicache: %w (set the host memory the tier may take)", err)
		}
		avail /= int64(tp)
	}
	lay, err := hicache.LayoutOf(dev)
	if err != nil {
		return 0, err
	}
	if need := int64(pages) * int64(lay.PageBytes); need > avail {
		return 0, fmt.Errorf("%w: %d pages of %d bytes (%d MiB) per rank, %d MiB available per rank",
			hicache.ErrHostMemory, pages, lay.PageBytes, need>>20, avail>>20)
	}
	return pages, nil
}

// memAvailable reads MemAvailable from /proc/meminfo, in bytes.
func memAvailable() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("reading available memory: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemAvailable:" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("reading available memory: %w", err)
			}
			return kb << 10, nil
		}
	}
	return 0, errors.New("reading available memory: no MemAvailable in /proc/meminfo")
}

// rankTier is a rank's HiCache state that readers off the loop see.
type rankTier struct {
	loader atomic.Pointer[hicache.Loader] // the attached loader, for live pacing
	snap   atomic.Pointer[TierSnapshot]
	// Nanoseconds the forward pass's readers waited at each layer's gates.
	waitKV, waitIndexK []atomic.Int64
	// Totals of loaders and writers detached before.
	base TierTotals
	// When HostOnlyPages was last counted (loop only).
	counted time.Time
}

// TierTotals are a rank's HiCache counters since the engine started.
type TierTotals struct {
	Backups, BackupBytes, BackupFailures uint64
	BackupSeconds                        float64
	Loads, LoadBytes, LoadFailures       uint64
	LoadSeconds                          float64
	HostHits, HitTokens                  uint64
	Abandoned, DroppedTokens             uint64
}

// TierSnapshot is one rank's host tier as of its last iteration.
type TierSnapshot struct {
	Rank          int
	On            bool
	Policy        string
	LoadBandwidth int64 // bytes/s, 0 unlimited
	PageSize      int
	HostPages     int // host pool size
	HostUsed      int // host pages holding cached nodes
	HostOnlyPages int // cached nodes on host only
	Totals        TierTotals
	Loads         []LoadSnapshot // loads not yet settled
	// Seconds the forward pass waited per layer at the KV and index-K gates.
	WaitKVSeconds, WaitIndexKSeconds []float64
}

// LoadSnapshot is one load back from host that has not settled.
type LoadSnapshot struct {
	Requests    []uint64 // requests whose prefix it loads
	Pages       int
	KVLayers    int // layers whose K and V landed
	IndexLayers int // layers whose index-K landed
	Layers      int
	Over        bool
}

// attachTier gives the rank's prefix cache a host tier of pages pages.
func (l *rankLoop) attachTier(pages int) error {
	pool := l.rk.Pool()
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
	if err := l.cache.AttachHost(host, ld, w, l.e.cfg.HiCache.Policy); err != nil {
		ld.Close()
		w.Close()
		return errors.Join(err, host.Close())
	}
	// Published first, then paced: a SetHiCacheBandwidth in between either
	// sees the loader or stored its value before this read.
	l.tier.loader.Store(ld)
	ld.SetBandwidth(l.e.hicacheBandwidth.Load())
	return nil
}

// detachTier takes the rank's host tier off: waiting requests give up the
// host part of their cached prefix (they will compute it), loads in flight
// finish, and the host pool's memory goes back to the OS.
func (l *rankLoop) detachTier() error {
	if !l.cache.Attached() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for id, s := range l.seqs {
		if s.hm == nil {
			continue
		}
		if err := l.dropHostMatch(s); err != nil {
			return err
		}
		if err := l.sched.Uncache(id, len(s.matched)*l.e.cfg.PageSize, l.now); err != nil {
			return fmt.Errorf("serve: rank %d: hicache off: %w", l.r, err)
		}
	}
	l.addTotals(&l.tier.base)
	host, err := l.cache.DetachHost(ctx)
	if err != nil {
		return fmt.Errorf("serve: rank %d: hicache off: %w", l.r, err)
	}
	l.tier.loader.Store(nil)
	if err := host.Close(); err != nil { // the tier is off either way
		l.e.cfg.Logger.Error("serve: hicache off: host memory kept", "server", l.e.cfg.Name, "rank", l.r, "err", err)
	}
	return nil
}

// dropHostMatch lets go of s's host pins from admit (its host part is not
// loaded: the request ended or the tier goes).
func (l *rankLoop) dropHostMatch(s *seqState) error {
	if s.hm == nil {
		return nil
	}
	hm := *s.hm
	s.hm = nil
	pages, _, err := l.cache.LoadBack(ctx, nil, hm, hm.N)
	if err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	s.matched = pages
	return nil
}

// addTotals adds the attached loader's and writer's counters (and the
// cache's, which survive detaching) to t.
func (l *rankLoop) addTotals(t *TierTotals) {
	if ld := l.cache.Loader(); ld != nil {
		n, b, f, s := ld.Stats()
		t.Loads, t.LoadBytes, t.LoadFailures, t.LoadSeconds = t.Loads+n, t.LoadBytes+b, t.LoadFailures+f, t.LoadSeconds+s
	}
	if w := l.cache.Writer(); w != nil {
		n, b, f, s := w.Stats()
		t.Backups, t.BackupBytes, t.BackupFailures, t.BackupSeconds = t.Backups+n, t.BackupBytes+b, t.BackupFailures+f, t.BackupSeconds+s
	}
}

// publishTier stores the rank's tier snapshot for readers off the loop.
func (l *rankLoop) publishTier() {
	if l.cache == nil {
		return
	}
	if prev := l.tier.snap.Load(); prev != nil && !prev.On && !l.cache.Attached() &&
		prev.LoadBandwidth == l.e.hicacheBandwidth.Load() {
		// Off, and published so: nothing in the snapshot moves until
		// the tier comes back (its totals only change while it is on).
		return
	}
	t := l.tier.base
	l.addTotals(&t)
	st := l.cache.TierStats()
	t.HostHits, t.HitTokens, t.Abandoned, t.DroppedTokens = st.HostHits, st.HitTokens, st.Abandoned, st.DroppedTokens
	snap := &TierSnapshot{
		Rank: l.r, On: l.cache.Attached(), Policy: l.e.cfg.HiCache.Policy.String(),
		LoadBandwidth: l.e.hicacheBandwidth.Load(), PageSize: l.e.cfg.PageSize, Totals: t,
	}
	if h := l.cache.Host(); h != nil {
		snap.HostPages, snap.HostUsed = h.TotalPages(), h.UsedPages()
		// Counting host-only nodes walks the tree: at most once a second.
		if prev := l.tier.snap.Load(); prev != nil && prev.On && time.Since(l.tier.counted) < time.Second {
			snap.HostOnlyPages = prev.HostOnlyPages
		} else {
			snap.HostOnlyPages, l.tier.counted = l.cache.HostOnly(), time.Now()
		}
	}
	for _, li := range l.cache.LoadsInFlight() {
		kv, idx, over := li.Load.Progress()
		ls := LoadSnapshot{Pages: len(li.Pages), KVLayers: kv, IndexLayers: idx, Layers: len(l.tier.waitKV), Over: over}
		for id, s := range l.seqs {
			if l.readsAny(s, li.Pages) {
				ls.Requests = append(ls.Requests, id)
			}
		}
		snap.Loads = append(snap.Loads, ls)
	}
	snap.WaitKVSeconds = make([]float64, len(l.tier.waitKV))
	snap.WaitIndexKSeconds = make([]float64, len(l.tier.waitIndexK))
	for i := range l.tier.waitKV {
		snap.WaitKVSeconds[i] = time.Duration(l.tier.waitKV[i].Load()).Seconds()
		snap.WaitIndexKSeconds[i] = time.Duration(l.tier.waitIndexK[i].Load()).Seconds()
	}
	l.tier.snap.Store(snap)
}

// readsAny reports whether s's matched prefix includes one of pages.
func (l *rankLoop) readsAny(s *seqState, pages []int32) bool {
	for _, p := range s.matched {
		for _, q := range pages {
			if p == q {
				return true
			}
		}
	}
	return false
}

// gate is the forward pass's gate for a sequence reading unsettled loads:
// each wait is timed per layer, and under FaultHiCacheIndexKUngated the
// index-K read does not wait at all.
func (l *rankLoop) gate(loads hicache.Loads) hicache.Gate {
	return hicache.Gate{
		Loads:         loads,
		IndexKUngated: func() bool { return l.e.faults.onAt(idxIndexKUngated) },
		Waited: func(layer int, indexK bool, d time.Duration) {
			if indexK {
				l.tier.waitIndexK[layer].Add(int64(d))
			} else {
				l.tier.waitKV[layer].Add(int64(d))
			}
		},
	}
}

// ErrHiCacheBusy: a HiCache switch is already waiting for the loops.
var ErrHiCacheBusy = errors.New("serve: a hicache switch is already pending")

// tierOp is a HiCache switch on its way to the loops.
type tierOp struct {
	off   bool
	pages int // host pages per rank when on
}

// applyTier runs the step input's HiCache switch on this rank.
func (l *rankLoop) applyTier(op tierOp) error {
	if l.cache == nil {
		return nil
	}
	if op.off {
		return l.detachTier()
	}
	if l.cache.Attached() {
		return nil
	}
	if err := l.attachTier(op.pages); err != nil {
		return fmt.Errorf("serve: rank %d: hicache on: %w", l.r, err)
	}
	return nil
}

// loadBack loads the host part of a request's cached prefix back at its
// first admission, extending its locked match over the loaded pages. The
// scheduler planned their pages, so the room is there; a shortfall is a
// broken plan.
func (l *rankLoop) loadBack(it sched.Item, s *seqState) error {
	if s.hm == nil {
		if len(s.matched)*l.e.cfg.PageSize < it.Cached {
			return fmt.Errorf("serve: rank %d: admit %d: %d cached tokens planned, %d matched and nothing to load", l.r, it.ID, it.Cached, len(s.matched)*l.e.cfg.PageSize)
		}
		return nil
	}
	hm := *s.hm
	s.hm = nil
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	pages, got, err := l.cache.LoadBack(ctx, s.all, hm, it.Cached)
	if err != nil {
		return fmt.Errorf("serve: rank %d: load back %d: %w", l.r, it.ID, err)
	}
	s.matched = pages
	if got != it.Cached {
		return fmt.Errorf("serve: rank %d: load back %d: %d of %d cached tokens on the device, the plan's room did not suffice", l.r, it.ID, got, it.Cached)
	}
	return nil
}

// settle waits, after the forward pass, for the loads it read through
// gates and makes their pages plain device pages, before the sampler, a
// PD prefill's KV chunks or Finish read them.
func (l *rankLoop) settle() error {
	if len(l.gated) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err := l.cache.Settle(ctx, l.gated)
	clear(l.gated)
	l.gated = l.gated[:0]
	if err != nil {
		return fmt.Errorf("serve: rank %d: %w", l.r, err)
	}
	return nil
}

// offloadOp is an Offload waiting for the loops.
type offloadOp struct {
	prompt []int32
	done   chan offloadResult
}

type offloadResult struct {
	tokens int
	err    error
}

// ErrOffloadBusy: an offload is already waiting for the loops.
var ErrOffloadBusy = errors.New("serve: an offload is already pending")

// applyOffload runs the step input's offload on this rank; rank 0 reports.
func (l *rankLoop) applyOffload(prompt []int32) error {
	if l.cache == nil {
		return nil
	}
	var res offloadResult
	if l.cache.Attached() {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		res.tokens, res.err = l.cache.Offload(ctx, prompt)
		cancel()
		if res.err != nil {
			return fmt.Errorf("serve: rank %d: %w", l.r, res.err) // the writer is stuck
		}
	} else {
		// Switched off in the same step, or before: the caller hears it.
		res.err = errors.New("serve: offload: the host tier went off")
	}
	if l.r == 0 {
		l.e.inbox.offloaded(res)
	}
	return nil
}
