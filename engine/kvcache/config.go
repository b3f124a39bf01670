// Package kvcache is one rank's paged KV memory: per-layer K and V arrays
// addressed by slot, per-layer index-K buffers for the sparse indexer, a page
// allocator and the request-to-token table that maps each sequence's token
// positions to slots.
//
// A slot is one token's place in the pool: slot = page*PageSize + offset. A
// sequence (Seq) owns whole pages and one row of the request-to-token table;
// row entry i is the slot of token position i.
//
// Pages may be shared: a page's holders are the live sequences that use it
// and the prefix cache, counted by a reference count (see share.go). A
// sequence may start from full pages the cache holds (NewSeqWithPrefix),
// reading them without copying; a finished sequence's full pages move to the
// cache (ReleaseTo) and the cache frees them when it evicts (FreeCached). A
// page with more than one holder, or held by the cache, is never written.
// Index keys share the slots of K and V, so they are shared with them.
//
// A Pool belongs to one rank's loop and is not safe for concurrent use. The
// only exceptions are FreePages, TotalPages and Live, which read atomics so
// that a debug reader may call them while the loop is stuck.
//
// Built with -race or -tags invariants, every mutating call re-checks the
// whole accounting (Pool.Check) and panics on the first broken invariant.
package kvcache

import (
	"errors"
	"fmt"
	"math"

	"github.com/pdkit/pdkit/kernels"
)

// MaxPageSize is the largest number of tokens per page.
const MaxPageSize = 4096

// Config sizes one rank's pool.
type Config struct {
	Layers     int
	KVDim      int // NKVHeads*HeadDim of this rank
	PageSize   int // tokens per page (1..MaxPageSize)
	Pages      int // total pages
	IndexK     *IndexKConfig
	MaxSeqs    int // rows in the request-to-token table
	MaxContext int // longest sequence (tokens) a row can hold
	// KVType is the element type K and V are stored in: kernels.F32 (the
	// zero value), kernels.BF16 or kernels.F16. A 16-bit pool rounds each
	// written row to nearest even (kernels.EncodeKV) and takes half the
	// bytes per token, in memory and in transfer.
	KVType kernels.DType
	// Latent says the pool stores one row per token and layer, of KVDim
	// elements, and no V rows: a multi-head latent attention model's
	// latent and RoPE key, which attention reads as its keys and its
	// values alike. Transfers and host pages then carry K rows only.
	Latent bool
}

// IndexKConfig describes the sparse indexer's per-layer key buffer; nil in a
// Config when the model has no indexer.
type IndexKConfig struct {
	DType kernels.IndexKDType
	Dim   int
}

// Slots is the number of token slots in the pool (Pages*PageSize). Only
// meaningful for a valid Config.
func (c Config) Slots() int { return c.Pages * c.PageSize }

// KVElemBytes is the size of one stored K or V element: 4 for F32, 2 for
// BF16 and F16.
func (c Config) KVElemBytes() int { return kernels.KVElemBytes(c.KVType) }

// KVRowBytes is the size of one token's K row (or V row) as stored and as
// moved by AppendKV and PutKV: KVDim elements of KVElemBytes.
func (c Config) KVRowBytes() int { return c.KVDim * c.KVElemBytes() }

// VDim is the width of one token's V row: KVDim, or 0 for a latent pool.
func (c Config) VDim() int {
	if c.Latent {
		return 0
	}
	return c.KVDim
}

// VRowBytes is the size of one token's V row as stored and moved: 0 for a
// latent pool.
func (c Config) VRowBytes() int { return c.VDim() * c.KVElemBytes() }

// PagesFor is the number of pages that hold tokens tokens.
func (c Config) PagesFor(tokens int) int {
	if tokens <= 0 {
		return 0
	}
	return (tokens-1)/c.PageSize + 1
}

// Validate rejects every configuration NewPool could not honour: non-positive
// sizes, a page size out of range, a KV type other than F32, BF16 and F16,
// an unknown index-K dtype, a MaxContext that
// the pool's pages cannot cover, and sizes whose slot count, slice lengths or
// byte totals overflow.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("kvcache: "+format, args...))
	}
	positive := func(name string, v int) bool {
		if v <= 0 {
			bad("%s must be positive, got %d", name, v)
			return false
		}
		return true
	}
	okLayers := positive("Layers", c.Layers)
	okDim := positive("KVDim", c.KVDim)
	okPages := positive("Pages", c.Pages)
	okSeqs := positive("MaxSeqs", c.MaxSeqs)
	okCtx := positive("MaxContext", c.MaxContext)
	okPS := true
	if c.PageSize < 1 || c.PageSize > MaxPageSize {
		bad("PageSize must be in 1..%d, got %d", MaxPageSize, c.PageSize)
		okPS = false
	}
	okType := true
	switch c.KVType {
	case kernels.F32, kernels.BF16, kernels.F16:
	default:
		bad("KVType %v is none of f32, bf16, f16", c.KVType)
		okType = false
	}
	okIdx := true
	if c.IndexK != nil {
		if c.IndexK.DType != kernels.IndexFP8 && c.IndexK.DType != kernels.IndexBF16 {
			bad("IndexK.DType %v is neither fp8 nor bf16", c.IndexK.DType)
			okIdx = false
		}
		if c.IndexK.Dim <= 0 {
			bad("IndexK.Dim must be positive, got %d", c.IndexK.Dim)
			okIdx = false
		}
	}

	// Sizes that depend on several fields.
	slots, okSlots := 0, false
	if okPages && okPS {
		var ok bool
		slots, ok = mul(c.Pages, c.PageSize)
		switch {
		case !ok || slots > math.MaxInt32:
			// Slots are int32 in the request-to-token table and the kernels.
			bad("Pages*PageSize = %d*%d exceeds %d slots", c.Pages, c.PageSize, math.MaxInt32)
		default:
			okSlots = true
		}
	}
	if okSlots && okCtx && c.MaxContext > slots {
		bad("MaxContext %d is more than the pool holds (%d pages of %d = %d tokens)",
			c.MaxContext, c.Pages, c.PageSize, slots)
	}
	if okSeqs && okCtx {
		if _, ok := mul(c.MaxSeqs, c.MaxContext); !ok {
			bad("request-to-token table MaxSeqs*MaxContext = %d*%d overflows", c.MaxSeqs, c.MaxContext)
		}
	}
	if okSlots && okDim && okLayers && okIdx && okType {
		if _, err := c.bytes(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// bytes is the memory the pool's arrays take: K and V, index keys and their
// scales. It fails when a slice length or the total overflows.
func (c Config) bytes() (int64, error) {
	slots := c.Slots()
	overflow := func(what string) error {
		return fmt.Errorf("kvcache: %s overflows (Layers %d, Pages %d, PageSize %d, KVDim %d)",
			what, c.Layers, c.Pages, c.PageSize, c.KVDim)
	}
	kvLen, ok := mul(slots, c.KVDim)
	if !ok || kvLen > math.MaxInt/4 {
		return 0, overflow("per-layer K/V length")
	}
	perLayer := int64(kvLen) * int64(c.KVElemBytes()) // K
	if !c.Latent {
		perLayer *= 2 // and V
	}
	if c.IndexK != nil {
		n, ok := mul(slots, c.IndexK.Dim)
		if !ok || n > math.MaxInt/2 {
			return 0, overflow(fmt.Sprintf("per-layer index-K length (Dim %d)", c.IndexK.Dim))
		}
		switch c.IndexK.DType {
		case kernels.IndexFP8:
			perLayer += int64(n) + 4*int64(slots)
		case kernels.IndexBF16:
			perLayer += 2 * int64(n)
		}
		if perLayer < 0 {
			return 0, overflow("per-layer bytes")
		}
	}
	total, ok := mul64(perLayer, int64(c.Layers))
	if !ok {
		return 0, overflow("total bytes")
	}
	return total, nil
}

// TokenBytes is the memory one token takes in a pool of c's shape: its K
// and V rows (or latent row) and index key with its scale, every layer.
// Pages and PageSize do not enter; sizing a pool from a memory budget
// divides by it.
func (c Config) TokenBytes() int64 {
	one := c
	one.Pages, one.PageSize, one.MaxSeqs, one.MaxContext = 1, 1, 1, 1
	b, err := one.bytes()
	if err != nil {
		return 0
	}
	return b
}

// mul multiplies non-negative ints, reporting overflow.
func mul(a, b int) (int, bool) {
	if a == 0 || b == 0 {
		return 0, true
	}
	if a > math.MaxInt/b {
		return 0, false
	}
	return a * b, true
}

func mul64(a, b int64) (int64, bool) {
	if a == 0 || b == 0 {
		return 0, true
	}
	if a > math.MaxInt64/b {
		return 0, false
	}
	return a * b, true
}
