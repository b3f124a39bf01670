// Package kvtest is test support for code that moves KV pages: reading a
// pool's pages back, as the pool itself lays them out, to compare them.
package kvtest

import "github.com/pdkit/pdkit/engine/kvcache"

// PageBytes is, per layer, the K, V, index-K rows and scales of every
// token slot of pages, read with the pool's own Append copies.
func PageBytes(pool *kvcache.Pool, pages []int32) [][]byte {
	cfg := pool.Config()
	var slots []int32
	for _, p := range pages {
		for i := range cfg.PageSize {
			slots = append(slots, p*int32(cfg.PageSize)+int32(i))
		}
	}
	return SlotBytes(pool, slots)
}

// SlotBytes is PageBytes of the token slots given, in their order.
func SlotBytes(pool *kvcache.Pool, slots []int32) [][]byte {
	cfg := pool.Config()
	var out [][]byte
	for layer := range cfg.Layers {
		k, v := pool.AppendKV(layer, slots, nil, nil)
		rows, scales := pool.AppendIndexK(layer, slots, nil, nil)
		out = append(out, k, v, rows, scales)
	}
	return out
}
