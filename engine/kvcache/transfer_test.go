package kvcache

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// transferPools makes two pools of configuration c and a sequence of n
// tokens in each; the destination's first pages are taken, so that its
// slots (ds) differ from the source's (ss).
func transferPools(t *testing.T, c Config, n int) (src, dst *Pool, ss, ds []int32) {
	t.Helper()
	src, dst = newPool(t, c), newPool(t, c)
	other, _ := dst.NewSeq(9)
	if err := dst.Reserve(other, 5); err != nil {
		t.Fatal(err)
	}
	s, _ := src.NewSeq(1)
	d, _ := dst.NewSeq(1)
	if err := src.Reserve(s, n); err != nil {
		t.Fatal(err)
	}
	if err := dst.Reserve(d, n); err != nil {
		t.Fatal(err)
	}
	ss, ds = s.Slots()[:n], d.Slots()[:n]
	if slices.Equal(ss, ds) {
		t.Fatal("slots alike: the test shows nothing")
	}
	return src, dst, ss, ds
}

// Rows appended from one pool and put into another land bit for bit, at
// other slots, for both index-K precisions; sizes that do not match are
// refused.
func TestTransferRows(t *testing.T) {
	for _, dt := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		t.Run(dt.String(), func(t *testing.T) {
			c := Config{Layers: 2, KVDim: 6, PageSize: 4, Pages: 8, MaxSeqs: 2, MaxContext: 32, IndexK: &IndexKConfig{DType: dt, Dim: 5}}
			const n = 7
			src, dst, ss, ds := transferPools(t, c, n)
			b := ref.New()
			rng := rand.New(rand.NewPCG(1, 2))
			for l := range c.Layers {
				for _, slot := range ss {
					k, v, key := make([]float32, 6), make([]float32, 6), make([]float32, 5)
					for i := range k {
						k[i], v[i] = rng.Float32(), -rng.Float32()
					}
					for i := range key {
						key[i] = rng.Float32()*4 - 2
					}
					src.WriteKV(l, slot, k, v)
					src.WriteIndexK(b, l, slot, key)
				}
				kb, vb := src.AppendKV(l, ss, nil, nil)
				rows, scales := src.AppendIndexK(l, ss, nil, nil)
				if err := dst.PutKV(l, ds, kb, vb); err != nil {
					t.Fatal(err)
				}
				if err := dst.PutIndexK(l, ds, rows, scales); err != nil {
					t.Fatal(err)
				}
				k2, v2 := dst.AppendKV(l, ds, nil, nil)
				r2, s2 := dst.AppendIndexK(l, ds, nil, nil)
				if !slices.Equal(k2, kb) || !slices.Equal(v2, vb) || !slices.Equal(r2, rows) || !slices.Equal(s2, scales) {
					t.Fatalf("layer %d: rows differ after the transfer", l)
				}
				if err := dst.PutKV(l, ds, kb[1:], vb); err == nil {
					t.Error("short K accepted")
				}
				if err := dst.PutIndexK(l, ds, rows[:len(rows)-1], scales); err == nil {
					t.Error("short index-K accepted")
				}
			}
			mustCheck(t, src)
			mustCheck(t, dst)
		})
	}
}
