//go:build amd64

package cpu

import "unsafe"

// dot1x8F32S is dot1x8F32P over np ≥ 1 consecutive panels: panel p is the
// eight float32 rows at w + (8p+j)·rb bytes, j < 8, and out[8p+j] is the
// canonical dot of x with row 8p+j over its first 8·n8 columns (n8 ≥ 1),
// the same FMAs in the same order as dot1x8F32. Per 8 columns it prefetches
// the next 256 bytes from w + pfoff on, one pointer that walks on from
// panel to panel (as far as the panels when the rows have no tail).
// Decode's calls of MatMul with one x row run it (or a twin) over a whole
// part: the Go code between two calls of the 1×8 kernel (row pointers,
// prefetch region, tails) left DRAM idle long enough to cost 5–10% of the
// stream rate at 768 columns (see docs/kernels.md).
//
//go:noescape
func dot1x8F32S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)

// dot1x8F16S and dot1x8BF16S are dot1x8F32S over rows of IEEE halves and
// bfloat16s (dot1x8F16P and dot1x8BF16P looped over panels), widened
// exactly; they prefetch 128 bytes per 8 columns.
//
//go:noescape
func dot1x8F16S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)

//go:noescape
func dot1x8BF16S(x *float32, w unsafe.Pointer, rb, n8, np int, out *float32, pfoff int)
