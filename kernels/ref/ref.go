// Package ref is the plain-Go reference implementation of kernels.Backend:
// straightforward loops, one goroutine, no blocking. It is the oracle every
// other backend is tested against, so it favours obviousness over speed.
package ref

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	"github.com/pdkit/pdkit/kernels"
)

// Backend is the reference backend. Its zero value is ready to use.
type Backend struct{}

// New returns the reference backend.
func New() *Backend { return &Backend{} }

func (*Backend) Name() string { return "ref" }

func (*Backend) MatMul(dst, x []float32, w *kernels.Matrix, m int) {
	row := make([]float32, w.Cols)
	for r := range w.Rows {
		w.DecodeRow(row, r)
		for i := range m {
			xi := x[i*w.Cols : (i+1)*w.Cols]
			var s float32
			for c, v := range row {
				s += xi[c] * v
			}
			dst[i*w.Rows+r] = s
		}
	}
}

func (*Backend) RMSNorm(dst, x, weight []float32, rows int, eps float32) {
	n := len(weight)
	for i := range rows {
		xi, di := x[i*n:(i+1)*n], dst[i*n:(i+1)*n]
		var ss float64
		for _, v := range xi {
			ss += float64(v) * float64(v)
		}
		inv := float32(1 / math.Sqrt(ss/float64(n)+float64(eps)))
		for c, v := range xi {
			di[c] = v * inv * weight[c]
		}
	}
}

func (*Backend) RoPE(x []float32, pos []int32, nHeads, headDim, ropeDim int, theta float32) {
	for t, p := range pos {
		for h := range nHeads {
			v := x[(t*nHeads+h)*headDim:]
			for i := 0; i < ropeDim/2; i++ {
				angle := float64(p) * math.Pow(float64(theta), -2*float64(i)/float64(ropeDim))
				sin, cos := math.Sincos(angle)
				a, b := v[2*i], v[2*i+1]
				v[2*i] = a*float32(cos) - b*float32(sin)
				v[2*i+1] = a*float32(sin) + b*float32(cos)
			}
		}
	}
}

// Silu is x·σ(x).
func Silu(x float32) float32 { return x / (1 + float32(math.Exp(float64(-x)))) }

func (*Backend) SwiGLU(dst, gate, up []float32) {
	for i := range dst {
		dst[i] = Silu(gate[i]) * up[i]
	}
}

func (*Backend) Softmax(x []float32, rows, cols int) {
	for i := range rows {
		SoftmaxRow(x[i*cols : (i+1)*cols])
	}
}

// SoftmaxRow normalises one row in place: max, exp, sequential float32 sum,
// divide. Portable backends share it so that they round as the oracle does.
func SoftmaxRow(x []float32) {
	if len(x) == 0 {
		return
	}
	mx := slices.Max(x)
	var sum float32
	for i, v := range x {
		e := float32(math.Exp(float64(v - mx)))
		x[i] = e
		sum += e
	}
	for i := range x {
		x[i] /= sum
	}
}

func (*Backend) Attention(a *kernels.AttentionArgs) {
	hd := a.HeadDim
	qDim, kvDim := a.NHeads*hd, a.NKVHeads*hd
	group := a.NHeads / a.NKVHeads
	kt := a.KVType
	if kernels.KVElemBytes(kt) == 0 {
		panic(fmt.Sprintf("kernels/ref: Attention: KV element type %v (want F32, F16 or BF16)", kt))
	}
	kbuf, vbuf := make([]float32, hd), make([]float32, hd)
	for t, slots := range a.Slots {
		scores := make([]float32, len(slots))
		for h := range a.NHeads {
			q := a.Q[t*qDim+h*hd : t*qDim+(h+1)*hd]
			kvOff := (h / group) * hd
			for j, s := range slots {
				k := kvRow(kbuf, a.K, a.K16, kt, int(s)*kvDim+kvOff)
				var d float32
				for c := range hd {
					d += q[c] * k[c]
				}
				scores[j] = d * a.Scale
			}
			SoftmaxRow(scores)
			out := a.Out[t*qDim+h*hd : t*qDim+(h+1)*hd]
			clear(out)
			for j, s := range slots {
				v := kvRow(vbuf, a.V, a.V16, kt, int(s)*kvDim+kvOff)
				for c := range hd {
					out[c] += scores[j] * v[c]
				}
			}
		}
	}
}

// kvRow returns the len(buf) elements of a K or V layer from element off
// on as float32: the F32 layer's own, or the 16-bit layer's decoded
// exactly into buf.
func kvRow(buf, f []float32, h []uint16, kt kernels.DType, off int) []float32 {
	if kt == kernels.F32 {
		return f[off : off+len(buf)]
	}
	kernels.DecodeKV(buf, h[off:off+len(buf)], kt)
	return buf
}

// IndexKey decodes the index key stored in slot into dst (len dst = keys.Dim).
func IndexKey(dst []float32, keys *kernels.IndexKeys, slot int32) {
	d := keys.Dim
	switch keys.DType {
	case kernels.IndexFP8:
		sc := keys.Scales[slot]
		for i, c := range keys.FP8[int(slot)*d : int(slot+1)*d] {
			dst[i] = kernels.FP8ToF32(c) * sc
		}
	case kernels.IndexBF16:
		for i, b := range keys.BF16[int(slot)*d : int(slot+1)*d] {
			dst[i] = kernels.BF16ToF32(b)
		}
	}
}

func (*Backend) IndexScore(a *kernels.IndexScoreArgs) {
	d := a.Keys.Dim
	k := make([]float32, d)
	for t, slots := range a.Slots {
		for j, s := range slots {
			IndexKey(k, a.Keys, s)
			var score float32
			for h := range a.NHeads {
				q := a.Q[(t*a.NHeads+h)*d : (t*a.NHeads+h+1)*d]
				var dot float32
				for c := range d {
					dot += q[c] * k[c]
				}
				score += a.W[t*a.NHeads+h] * max(dot, 0)
			}
			a.Out[t][j] = score
		}
	}
}

func (*Backend) TopK(dst []int32, scores []float32, k int) []int32 {
	idx := make([]int32, len(scores))
	for i := range idx {
		idx[i] = int32(i)
	}
	slices.SortStableFunc(idx, func(a, b int32) int {
		return -CompareScores(scores[a], scores[b])
	})
	k = min(k, len(scores))
	out := append(dst[:0], idx[:k]...)
	slices.Sort(out)
	return out
}

// CompareScores orders scores with NaN below every number; it is the order
// TopK selects by (ties then go to the lower index).
func CompareScores(a, b float32) int {
	an, bn := a != a, b != b
	switch {
	case an && bn:
		return 0
	case an:
		return -1
	case bn:
		return 1
	}
	return cmp.Compare(a, b)
}

func (*Backend) QuantizeFP8(dst []uint8, src []float32) float32 {
	var amax float32
	for _, v := range src {
		amax = max(amax, float32(math.Abs(float64(v))))
	}
	scale := kernels.FP8Scale(amax)
	for i, v := range src {
		dst[i] = kernels.F32ToFP8(v / scale)
	}
	return scale
}

func (*Backend) DequantizeFP8(dst []float32, src []uint8, scale float32) {
	for i, c := range src {
		dst[i] = kernels.FP8ToF32(c) * scale
	}
}

func (*Backend) ToBF16(dst []uint16, src []float32) {
	for i, v := range src {
		dst[i] = kernels.F32ToBF16(v)
	}
}

func (*Backend) FromBF16(dst []float32, src []uint16) {
	for i, b := range src {
		dst[i] = kernels.BF16ToF32(b)
	}
}
