package kvcache

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

var kvTypes = []kernels.DType{kernels.F32, kernels.BF16, kernels.F16}

// Validate takes the three KV types and refuses any other.
func TestConfigKVType(t *testing.T) {
	for _, dt := range kvTypes {
		c := goodConfig()
		c.KVType = dt
		if err := c.Validate(); err != nil {
			t.Errorf("%v: %v", dt, err)
		}
	}
	for _, dt := range []kernels.DType{kernels.Q8_0, kernels.DType(200)} {
		c := goodConfig()
		c.KVType = dt
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), "KVType") {
			t.Errorf("KVType %v: %v", dt, err)
		}
		if _, err := NewPool(c); err == nil {
			t.Errorf("NewPool took KVType %v", dt)
		}
	}
}

// A 16-bit pool takes half the bytes of an F32 one for K and V, and its
// arrays hold exactly what Bytes says.
func TestKVTypeBytes(t *testing.T) {
	for _, dt := range kvTypes {
		c := goodConfig()
		c.IndexK = nil
		c.KVType = dt
		p := newPool(t, c)
		// 2 layers × 64 slots × K+V × 8 elements.
		want := int64(2 * 64 * 2 * 8 * kernels.KVElemBytes(dt))
		if p.Bytes() != want {
			t.Errorf("%v: Bytes %d, want %d", dt, p.Bytes(), want)
		}
		var held int64
		for l := range c.Layers {
			held += 4*int64(len(p.K(l))+len(p.V(l))) + 2*int64(len(p.K16(l))+len(p.V16(l)))
		}
		if held != want {
			t.Errorf("%v: arrays hold %d bytes, Bytes says %d", dt, held, want)
		}
		if got := c.KVRowBytes(); got != 8*kernels.KVElemBytes(dt) {
			t.Errorf("%v: KVRowBytes %d", dt, got)
		}
		if p.KVType() != dt {
			t.Errorf("KVType %v, want %v", p.KVType(), dt)
		}
	}
}

// WriteKV stores a row rounded to nearest even in the pool's type; ReadKV
// and AttentionKV give back exactly that.
func TestKVTypeWriteRead(t *testing.T) {
	for _, dt := range kvTypes {
		t.Run(kernels.KVName(dt), func(t *testing.T) {
			c := smallConfig(3, 4)
			c.Layers, c.KVDim, c.KVType = 2, 5, dt
			p := newPool(t, c)
			s, _ := p.NewSeq(1)
			if err := p.Reserve(s, 7); err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(3, 4))
			want := map[[2]int][2][]float32{}
			for _, slot := range s.Slots() {
				for l := range c.Layers {
					k, v := make([]float32, 5), make([]float32, 5)
					for i := range k {
						k[i], v[i] = float32(rng.NormFloat64()), float32(rng.NormFloat64()*100)
					}
					p.WriteKV(l, slot, k, v)
					want[[2]int{l, int(slot)}] = [2][]float32{round(k, dt), round(v, dt)}
				}
			}
			for key, w := range want {
				l, slot := key[0], int32(key[1])
				k, v := make([]float32, 5), make([]float32, 5)
				p.ReadKV(l, slot, k, v)
				if !bitsEqual(k, w[0]) || !bitsEqual(v, w[1]) {
					t.Fatalf("layer %d slot %d: read K %v V %v, want %v %v", l, slot, k, v, w[0], w[1])
				}
				var a kernels.AttentionArgs
				p.AttentionKV(l, &a)
				if a.KVType != dt {
					t.Fatalf("AttentionKV type %v", a.KVType)
				}
				off := int(slot) * 5
				switch dt {
				case kernels.F32:
					if a.K16 != nil || !bitsEqual(a.K[off:off+5], w[0]) || !bitsEqual(a.V[off:off+5], w[1]) {
						t.Fatal("AttentionKV: F32 arrays differ")
					}
				default:
					if a.K != nil || a.V != nil {
						t.Fatal("AttentionKV: a 16-bit pool set K or V")
					}
					dk, dv := make([]float32, 5), make([]float32, 5)
					kernels.DecodeKV(dk, a.K16[off:off+5], dt)
					kernels.DecodeKV(dv, a.V16[off:off+5], dt)
					if !bitsEqual(dk, w[0]) || !bitsEqual(dv, w[1]) {
						t.Fatal("AttentionKV: 16-bit arrays differ")
					}
				}
			}
			if dt != kernels.F32 {
				// The rounding is real: 1/3 is not a 16-bit number.
				k := []float32{1.0 / 3, 0, 0, 0, 0}
				p.WriteKV(0, s.Slots()[0], k, k)
				got, gv := make([]float32, 5), make([]float32, 5)
				p.ReadKV(0, s.Slots()[0], got, gv)
				if got[0] == k[0] || math.Abs(float64(got[0]-k[0])) > 1.0/3/128 {
					t.Fatalf("1/3 stored as %v", got[0])
				}
			}
			mustCheck(t, p)
		})
	}
}

func round(x []float32, dt kernels.DType) []float32 {
	out := slices.Clone(x)
	if dt == kernels.F32 {
		return out
	}
	h := make([]uint16, len(x))
	kernels.EncodeKV(h, x, dt)
	kernels.DecodeKV(out, h, dt)
	return out
}

func bitsEqual(a, b []float32) bool {
	return slices.EqualFunc(a, b, func(x, y float32) bool { return math.Float32bits(x) == math.Float32bits(y) })
}

// Rows move between two pools of one KV type bit for bit, at KVRowBytes a
// token (half of F32's for a 16-bit type); wrong sizes, and the rows of a
// pool of another type, are refused.
func TestKVTypeTransfer(t *testing.T) {
	for _, dt := range kvTypes {
		t.Run(kernels.KVName(dt), func(t *testing.T) {
			c := Config{Layers: 2, KVDim: 6, PageSize: 4, Pages: 8, MaxSeqs: 2, MaxContext: 32, KVType: dt}
			const n = 7
			src, dst, ss, ds := transferPools(t, c, n)
			rng := rand.New(rand.NewPCG(5, 6))
			for l := range c.Layers {
				for _, slot := range ss {
					k, v := make([]float32, 6), make([]float32, 6)
					for i := range k {
						k[i], v[i] = float32(rng.NormFloat64()), float32(rng.NormFloat64())
					}
					src.WriteKV(l, slot, k, v)
				}
				kb, vb := src.AppendKV(l, ss, nil, nil)
				if len(kb) != n*6*kernels.KVElemBytes(dt) || len(vb) != len(kb) {
					t.Fatalf("layer %d: %d K and %d V bytes for %d tokens of %v", l, len(kb), len(vb), n, dt)
				}
				if err := dst.PutKV(l, ds, kb, vb); err != nil {
					t.Fatal(err)
				}
				k2, v2 := dst.AppendKV(l, ds, nil, nil)
				if !slices.Equal(k2, kb) || !slices.Equal(v2, vb) {
					t.Fatalf("layer %d: rows differ after the transfer", l)
				}
				for i := range n {
					a, b := make([]float32, 6), make([]float32, 6)
					x, y := make([]float32, 6), make([]float32, 6)
					src.ReadKV(l, ss[i], a, b)
					dst.ReadKV(l, ds[i], x, y)
					if !bitsEqual(a, x) || !bitsEqual(b, y) {
						t.Fatalf("layer %d token %d: read back differs", l, i)
					}
				}
				for _, bad := range [][2][]byte{{kb[1:], vb}, {kb, vb[:len(vb)-2]}, {append(kb, 0, 0), append(vb, 0, 0)}} {
					if err := dst.PutKV(l, ds, bad[0], bad[1]); err == nil {
						t.Errorf("%d K and %d V bytes accepted", len(bad[0]), len(bad[1]))
					}
					if err := dst.FillKV(l, ds, bad[0], bad[1]); err == nil {
						t.Errorf("FillKV: %d K and %d V bytes accepted", len(bad[0]), len(bad[1]))
					}
				}
				// Rows of a pool of another element size do not fit.
				for _, ot := range kvTypes {
					if kernels.KVElemBytes(ot) == kernels.KVElemBytes(dt) {
						continue
					}
					oc := c
					oc.KVType = ot
					op := newPool(t, oc)
					os, _ := op.NewSeq(1)
					if err := op.Reserve(os, n); err != nil {
						t.Fatal(err)
					}
					ok, ov := op.AppendKV(l, os.Slots()[:n], nil, nil)
					if err := dst.PutKV(l, ds, ok, ov); err == nil || !strings.Contains(err.Error(), kernels.KVName(dt)) {
						t.Errorf("rows of a %v pool put into a %v pool: %v", ot, dt, err)
					}
				}
			}
			mustCheck(t, src)
			mustCheck(t, dst)
		})
	}
}
