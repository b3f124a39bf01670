//go:build amd64

package cpu

import (
	"math"
	"testing"
)

// TestExpAccuracy measures the vectorised exp against math.Exp over every
// 61st float32 from -110 to 89 (and all lengths of tail): at most 2 ulps
// where the result is normal, and within one subnormal step below.
func TestExpAccuracy(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2/FMA")
	}
	var src []float32
	for _, lim := range []float32{-110, 89} {
		for b := uint32(0); ; b += 997 {
			v := math.Float32frombits(b)
			if v > float32(math.Abs(float64(lim))) {
				break
			}
			if lim < 0 {
				v = -v
			}
			src = append(src, v)
		}
	}
	inf := float32(math.Inf(1))
	src = append(src, -inf, inf, float32(math.NaN()), 88.72, 88.73, -87.3, -87.4, -103.9, -104, 0)
	dst := make([]float32, len(src))
	expF32(&dst[0], &src[0], len(src))
	worst := 0.0
	for i, x := range src {
		want := math.Exp(float64(x))
		w32 := float32(want)
		got := dst[i]
		switch {
		case x != x:
			if got == got {
				t.Errorf("exp(NaN) = %v", got)
			}
			continue
		case math.IsInf(float64(w32), 0) || w32 == 0:
			if got != w32 {
				t.Errorf("exp(%v) = %v, want %v", x, got, w32)
			}
			continue
		}
		ulp := float64(math.Nextafter32(w32, inf) - w32)
		if w32 < 0x1p-126 {
			ulp = 0x1p-149
		}
		e := math.Abs(float64(got)-want) / ulp
		worst = max(worst, e)
		if e > 2 {
			t.Errorf("exp(%v) = %v, want %v: %.2f ulps", x, got, want, e)
		}
	}
	t.Logf("%d inputs, worst error %.3f ulps", len(src), worst)
	// Tails: every length below 16 gives the same values as the full run.
	for n := 1; n < 16; n++ {
		d := make([]float32, n)
		expF32(&d[0], &src[100], n)
		for i := range d {
			if math.Float32bits(d[i]) != math.Float32bits(dst[100+i]) {
				t.Fatalf("n=%d: exp(%v) = %v in a tail, %v in a block", n, src[100+i], d[i], dst[100+i])
			}
		}
	}
}
