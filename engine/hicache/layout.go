package hicache

import (
	"fmt"
	"math"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/kernels"
)

// Layout is the byte layout of one host page, derived from the device pool's
// shape. Pages are page-first: a page's layers are contiguous, and each layer
// is K rows | V rows | index-K rows | index-K scales, in the byte formats of
// kvcache's AppendKV and AppendIndexK: K and V rows in the device pool's
// element type (KVType), so a 16-bit pool's pages take half the KV bytes. A
// latent pool's layer has no V rows: its K rows are the latent rows.
type Layout struct {
	Layers      int
	PageSize    int
	KVType      kernels.DType // element type of the K and V rows: F32, BF16 or F16
	KVBytes     int           // K rows of one layer of one page
	VBytes      int           // V rows of one layer of one page: KVBytes, or 0 for a latent pool
	IndexBytes  int           // index-K rows of one layer of one page
	ScaleBytes  int           // index-K scales of one layer of one page (fp8 only)
	LayerBytes  int           // KVBytes + VBytes + IndexBytes + ScaleBytes
	PageBytes   int           // Layers * LayerBytes
	indexConfig *kvcache.IndexKConfig
	kvDim       int
	latent      bool
}

// LayoutOf is the host layout that mirrors device pool configuration c.
func LayoutOf(c kvcache.Config) (Layout, error) {
	if err := c.Validate(); err != nil {
		return Layout{}, err
	}
	l := Layout{Layers: c.Layers, PageSize: c.PageSize, KVType: c.KVType, kvDim: c.KVDim, latent: c.Latent}
	big := func(a, b int) (int, error) {
		if a != 0 && b > math.MaxInt/a {
			return 0, fmt.Errorf("hicache: page layout overflows (%d*%d)", a, b)
		}
		return a * b, nil
	}
	var err error
	if l.KVBytes, err = big(c.PageSize*c.KVDim, c.KVElemBytes()); err != nil {
		return Layout{}, err
	}
	if !c.Latent {
		l.VBytes = l.KVBytes
	}
	if ik := c.IndexK; ik != nil {
		cp := *ik
		l.indexConfig = &cp
		switch ik.DType {
		case kernels.IndexFP8:
			l.IndexBytes = c.PageSize * ik.Dim
			l.ScaleBytes = c.PageSize * 4
		case kernels.IndexBF16:
			l.IndexBytes = c.PageSize * ik.Dim * 2
		}
	}
	l.LayerBytes = l.KVBytes + l.VBytes + l.IndexBytes + l.ScaleBytes
	if l.PageBytes, err = big(l.LayerBytes, c.Layers); err != nil {
		return Layout{}, err
	}
	return l, nil
}

// check is nil when device pool configuration c has this layout's shape, and
// otherwise an ErrShape that says what differs.
func (l Layout) check(c kvcache.Config) error {
	if c.KVType != l.KVType {
		return fmt.Errorf("%w: the device pool stores KV as %s, the host pool as %s: both tiers must use one --kv-dtype",
			ErrShape, kernels.KVName(c.KVType), kernels.KVName(l.KVType))
	}
	if c.Layers != l.Layers || c.PageSize != l.PageSize || c.KVDim != l.kvDim || c.Latent != l.latent {
		return fmt.Errorf("%w: device pool of %d layers, page size %d, KV dim %d (latent %v) for a host layout of %d layers, page size %d, KV dim %d (latent %v)",
			ErrShape, c.Layers, c.PageSize, c.KVDim, c.Latent, l.Layers, l.PageSize, l.kvDim, l.latent)
	}
	a, b := c.IndexK, l.indexConfig
	if (a == nil) != (b == nil) || (a != nil && *a != *b) {
		return fmt.Errorf("%w: device pool index-K %s, host layout index-K %s", ErrShape, indexName(a), indexName(b))
	}
	return nil
}

func indexName(ic *kvcache.IndexKConfig) string {
	if ic == nil {
		return "none"
	}
	return fmt.Sprintf("%v of %d", ic.DType, ic.Dim)
}

// PagesForBytes is how many host pages fit in bytes for device pool
// configuration c (the --hicache-size sizing).
func PagesForBytes(c kvcache.Config, bytes int64) (int, error) {
	l, err := LayoutOf(c)
	if err != nil {
		return 0, err
	}
	if bytes < 0 {
		return 0, fmt.Errorf("hicache: host pool of %d bytes", bytes)
	}
	return int(min(bytes/int64(l.PageBytes), math.MaxInt32)), nil
}

// PagesForRatio is ratio times the device pool's pages (the --hicache-ratio
// sizing), rounded down.
func PagesForRatio(c kvcache.Config, ratio float64) (int, error) {
	if err := c.Validate(); err != nil {
		return 0, err
	}
	if !(ratio > 0) || math.IsInf(ratio, 0) {
		return 0, fmt.Errorf("hicache: host pool ratio %v, want a positive number", ratio)
	}
	n := math.Floor(float64(c.Pages) * ratio)
	if n > math.MaxInt32 {
		return 0, fmt.Errorf("hicache: host pool ratio %v of %d pages is %.0f pages, more than %d", ratio, c.Pages, n, math.MaxInt32)
	}
	return int(n), nil
}

// layerOffsets are the byte offsets of layer's parts within host page hp.
func (l Layout) layerOffsets(hp int32, layer int) (k, v, idx, scale int) {
	base := int(hp)*l.PageBytes + layer*l.LayerBytes
	k = base
	v = k + l.KVBytes
	idx = v + l.VBytes
	scale = idx + l.IndexBytes
	return
}
