package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/kerneltest"
	"github.com/pdkit/pdkit/kernels/ref"
)

// The shapes of the small model the engine generates: dim 288, hidden 768,
// vocabulary 32000.
var benchShapes = []struct{ n, k int }{{768, 288}, {32000, 288}}

var benchDTypes = []kernels.DType{kernels.F32, kernels.Q8_0, kernels.F16, kernels.BF16}

// reportMatMul reports GFLOP/s and the GB/s of weights read (the decode
// bound: each weight is read once per call).
func reportMatMul(b *testing.B, w *kernels.Matrix, m int) {
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(2*float64(m)*float64(w.Rows)*float64(w.Cols)/sec/1e9, "GFLOP/s")
	b.ReportMetric(float64(len(w.Data))/sec/1e9, "GB/s")
}

func benchMatrix(d kernels.DType, n, k int) *kernels.Matrix {
	r := rand.New(rand.NewPCG(uint64(n), uint64(k)))
	return kerneltest.EncodeMatrix(d, n, k, randVec(r, n*k, 1))
}

func BenchmarkMatMul(b *testing.B) {
	for _, d := range benchDTypes {
		for _, s := range benchShapes {
			w := benchMatrix(d, s.n, s.k)
			for _, m := range []int{1, 32, 512} {
				x := randVec(rand.New(rand.NewPCG(9, 9)), m*s.k, 1)
				dst := make([]float32, m*s.n)
				for _, threads := range []int{1, 2} {
					b.Run(fmt.Sprintf("%v/%dx%d/m=%d/threads=%d", d, s.n, s.k, m, threads), func(b *testing.B) {
						be := New(threads)
						defer be.Close()
						for b.Loop() {
							be.MatMul(dst, x, w, m)
						}
						reportMatMul(b, w, m)
					})
				}
			}
		}
	}
}

// BenchmarkMatMulRef is the reference on the same shapes (batches of 1 and
// 32 only: it is slow).
func BenchmarkMatMulRef(b *testing.B) {
	rb := ref.New()
	for _, d := range []kernels.DType{kernels.F32, kernels.Q8_0} {
		for _, s := range benchShapes {
			w := benchMatrix(d, s.n, s.k)
			for _, m := range []int{1, 32} {
				x := randVec(rand.New(rand.NewPCG(9, 9)), m*s.k, 1)
				dst := make([]float32, m*s.n)
				b.Run(fmt.Sprintf("%v/%dx%d/m=%d", d, s.n, s.k, m), func(b *testing.B) {
					for b.Loop() {
						rb.MatMul(dst, x, w, m)
					}
					reportMatMul(b, w, m)
				})
			}
		}
	}
}

// benchBackends runs fn on the reference and on this backend with 1 and 2
// threads.
func benchBackends(b *testing.B, fn func(b *testing.B, be kernels.Backend)) {
	b.Run("ref", func(b *testing.B) { fn(b, ref.New()) })
	for _, threads := range []int{1, 2} {
		b.Run(fmt.Sprintf("threads=%d", threads), func(b *testing.B) {
			be := New(threads)
			defer be.Close()
			fn(b, be)
		})
	}
}

// BenchmarkAttention: 6 heads × 48, 512 tokens of context, one decoding
// token and a batch of 32; then per KV pool type (f32, bf16, f16) a decode
// step of 32 sequences at 1024 slots of context each (one token per
// sequence, every sequence its own pages of 16 slots, scattered over the
// pool), a short one at 16 slots (rows in cache) and a prefill of 512
// tokens of one sequence (token i attends to slots 0..i). kvGB/s counts the K and V bytes the call reads once. In
// those, each call alternates with another, so that both see the same
// memory system and their ratio is theirs: an F32 call with one without
// the F32 kernels' row prefetch (speedup is the time without over the
// time with), a 16-bit call with the F32 call (vs-f32 is its time over
// the F32 one's); ns/call is one call, ns/op both. PD_ATTN_AHEAD sets the
// F32 kernels' prefetch distance in slots, PD_ATTN_AHEAD16 the 16-bit
// kernels'.
func BenchmarkAttention(b *testing.B) {
	setFromEnv(b, "PD_ATTN_AHEAD", &attnAhead)
	setFromEnv(b, "PD_ATTN_AHEAD16", &attnAhead16)
	const ctx, H, hd = 512, 6, 48
	r := rand.New(rand.NewPCG(1, 1))
	for _, tokens := range []int{1, 32} {
		a := kernels.AttentionArgs{
			Q: randVec(r, tokens*H*hd, 1), K: randVec(r, ctx*H*hd, 1), V: randVec(r, ctx*H*hd, 1),
			Out: make([]float32, tokens*H*hd), Slots: make([][]int32, tokens),
			NHeads: H, NKVHeads: H, HeadDim: hd, Scale: float32(1 / math.Sqrt(hd)),
		}
		for t := range a.Slots {
			a.Slots[t] = make([]int32, ctx)
			for j := range ctx {
				a.Slots[t][j] = int32(j)
			}
		}
		b.Run(fmt.Sprintf("tokens=%d", tokens), func(b *testing.B) {
			benchBackends(b, func(b *testing.B, be kernels.Backend) {
				for b.Loop() {
					be.Attention(&a)
				}
			})
		})
	}
	for _, shape := range []struct {
		name      string
		seqs, ctx int
		prefill   bool
	}{{"decode", 32, 1024, false}, {"short", 32, 16, false}, {"prefill", 1, 512, true}} {
		pool := shape.seqs * shape.ctx
		kv := [2][]float32{randVec(r, pool*H*hd, 1), randVec(r, pool*H*hd, 1)}
		a := kernels.AttentionArgs{NHeads: H, NKVHeads: H, HeadDim: hd, Scale: float32(1 / math.Sqrt(hd))}
		pages := r.Perm(pool / 16)
		for sq := range shape.seqs {
			slots := make([]int32, 0, shape.ctx)
			for _, pg := range pages[sq*shape.ctx/16 : (sq+1)*shape.ctx/16] {
				for i := range 16 {
					slots = append(slots, int32(16*pg+i))
				}
			}
			if !shape.prefill {
				a.Slots = append(a.Slots, slots)
				continue
			}
			for i := range slots {
				a.Slots = append(a.Slots, slots[:i+1])
			}
		}
		reads := 0
		for _, sl := range a.Slots {
			reads += len(sl)
		}
		a.Q, a.Out = randVec(r, len(a.Slots)*H*hd, 1), make([]float32, len(a.Slots)*H*hd)
		af := a
		af.K, af.V = kv[0], kv[1]
		for _, kt := range []kernels.DType{kernels.F32, kernels.BF16, kernels.F16} {
			ak := af
			ak.KVType = kt
			if kt != kernels.F32 {
				ak.K, ak.V = nil, nil
				ak.K16, ak.V16 = make([]uint16, len(kv[0])), make([]uint16, len(kv[1]))
				kernels.EncodeKV(ak.K16, kv[0], kt)
				kernels.EncodeKV(ak.V16, kv[1], kt)
			}
			for _, threads := range []int{1, 2} {
				b.Run(fmt.Sprintf("%s/%s/threads=%d", shape.name, kernels.KVName(kt), threads), func(b *testing.B) {
					be := New(threads)
					defer be.Close()
					var on, alt time.Duration
					for b.Loop() {
						t0 := time.Now()
						be.Attention(&ak)
						t1 := time.Now()
						if kt == kernels.F32 {
							saved := attnAhead
							attnAhead = 0
							be.Attention(&ak)
							attnAhead = saved
						} else {
							be.Attention(&af)
						}
						on, alt = on+t1.Sub(t0), alt+time.Since(t1)
					}
					bytes := float64(2 * reads * H * hd * kernels.KVElemBytes(kt))
					b.ReportMetric(float64(on.Nanoseconds())/float64(b.N), "ns/call")
					b.ReportMetric(bytes*float64(b.N)/on.Seconds()/1e9, "kvGB/s")
					if kt == kernels.F32 {
						b.ReportMetric(alt.Seconds()/on.Seconds(), "speedup")
					} else {
						b.ReportMetric(on.Seconds()/alt.Seconds(), "vs-f32")
					}
				})
			}
		}
	}
}

// BenchmarkIndexScore: one token scoring 4096 slots, 4 heads × 32, with fp8
// and bf16 keys.
func BenchmarkIndexScore(b *testing.B) {
	const slots, H, dim = 4096, 4, 32
	r := rand.New(rand.NewPCG(2, 2))
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		keys := &kernels.IndexKeys{DType: dt, Dim: dim}
		kv := randVec(r, slots*dim, 3)
		rb := ref.New()
		if dt == kernels.IndexFP8 {
			keys.FP8, keys.Scales = make([]uint8, slots*dim), make([]float32, slots)
			for s := range slots {
				keys.Scales[s] = rb.QuantizeFP8(keys.FP8[s*dim:(s+1)*dim], kv[s*dim:(s+1)*dim])
			}
		} else {
			keys.BF16 = make([]uint16, slots*dim)
			rb.ToBF16(keys.BF16, kv)
		}
		a := kernels.IndexScoreArgs{
			Q: randVec(r, H*dim, 1), W: randVec(r, H, 1), Keys: keys,
			Slots: [][]int32{make([]int32, slots)}, Out: [][]float32{make([]float32, slots)}, NHeads: H,
		}
		for j := range slots {
			a.Slots[0][j] = int32(j)
		}
		b.Run(dt.String(), func(b *testing.B) {
			benchBackends(b, func(b *testing.B, be kernels.Backend) {
				for b.Loop() {
					be.IndexScore(&a)
				}
			})
		})
	}
}

// BenchmarkTopK: the 64 best of 4096 scores.
func BenchmarkTopK(b *testing.B) {
	scores := randVec(rand.New(rand.NewPCG(3, 3)), 4096, 1)
	dst := make([]int32, 0, 64)
	benchBackends(b, func(b *testing.B, be kernels.Backend) {
		for b.Loop() {
			dst = be.TopK(dst, scores, 64)
		}
	})
}

// setFromEnv sets *v to the integer in the environment variable name for
// the benchmark, when it is set, and back when the benchmark ends.
func setFromEnv(b *testing.B, name string, v *int) {
	s := os.Getenv(name)
	if s == "" {
		return
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		b.Fatalf("%s=%q: %v", name, s, err)
	}
	old := *v
	b.Cleanup(func() { *v = old })
	*v = n
}
