package kernels

import (
	"math"
)

// Scalar number-format conversions shared by every backend. Conversions are
// exact functions (round to nearest, ties to even) and every backend must give
// bit-identical results, so they live here once.

// FP8Max is the largest finite e4m3 value (the "fn" variant: no infinities,
// one NaN pattern per sign).
const FP8Max = 448

// fp8Table decodes every e4m3 code.
var fp8Table = func() (t [256]float32) {
	for c := range 256 {
		exp := (c >> 3) & 0xF
		man := c & 7
		var v float64
		switch {
		case exp == 0xF && man == 7:
			v = math.NaN()
		case exp == 0:
			v = float64(man) * 0x1p-9
		default:
			v = (1 + float64(man)/8) * math.Ldexp(1, exp-7)
		}
		if c&0x80 != 0 {
			v = -v
		}
		t[c] = float32(v)
	}
	return t
}()

// FP8ToF32 decodes one e4m3 byte.
func FP8ToF32(c uint8) float32 { return fp8Table[c] }

// F32ToFP8 encodes v as e4m3, rounding to nearest even and saturating to
// ±448; NaN becomes the NaN code.
func F32ToFP8(v float32) uint8 {
	var sign uint8
	if math.Signbit(float64(v)) {
		sign = 0x80
	}
	x := math.Abs(float64(v))
	switch {
	case math.IsNaN(x):
		return sign | 0x7F
	case math.IsInf(x, 0):
		return sign | 0x7E // saturate, as every finite value past 464 does
	case x < 0x1p-6: // subnormal: units of 2^-9; 8 units is the smallest normal, whose code is also 8
		return sign | uint8(math.RoundToEven(x*0x1p9))
	}
	frac, e := math.Frexp(x) // x = frac·2^e, frac in [0.5, 1)
	e--                      // x = (2·frac)·2^e
	m := math.RoundToEven((2*frac - 1) * 8)
	if m == 8 {
		m = 0
		e++
	}
	if e > 8 || (e == 8 && m == 7) {
		return sign | 0x7E // saturate to 448
	}
	return sign | uint8(e+7)<<3 | uint8(m)
}

// BF16ToF32 widens a bfloat16.
func BF16ToF32(b uint16) float32 { return math.Float32frombits(uint32(b) << 16) }

// F32ToBF16 rounds to nearest even; NaN stays a (quiet) NaN.
func F32ToBF16(v float32) uint16 {
	bits := math.Float32bits(v)
	if v != v {
		return uint16(bits>>16) | 0x0040
	}
	bits += 0x7FFF + (bits>>16)&1
	return uint16(bits >> 16)
}

// F16ToF32 widens an IEEE half.
func F16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1F
	man := uint32(h & 0x3FF)
	switch {
	case exp == 0x1F:
		return math.Float32frombits(sign | 0x7F800000 | man<<13)
	case exp == 0:
		if man == 0 {
			return math.Float32frombits(sign)
		}
		v := float32(man) * 0x1p-24
		if sign != 0 {
			v = -v
		}
		return v
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

// F32ToF16 rounds to nearest even, overflowing to infinity.
func F32ToF16(v float32) uint16 {
	bits := math.Float32bits(v)
	sign := uint16(bits>>16) & 0x8000
	if v != v {
		return sign | 0x7E00
	}
	x := math.Abs(float64(v))
	if x >= 65520 { // halfway between 65504 and 65536 rounds up to inf
		return sign | 0x7C00
	}
	if x < 0x1p-14 { // subnormal: units of 2^-24
		return sign | uint16(math.RoundToEven(x*0x1p24))
	}
	frac, e := math.Frexp(x)
	e--
	m := math.RoundToEven((2*frac - 1) * 1024)
	if m == 1024 {
		m = 0
		e++
	}
	if e > 15 {
		return sign | 0x7C00
	}
	return sign | uint16(e+15)<<10 | uint16(m)
}

// FP8Scale is the per-row scale QuantizeFP8 uses: amax/448, or 1 for an
// all-zero (or non-finite amax) row so that decoding stays exact.
func FP8Scale(amax float32) float32 {
	if amax == 0 || amax != amax || math.IsInf(float64(amax), 0) {
		return 1
	}
	return amax / FP8Max
}

// DequantizeQ8Row decodes one Q8_0 row into dst (len dst = cols).
func DequantizeQ8Row(dst []float32, row []byte) {
	for b := 0; b < len(dst)/Q8Block; b++ {
		blk := row[b*q8BlockBytes:]
		d := F16ToF32(uint16(blk[0]) | uint16(blk[1])<<8)
		for i := range Q8Block {
			dst[b*Q8Block+i] = d * float32(int8(blk[2+i]))
		}
	}
}

// QuantizeQ8Row encodes src (a multiple of 32 long) as Q8_0 blocks into dst,
// with the scale amax/127 rounded to fp16, as GGUF writers do.
func QuantizeQ8Row(dst []byte, src []float32) {
	for b := 0; b < len(src)/Q8Block; b++ {
		blk := src[b*Q8Block : (b+1)*Q8Block]
		var amax float32
		for _, v := range blk {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		d := amax / 127
		h := F32ToF16(d)
		out := dst[b*q8BlockBytes:]
		out[0], out[1] = byte(h), byte(h>>8)
		var inv float32
		if d != 0 {
			inv = 1 / d
		}
		for i, v := range blk {
			out[2+i] = byte(int8(math.RoundToEven(float64(v * inv))))
		}
	}
}

// DecodeRow decodes row r of any matrix into dst (len dst = m.Cols).
func (m *Matrix) DecodeRow(dst []float32, r int) {
	row := m.Row(r)
	switch m.DType {
	case F32:
		copy(dst, m.F32()[r*m.Cols:(r+1)*m.Cols])
	case F16:
		for i := range dst {
			dst[i] = F16ToF32(uint16(row[2*i]) | uint16(row[2*i+1])<<8)
		}
	case BF16:
		for i := range dst {
			dst[i] = BF16ToF32(uint16(row[2*i]) | uint16(row[2*i+1])<<8)
		}
	case Q8_0:
		DequantizeQ8Row(dst, row)
	}
}
