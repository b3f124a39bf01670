package hicache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/kvcache/kvtest"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/ref"
)

// noIndexer stands for a model without a sparse indexer in dtype lists.
const noIndexer kernels.IndexKDType = 255

// devConfig is a small device pool with index-K of dt (none for noIndexer).
func devConfig(dt kernels.IndexKDType) kvcache.Config {
	c := kvcache.Config{Layers: 3, KVDim: 4, PageSize: 4, Pages: 16, MaxSeqs: 8, MaxContext: 64}
	if dt != noIndexer {
		c.IndexK = &kvcache.IndexKConfig{DType: dt, Dim: 3}
	}
	return c
}

var dtypes = []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16}

type rig struct {
	t    testing.TB
	dev  *kvcache.Pool
	host *HostPool
	ld   *Loader
	rng  *rand.Rand
	seq  uint64
}

func newRig(t testing.TB, c kvcache.Config, hostPages, ringSlots int) *rig {
	t.Helper()
	dev, err := kvcache.NewPool(c)
	if err != nil {
		t.Fatal(err)
	}
	host, err := NewHostPool(c, hostPages, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { host.Close() }) // after the loader's: cleanups run last first
	ld, err := NewLoader(host, dev, ringSlots)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ld.Close)
	return &rig{t: t, dev: dev, host: host, ld: ld, rng: rand.New(rand.NewPCG(7, uint64(hostPages)))}
}

// newSeq reserves pages whole pages on the device; with fill, every slot gets
// random K, V and index keys.
func (r *rig) newSeq(pages int, fill bool) *kvcache.Seq {
	r.t.Helper()
	r.seq++
	s, err := r.dev.NewSeq(r.seq)
	if err != nil {
		r.t.Fatal(err)
	}
	c := r.dev.Config()
	if err := r.dev.Reserve(s, pages*c.PageSize); err != nil {
		r.t.Fatal(err)
	}
	if fill {
		b := ref.New()
		k, v := make([]float32, c.KVDim), make([]float32, c.KVDim)
		for layer := range c.Layers {
			for _, slot := range s.Slots() {
				for i := range k {
					k[i], v[i] = r.rng.Float32()*2-1, r.rng.Float32()*2-1
				}
				r.dev.WriteKV(layer, slot, k, v)
				if c.IndexK != nil {
					key := make([]float32, c.IndexK.Dim)
					for i := range key {
						key[i] = r.rng.Float32()*4 - 2
					}
					r.dev.WriteIndexK(b, layer, slot, key)
				}
			}
		}
	}
	return s
}

func (r *rig) release(s *kvcache.Seq) {
	r.t.Helper()
	if err := r.dev.Release(s); err != nil {
		r.t.Fatal(err)
	}
}

// backupNew fills a fresh sequence of pages pages, backs it up under key,
// releases it and returns what the device held.
func (r *rig) backupNew(key Key, pages int) (snap [][]byte, evicted []Key) {
	r.t.Helper()
	s := r.newSeq(pages, true)
	snap = kvtest.PageBytes(r.dev, s.Pages())
	evicted, err := r.host.Backup(key, r.dev, s.Pages())
	if err != nil {
		r.t.Fatal(err)
	}
	r.release(s)
	return snap, evicted
}

// hostBytes is kvtest.PageBytes' shape read from key's host pages.
func hostBytes(h *HostPool, key Key) [][]byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	e := h.entries[key]
	if e == nil {
		return nil
	}
	var out [][]byte
	for layer := range h.layout.Layers {
		var k, v, rows, scales []byte
		for _, hp := range e.pages {
			hk, hv := h.hostKV(hp, layer)
			hr, hs := h.hostIndexK(hp, layer)
			k, v = append(k, hk...), append(v, hv...)
			rows, scales = append(rows, hr...), append(scales, hs...)
		}
		out = append(out, k, v, rows, scales)
	}
	return out
}

func equalBytes(a, b [][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

// layerEqual reports whether layer's K, V (and, with index, index-K rows
// and scales) match.
func layerEqual(a, b [][]byte, layer int, index bool) bool {
	i := 4 * layer
	if index {
		return bytes.Equal(a[i+2], b[i+2]) && bytes.Equal(a[i+3], b[i+3])
	}
	return bytes.Equal(a[i], b[i]) && bytes.Equal(a[i+1], b[i+1])
}

// waitHeld polls until the loader is parked before layer's KV, failing
// after a deadline.
func waitHeld(t testing.TB, ld *Loader, layer int) { waitHeldAt(t, ld, layer, false) }

// waitHeldAt polls until the loader is parked before layer's KV (or, with
// indexK, its index-K part), failing after a deadline.
func waitHeldAt(t testing.TB, ld *Loader, layer int, indexK bool) {
	t.Helper()
	waitfor.NoError(t, fmt.Sprintf("loader held at layer %d index-K %v", layer, indexK), 10*time.Second, func() error {
		if l, ix := ld.HeldAt(); l != layer || ix != indexK {
			return fmt.Errorf("at %d, %v", l, ix)
		}
		return nil
	})
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// blocks reports whether wait is still blocked after a short grace: it must
// end with the context's deadline, not succeed.
func blocks(t testing.TB, wait func(context.Context) error) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := wait(ctx)
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked wait ended with %v", err)
	}
	return err != nil
}

func check(t testing.TB, r *rig) {
	t.Helper()
	if err := r.host.Check(); err != nil {
		t.Fatal(err)
	}
	if err := r.dev.Check(); err != nil {
		t.Fatal(err)
	}
}

func dtName(dt kernels.IndexKDType) string {
	if dt == noIndexer {
		return "none"
	}
	return dt.String()
}
