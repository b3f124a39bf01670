// Package hicache is the host-memory tier of the KV cache (HiCache): a pool
// of whole pages in host memory below a rank's device pool (kvcache.Pool),
// and a loader that copies pages back to the device layer by layer while the
// forward pass runs.
//
// What exists:
//
//   - HostPool: per rank, pages in the tier's own page-first layout, each
//     holding every layer's K and V rows and index-K rows and scales. It is
//     sized in pages (PagesForBytes, PagesForRatio) and NewHostPool refuses a
//     size beyond the memory it is told is available. Backup copies device
//     pages to host pages; the loader copies them back. Both go through
//     kvcache's own row copies (AppendKV, AppendIndexK, FillKV, FillIndexK), so
//     there is no second codec. Entries (the pages backed up under one key,
//     e.g. one radix node) are evicted least recently used first, never while
//     a load pins them; Check verifies the accounting (used + free = total).
//     Its memory is mapped outside the Go heap, so that it neither raises
//     the garbage collector's target nor lingers once the tier is off: Close
//     (after the last load and backup) unmaps it, and MappedBytes counts
//     what the process's open pools hold.
//   - Loader: one goroutine that runs queued loads in order, layer by layer:
//     layer i's K and V, then layer i's index-K rows and scales, marking each
//     part done in a small producer ring of load slots. A slot is not reused
//     until its load's last layer has finished (or the load was aborted and
//     the loader let go of it). Readers wait per layer with two gates,
//     Load.WaitKV and Load.WaitIndexK, because the sparse indexer reads
//     index-K before attention reads KV: a single wait at the top of a layer
//     is what let production incident 3 (the HiCache index-K race) happen.
//     Concurrent hits on one key share one load (Join). SubmitKeys loads
//     several entries (e.g. a radix path of one-page nodes) as one load in
//     one slot, each layer of all of them before the layer is marked. Loads may be paced by
//     a bytes/second budget (SetBandwidth) to restore a GPU's copy-to-compute
//     ratio on a CPU build; the default is unlimited. HoldBeforeLayer and
//     HoldBeforeIndexK are test hooks that park the loader before a layer's
//     KV or between its KV and its index-K, deterministically.
//
// The forward pass's gates: a *Load is a model.LayerGate as it is. Set as a
// sequence's model.SeqInput.Gate, it holds the indexer's read of layer i's
// index-K at WaitIndexK and attention's read of layer i's KV at WaitKV.
//
//   - Writer: one goroutine that runs queued backups (HostPool.Backup) in
//     order, so that the loop that owns the device pool never copies.
//
// engine/prefix attaches a HostPool, Loader and Writer to its radix cache
// (prefix.Cache.AttachHost) and engine/serve drives it from the rank loops;
// see those packages for the policies and the agreement between ranks.
//
// Concurrency: HostPool is safe for concurrent use (its own lock; copies run
// outside it on pinned or not-yet-published pages). The Loader writes only the
// device pages of its loads (kvcache.Pool.FillKV, FillIndexK); the caller
// allocates them before Submit and must not write, free or hand them to a
// reader except through the gates until the load has finished or Abort has
// returned. The Writer only reads the device pages of its backups; the
// caller keeps them unchanged until each backup is over.
package hicache
