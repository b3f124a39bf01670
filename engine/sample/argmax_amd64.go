//go:build amd64

package sample

import "golang.org/x/sys/cpu"

//go:noescape
func maxF32x32(x *float32, n32 int) float32

//go:noescape
func firstEqF32x8(x *float32, n8 int, m float32) int

var hasAVX2 = cpu.X86.HasAVX && cpu.X86.HasAVX2

// greedy is Greedy with AVX2: the maximum in one vector pass, then the first
// element equal to it in another. It finds what greedyGo finds: NaN is
// skipped by the maximum and never equals it, and the first of equal
// maxima comes first in the scan.
func greedy(logits []float32) int32 {
	n := len(logits)
	if !hasAVX2 || n < 64 {
		return greedyGo(logits)
	}
	n32 := n / 32
	m := maxF32x32(&logits[0], n32)
	for _, v := range logits[32*n32:] {
		if v > m {
			m = v
		}
	}
	n8 := n / 8
	if i := firstEqF32x8(&logits[0], n8, m); i >= 0 {
		return int32(i)
	}
	for i := 8 * n8; i < n; i++ {
		if logits[i] == m {
			return int32(i)
		}
	}
	return 0 // every logit is NaN
}
