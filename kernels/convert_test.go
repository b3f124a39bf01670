package kernels_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

func isNaN32(v float32) bool { return v != v }

// fp8Codes lists the finite non-negative e4m3 codes in increasing order of
// value (0x00..0x7E).
func fp8Codes() []uint8 {
	var cs []uint8
	for c := range 0x7F {
		cs = append(cs, uint8(c))
	}
	return cs
}

func TestFP8RoundTrip(t *testing.T) {
	for c := range 256 {
		v := kernels.FP8ToF32(uint8(c))
		got := kernels.F32ToFP8(v)
		if got != uint8(c) {
			t.Errorf("F32ToFP8(FP8ToF32(%#02x) = %v) = %#02x", c, v, got)
		}
	}
	// The decoded values are increasing with the code, as the encoder assumes.
	cs := fp8Codes()
	for i := 1; i < len(cs); i++ {
		if !(kernels.FP8ToF32(cs[i]) > kernels.FP8ToF32(cs[i-1])) {
			t.Fatalf("code %#02x does not decode above %#02x", cs[i], cs[i-1])
		}
	}
	if v := kernels.FP8ToF32(0x7E); v != kernels.FP8Max {
		t.Errorf("FP8ToF32(0x7e) = %v, want %v", v, kernels.FP8Max)
	}
	if v := kernels.FP8ToF32(0x01); v != 0x1p-9 {
		t.Errorf("smallest subnormal = %v, want 2^-9", v)
	}
	if v := kernels.FP8ToF32(0x08); v != 0x1p-6 {
		t.Errorf("smallest normal = %v, want 2^-6", v)
	}
}

// TestFP8Nearest checks rounding between every pair of neighbouring codes,
// normal and subnormal, both signs: below the midpoint goes down, above goes
// up, the midpoint itself goes to the even code.
func TestFP8Nearest(t *testing.T) {
	cs := fp8Codes()
	for i := 0; i+1 < len(cs); i++ {
		lo, hi := cs[i], cs[i+1]
		a, b := kernels.FP8ToF32(lo), kernels.FP8ToF32(hi)
		mid := (a + b) / 2 // exact: both have few significant bits
		even := lo
		if lo&1 != 0 {
			even = hi
		}
		for _, sign := range []uint8{0, 0x80} {
			s := float32(1)
			if sign != 0 {
				s = -1
			}
			check := func(v float32, want uint8) {
				t.Helper()
				if got := kernels.F32ToFP8(s * v); got != sign|want {
					t.Errorf("F32ToFP8(%v) = %#02x, want %#02x", s*v, got, sign|want)
				}
			}
			check(mid, even)
			check(math.Nextafter32(mid, 0), lo)
			check(math.Nextafter32(mid, 1000), hi)
			check(a+(b-a)/4, lo)
			check(b-(b-a)/4, hi)
		}
	}
	// Below half the smallest subnormal: zero (with the sign kept).
	for _, v := range []float32{0x1p-10, 0x1p-11, 1e-30, 1e-45} {
		if got := kernels.F32ToFP8(v); got != 0 {
			t.Errorf("F32ToFP8(%v) = %#02x, want 0", v, got)
		}
		if got := kernels.F32ToFP8(-v); got != 0x80 {
			t.Errorf("F32ToFP8(%v) = %#02x, want 0x80", -v, got)
		}
	}
	if got := kernels.F32ToFP8(math.Nextafter32(0x1p-10, 1)); got != 1 {
		t.Errorf("just above 2^-10: %#02x, want 0x01", got)
	}
}

func TestFP8Saturation(t *testing.T) {
	inf := float32(math.Inf(1))
	for _, v := range []float32{448, 449, 463.9, 464, 464.1, 479, 480, 512, 1e6, math.MaxFloat32, inf} {
		if got := kernels.F32ToFP8(v); got != 0x7E {
			t.Errorf("F32ToFP8(%v) = %#02x, want 0x7e (448)", v, got)
		}
		if got := kernels.F32ToFP8(-v); got != 0xFE {
			t.Errorf("F32ToFP8(%v) = %#02x, want 0xfe (-448)", -v, got)
		}
	}
	// 432 is halfway between 416 (mantissa 5) and 448 (mantissa 6): even wins.
	if got := kernels.F32ToFP8(432); got != 0x7E {
		t.Errorf("F32ToFP8(432) = %#02x, want 0x7e", got)
	}
}

func TestFP8NaN(t *testing.T) {
	nan := float32(math.NaN())
	if got := kernels.F32ToFP8(nan); got&0x7F != 0x7F {
		t.Errorf("F32ToFP8(NaN) = %#02x, want the NaN code", got)
	}
	if got := kernels.F32ToFP8(float32(math.Copysign(math.NaN(), -1))); got != 0xFF {
		t.Errorf("F32ToFP8(-NaN) = %#02x, want 0xff", got)
	}
	for _, c := range []uint8{0x7F, 0xFF} {
		if !isNaN32(kernels.FP8ToF32(c)) {
			t.Errorf("FP8ToF32(%#02x) is not NaN", c)
		}
	}
	if got := kernels.F32ToFP8(float32(math.Copysign(0, -1))); got != 0x80 {
		t.Errorf("F32ToFP8(-0) = %#02x, want 0x80", got)
	}
}

// TestFP8Error checks the round-trip error through a scale, as QuantizeFP8
// stores an index key: at most 2^-4·|x| (half an ulp of a 3-bit mantissa) for
// values in the normal range, plus scale·2^-10 (half the subnormal step)
// below it.
func TestFP8Error(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	for range 200 {
		n := 1 + r.IntN(64)
		src := make([]float32, n)
		mag := math.Pow(10, float64(r.IntN(30)-15))
		for i := range src {
			src[i] = float32((2*r.Float64() - 1) * mag * math.Pow(2, float64(-r.IntN(12))))
		}
		var amax float32
		for _, v := range src {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		scale := kernels.FP8Scale(amax)
		for _, v := range src {
			got := kernels.FP8ToF32(kernels.F32ToFP8(v/scale)) * scale
			bound := 0x1p-4*math.Abs(float64(v)) + float64(scale)*0x1p-10
			// The two scalings round too: a few float32 ulps of v.
			bound += 4 * math.Abs(float64(v)) * 0x1p-24
			if err := math.Abs(float64(got) - float64(v)); err > bound {
				t.Fatalf("x = %v, scale %v: decoded %v, |error| %.3g > %.3g", v, scale, got, err, bound)
			}
		}
	}
	if s := kernels.FP8Scale(0); s != 1 {
		t.Errorf("FP8Scale(0) = %v, want 1", s)
	}
	for _, a := range []float32{float32(math.NaN()), float32(math.Inf(1))} {
		if s := kernels.FP8Scale(a); s != 1 {
			t.Errorf("FP8Scale(%v) = %v, want 1", a, s)
		}
	}
}

// TestBF16 checks rounding to nearest even against the two neighbouring
// bfloat16 values, ties, NaN, and the relative error bound 2^-8.
func TestBF16(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 2))
	for i := range 200000 {
		bits := r.Uint32()
		switch i % 3 {
		case 0:
			bits = bits&^0xFFFF | 0x8000 // a tie
		case 1:
			bits = bits&^0xFFFF | uint32(r.IntN(3)) + 0x7FFF // around the tie
		}
		v := math.Float32frombits(bits)
		got := kernels.F32ToBF16(v)
		if isNaN32(v) {
			if !isNaN32(kernels.BF16ToF32(got)) || got>>15 != uint16(bits>>31) {
				t.Fatalf("F32ToBF16(NaN %#08x) = %#04x, not a NaN of the same sign", bits, got)
			}
			continue
		}
		lo := uint16(bits >> 16)
		want := lo
		switch low := bits & 0xFFFF; {
		case low > 0x8000, low == 0x8000 && lo&1 == 1:
			want = lo + 1 // away from zero in magnitude; may carry into the exponent or to ±Inf
		}
		if got != want {
			t.Fatalf("F32ToBF16(%v = %#08x) = %#04x, want %#04x", v, bits, got, want)
		}
		// Relative error for normal values that stay finite.
		w := kernels.BF16ToF32(got)
		if a := math.Abs(float64(v)); a >= 0x1p-126 && !math.IsInf(float64(w), 0) {
			if err := math.Abs(float64(w) - float64(v)); err > 0x1p-8*a {
				t.Fatalf("bf16(%v) = %v: relative error %.3g > 2^-8", v, w, err/a)
			}
		}
	}
	for h := range 1 << 16 {
		v := kernels.BF16ToF32(uint16(h))
		if math.Float32bits(v) != uint32(h)<<16 {
			t.Fatalf("BF16ToF32(%#04x) = %#08x", h, math.Float32bits(v))
		}
		if !isNaN32(v) && kernels.F32ToBF16(v) != uint16(h) {
			t.Fatalf("bf16 %#04x does not round-trip", h)
		}
	}
}

// TestF16RoundTrip: every half that is not a NaN survives widening and
// rounding back; NaNs stay NaNs of the same sign.
func TestF16RoundTrip(t *testing.T) {
	for h := range 1 << 16 {
		v := kernels.F16ToF32(uint16(h))
		got := kernels.F32ToF16(v)
		if uint16(h)&0x7C00 == 0x7C00 && uint16(h)&0x3FF != 0 {
			if !isNaN32(v) || got&0x7C00 != 0x7C00 || got&0x3FF == 0 || got>>15 != uint16(h)>>15 {
				t.Errorf("NaN %#04x: widened to %v, back to %#04x", h, v, got)
			}
			continue
		}
		if got != uint16(h) {
			t.Errorf("F32ToF16(F16ToF32(%#04x) = %v) = %#04x", h, v, got)
		}
	}
	// Exact values of a few halves.
	for _, c := range []struct {
		h uint16
		v float32
	}{{0x3C00, 1}, {0x0001, 0x1p-24}, {0x0400, 0x1p-14}, {0x7BFF, 65504}, {0xC000, -2}} {
		if v := kernels.F16ToF32(c.h); v != c.v {
			t.Errorf("F16ToF32(%#04x) = %v, want %v", c.h, v, c.v)
		}
	}
	// Ties and overflow.
	for _, c := range []struct {
		v float32
		h uint16
	}{
		{1 + 0x1p-11, 0x3C00},   // tie, even stays
		{1 + 3*0x1p-11, 0x3C02}, // tie, odd rounds up
		{0x1p-25, 0},            // half the smallest subnormal: even (zero)
		{3 * 0x1p-25, 0x0002},   // tie between subnormals 1 and 2
		{65519, 0x7BFF}, {65520, 0x7C00}, {1e10, 0x7C00},
	} {
		if h := kernels.F32ToF16(c.v); h != c.h {
			t.Errorf("F32ToF16(%v) = %#04x, want %#04x", c.v, h, c.h)
		}
	}
}

// TestQ8Row checks Q8_0 encoding: the scale is amax/127 in fp16, and each
// weight decodes within half a step of the unrounded scale plus the scale's
// own rounding times the largest code.
func TestQ8Row(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	const cols = 4 * kernels.Q8Block
	src := make([]float32, cols)
	row := make([]byte, cols/kernels.Q8Block*(2+kernels.Q8Block))
	dec := make([]float32, cols)
	for it := range 500 {
		mag := math.Pow(10, float64(r.IntN(12)-8))
		for i := range src {
			src[i] = float32((2*r.Float64() - 1) * mag)
		}
		if it%7 == 0 {
			clear(src[:kernels.Q8Block]) // an all-zero block
		}
		kernels.QuantizeQ8Row(row, src)
		kernels.DequantizeQ8Row(dec, row)
		for b := range cols / kernels.Q8Block {
			blk := src[b*kernels.Q8Block : (b+1)*kernels.Q8Block]
			var amax float32
			for _, v := range blk {
				amax = max(amax, float32(math.Abs(float64(v))))
			}
			d := float64(amax / 127)
			d16 := float64(kernels.F16ToF32(uint16(row[b*34]) | uint16(row[b*34+1])<<8))
			bound := d*(0.5+1e-5) + 127*math.Abs(d-d16)
			for i, v := range blk {
				if err := math.Abs(float64(dec[b*kernels.Q8Block+i]) - float64(v)); err > bound {
					t.Fatalf("block %d elem %d: %v decoded as %v, |error| %.3g > %.3g (scale %v)", b, i, v, dec[b*kernels.Q8Block+i], err, bound, d16)
				}
			}
		}
	}
}
