package debug

// HiCache: a host-memory tier under each rank's KV prefix cache. Prefix
// pages are backed up to host memory (write-through: as soon as they are
// cached; write-back: when evicted from the device), and a prompt whose
// prefix is on host only is loaded back layer by layer while its forward
// pass runs, each layer's reads waiting at that layer's gate.

// HiCachePath is every rank's host tier (GET, JSON HiCacheResponse).
const HiCachePath = "/debug/v1/hicache"

// The admin calls that switch the host tier live (POST, JSON
// HiCacheSwitchResponse): on, off, and the loaders' pacing, whose
// bytes_per_second is a query parameter or the JSON body
// HiCacheBandwidthRequest.
const (
	HiCacheOnPath        = "/admin/v1/hicache/on"
	HiCacheOffPath       = "/admin/v1/hicache/off"
	HiCacheBandwidthPath = "/admin/v1/hicache/bandwidth"
)

// HiCacheOffloadPath moves the cached prefix of a prompt to every rank's
// host tier, so that the next request with that prefix loads it back
// (POST, JSON HiCacheOffloadRequest, answered with HiCacheOffloadResponse).
const HiCacheOffloadPath = "/admin/v1/hicache/offload"

// HiCacheSettings is the host tier's configuration (Settings.HiCache).
type HiCacheSettings struct {
	// EnabledAtStart says the tier was on when the server started; it is
	// switched live since (GET /debug/v1/hicache says whether it is on now).
	EnabledAtStart bool `json:"enabled_at_start"`
	// SizeBytes is the host pool per rank; 0: sized by Ratio.
	SizeBytes int64 `json:"size_bytes"`
	// Ratio sizes the host pool as Ratio × the device pool's pages when
	// SizeBytes is 0.
	Ratio float64 `json:"ratio"`
	// WritePolicy is when prefix pages are backed up: write-through or
	// write-back.
	WritePolicy string `json:"write_policy"`
	// LoadBandwidthBytesPerSecond paces each rank's loads back from host
	// (0: unlimited); the value now, as the admin API may have changed it.
	LoadBandwidthBytesPerSecond int64 `json:"load_bandwidth_bytes_per_second"`
}

// HiCacheResponse is the body of GET /debug/v1/hicache: every rank's host
// tier as the rank last published it (after its last loop iteration).
type HiCacheResponse struct {
	// PrefixCache is false on a server without a prefix cache
	// (--no-prefix-cache): it has no tier to switch on, and Ranks is empty.
	PrefixCache bool `json:"prefix_cache"`
	// NoTier says why the server has no host tier to switch on (no
	// prefix cache, or a decode server, which keeps none); empty when it
	// can have one.
	NoTier string `json:"no_tier,omitempty"`
	// On says every rank's tier is on.
	On    bool          `json:"on"`
	Ranks []HiCacheRank `json:"ranks"`
}

// HiCacheRank is one rank's host tier.
type HiCacheRank struct {
	Rank int  `json:"rank"`
	On   bool `json:"on"`
	// Policy is the write policy (write-through or write-back).
	Policy                      string `json:"policy"`
	LoadBandwidthBytesPerSecond int64  `json:"load_bandwidth_bytes_per_second"` // 0: unlimited
	PageSize                    int    `json:"page_size"`                       // tokens per page
	// The host pool, in pages and in tokens (pages × page size): its size
	// (0 while off), the pages holding cached prefixes, and of those the
	// ones whose prefix is on host only (evicted from the device).
	HostPages      int `json:"host_pages"`
	HostPagesUsed  int `json:"host_pages_used"`
	HostOnlyPages  int `json:"host_only_pages"`
	HostTokens     int `json:"host_tokens"`
	HostTokensUsed int `json:"host_tokens_used"`
	// Totals count since the server started, across every time the tier
	// was switched on.
	Totals HiCacheTotals `json:"totals"`
	// Loads are the loads back from host not yet settled.
	Loads []HiCacheLoad `json:"loads"`
	// WaitKVMS and WaitIndexKMS are, per layer, the time the forward pass
	// waited at that layer's gates for loads to land: the KV read
	// (attention) and the index-K read (the sparse indexer).
	WaitKVMS     []float64 `json:"wait_kv_ms"`
	WaitIndexKMS []float64 `json:"wait_index_k_ms"`
}

// HiCacheTotals are a rank's host tier counters.
type HiCacheTotals struct {
	Backups        uint64  `json:"backups"` // pages written to host
	BackupBytes    uint64  `json:"backup_bytes"`
	BackupFailures uint64  `json:"backup_failures"`
	BackupMS       float64 `json:"backup_ms"` // time spent writing
	Loads          uint64  `json:"loads"`     // loads back from host
	LoadBytes      uint64  `json:"load_bytes"`
	LoadFailures   uint64  `json:"load_failures"`
	LoadMS         float64 `json:"load_ms"` // time spent loading
	// HostHits counts requests whose cached prefix was loaded (partly)
	// back from host, HitTokens the prompt tokens so loaded.
	HostHits  uint64 `json:"host_hits"`
	HitTokens uint64 `json:"hit_tokens"`
	// AbandonedLoads counts loads given up because their requests went;
	// DroppedTokens the host-only cached tokens forgotten (evicted from
	// host, or the tier switched off).
	AbandonedLoads uint64 `json:"abandoned_loads"`
	DroppedTokens  uint64 `json:"dropped_tokens"`
}

// HiCacheLoad is one load back from host in flight.
type HiCacheLoad struct {
	Requests    []ID `json:"requests"` // the requests whose prefix it loads
	Pages       int  `json:"pages"`
	KVLayers    int  `json:"kv_layers"`    // layers whose K and V have landed
	IndexLayers int  `json:"index_layers"` // layers whose index-K has landed
	Layers      int  `json:"layers"`
	Over        bool `json:"over"` // every layer landed (or the load failed)
}

// HiCacheBandwidthRequest is the JSON body of POST
// /admin/v1/hicache/bandwidth (or its query: ?bytes_per_second=N).
type HiCacheBandwidthRequest struct {
	// BytesPerSecond paces every rank's loads back from host; 0: unlimited.
	BytesPerSecond *int64 `json:"bytes_per_second"`
}

// HiCacheSwitchResponse answers the admin calls on, off and bandwidth:
// the tier's state after the call.
type HiCacheSwitchResponse struct {
	// Changed is false when every rank already was as asked (nothing
	// queued).
	Changed bool `json:"changed"`
	// Pending says the switch is queued for the loops (every rank switches
	// in the same iteration) but they had not taken it when the server
	// answered (202); GET /debug/v1/hicache shows when they do.
	Pending bool `json:"pending"`
	HiCacheResponse
}

// HiCacheOffloadRequest is the body of POST /admin/v1/hicache/offload: the
// prompt whose cached prefix goes to host, as text (encoded as a
// completion's text prompt is) or as token ids; exactly one of the two.
type HiCacheOffloadRequest struct {
	Prompt string  `json:"prompt,omitempty"`
	Tokens []int32 `json:"tokens,omitempty"`
}

// HiCacheOffloadResponse answers POST /admin/v1/hicache/offload.
type HiCacheOffloadResponse struct {
	// PromptTokens is the prompt's length in tokens.
	PromptTokens int `json:"prompt_tokens"`
	// OffloadedTokens are the prompt's tokens this call took off the device
	// to the host tier (rank 0's count; every rank offloads the same
	// pages): its whole pages as far as the device cached them, none of
	// them in use and none shared with another cached prompt's path. 0 when
	// nothing of it was cached on the device (never cached, or on host
	// only already); a page held by a request still running stays, and a
	// later call moves it.
	OffloadedTokens int `json:"offloaded_tokens"`
}
