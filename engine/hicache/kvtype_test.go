package hicache

import (
	"errors"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/kvcache/kvtest"
	"github.com/pdkit/pdkit/kernels"
)

// A 16-bit device pool's host pages hold its K and V rows in half the
// bytes, and a backup then load lands them on the device bit for bit, with
// and without an indexer.
func TestKV16RoundTrip(t *testing.T) {
	for _, kv := range []kernels.DType{kernels.BF16, kernels.F16} {
		for _, dt := range append([]kernels.IndexKDType{noIndexer}, dtypes...) {
			t.Run(kernels.KVName(kv)+"/"+dtName(dt), func(t *testing.T) {
				c := devConfig(dt)
				c.KVType = kv
				f32 := devConfig(dt)
				l16, err := LayoutOf(c)
				if err != nil {
					t.Fatal(err)
				}
				l32, _ := LayoutOf(f32)
				if l16.KVBytes*2 != l32.KVBytes || l16.KVBytes != c.PageSize*c.KVDim*2 || l16.KVType != kv {
					t.Fatalf("%s layout %+v, f32 layout %+v", kernels.KVName(kv), l16, l32)
				}
				if l32.PageBytes-l16.PageBytes != c.Layers*l16.KVBytes*2 {
					t.Fatalf("page bytes %d for %s, %d for f32", l16.PageBytes, kernels.KVName(kv), l32.PageBytes)
				}
				r := newRig(t, c, 8, 0)
				snap, _ := r.backupNew(1, 3)
				if !equalBytes(snap, hostBytes(r.host, 1)) {
					t.Fatal("host bytes differ from the device's")
				}
				if len(snap[0]) != 3*l16.KVBytes {
					t.Fatalf("%d K bytes for 3 pages, want %d", len(snap[0]), 3*l16.KVBytes)
				}
				dst := r.newSeq(3, true)
				ld, err := r.ld.Submit(1, dst.Pages())
				if err != nil {
					t.Fatal(err)
				}
				if err := ld.Wait(ctxT(t)); err != nil {
					t.Fatal(err)
				}
				if got := kvtest.PageBytes(r.dev, dst.Pages()); !equalBytes(got, snap) {
					t.Fatal("device pages differ from the host bytes after the load")
				}
				r.release(dst)
				check(t, r)
			})
		}
	}
}

// A host pool made for one KV type refuses a device pool of another, for
// backups, loaders and writers, with an error naming both types.
func TestKVTypeMismatchRefused(t *testing.T) {
	for _, pair := range [][2]kernels.DType{{kernels.F32, kernels.BF16}, {kernels.BF16, kernels.F16}, {kernels.F16, kernels.F32}} {
		hc, dc := devConfig(kernels.IndexFP8), devConfig(kernels.IndexFP8)
		hc.KVType, dc.KVType = pair[0], pair[1]
		host, err := NewHostPool(hc, 4, 1<<30)
		if err != nil {
			t.Fatal(err)
		}
		dev, err := kvcache.NewPool(dc)
		if err != nil {
			t.Fatal(err)
		}
		want := func(what string, err error) {
			t.Helper()
			if !errors.Is(err, ErrShape) || !strings.Contains(err.Error(), "KV as "+kernels.KVName(pair[1])) ||
				!strings.Contains(err.Error(), "host pool as "+kernels.KVName(pair[0])) {
				t.Errorf("%s of a %s device pool into a %s host pool: %v", what, kernels.KVName(pair[1]), kernels.KVName(pair[0]), err)
			}
		}
		_, err = host.Backup(1, dev, []int32{0})
		want("backup", err)
		ld, err := NewLoader(host, dev, 0)
		if ld != nil {
			ld.Close()
		}
		want("loader", err)
		_, err = NewWriter(host, dev)
		want("writer", err)
	}
}
