package serve

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/internal/procstat"
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

// Validate refuses a host tier that cannot work, with or without the
// prefix cache (disablePrefix): the rules Config.Validate applies, for a
// caller that checks the tier's flags before it builds an engine (launch,
// before it starts its servers).
func (c HiCacheConfig) Validate(disablePrefix bool) error {
	var errs []error
	c.validate(disablePrefix, "", func(format string, args ...any) { errs = append(errs, fmt.Errorf("serve: "+format, args...)) })
	return errors.Join(errs...)
}

func (c HiCacheConfig) validate(disablePrefix bool, role string, bad func(string, ...any)) {
	switch {
	case c.Enabled && disablePrefix:
		bad("--hicache needs the prefix cache, which --no-prefix-cache turns off: drop one of them (the host tier lies under the prefix cache)")
	case c.Enabled && role == pdproto.RoleDecode:
		bad("--hicache on a decode server: %s", NoTierOnDecode)
	case c.Bytes < 0 || c.Ratio < 0 || math.IsNaN(c.Ratio) || math.IsInf(c.Ratio, 0):
		bad("hicache size %d bytes / ratio %v (--hicache-size, --hicache-ratio): want non-negative", c.Bytes, c.Ratio)
	case c.LoadBandwidth < 0:
		bad("hicache load bandwidth %d (--hicache-load-bandwidth): want non-negative (0 is unlimited)", c.LoadBandwidth)
	case !slices.Contains(prefix.Policies, c.Policy):
		bad("hicache policy %v (--hicache-write-policy): want %s", c.Policy, prefix.PolicyNames())
	}
}

// NoTierOnDecode is why a decode server keeps no host tier. SGLang's
// decode can offload its KV to a storage tier that the prefill servers
// share and read; pdkit has no such shared tier, and the decode's own
// prefix cache is never matched (a request's prompt KV arrives from the
// prefill), so a host tier there would copy pages no request loads back.
const NoTierOnDecode = "a decode server keeps no host tier: its requests' prompt KV comes from the prefill, and nothing matches its own prefix cache, so its backups would never be loaded back; give --hicache to the prefill servers"

// NoHostTier says why the server has no host tier to switch on; "" when
// it can have one.
func (c Config) NoHostTier() string {
	switch {
	case c.DisablePrefixCache:
		return "hicache needs the prefix cache, which is off on this server (--no-prefix-cache)"
	case c.Role == pdproto.RoleDecode:
		return NoTierOnDecode
	}
	return ""
}

// FaultHiCacheIndexKUngated makes each layer wait, for a load back from
// host, once as it begins and for its KV alone, as the incident's code
// did, and the index-K read not wait: the sparse indexer scores what was in
// the pages before the layer's index-K landed (production incident 3, the
// HiCache index-K race).
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
	n, err := procstat.MemInfo("MemAvailable")
	if err != nil {
		return 0, fmt.Errorf("reading available memory: %w", err)
	}
	return n, nil
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

// ErrHiCacheBusy: a HiCache switch is already waiting for the loops.
var ErrHiCacheBusy = errors.New("serve: a hicache switch is already pending")

// tierOp is a HiCache switch on its way to the loops.
type tierOp struct {
	off   bool
	pages int // host pages per rank when on
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
