package model

import (
	"context"
	"fmt"
)

// LayerGate holds a sequence's reads of its KV pages back until those pages
// are on the device, layer by layer: a prefix being loaded back from a host
// tier (engine/hicache's Load satisfies it) while the forward pass runs.
//
// There are two gates because a layer reads its pages twice: the sparse
// indexer reads index-K rows and scales before attention reads K and V. Each
// read waits for its own part of the layer, at the read itself; one wait at
// the top of the layer for the KV part alone would let the indexer read
// index-K that is not there yet (production incident 3, the HiCache index-K
// race).
//
// An error (the load was aborted, ctx ended) fails the forward pass with it.
type LayerGate interface {
	// WaitKV returns once layer's K and V of the sequence's pages may be
	// read.
	WaitKV(ctx context.Context, layer int) error
	// WaitIndexK returns once layer's index-K rows and scales of the
	// sequence's pages may be read.
	WaitIndexK(ctx context.Context, layer int) error
}

// LayerEntryGate is a LayerGate that also waits as each layer begins,
// before any of the layer's reads. engine/hicache's Gate is one: under the
// hicache-indexk-ungated fault it waits there for the layer's KV, as the
// incident's code did, and its index-K read then does not wait.
type LayerEntryGate interface {
	LayerGate
	// WaitLayer returns once layer may begin.
	WaitLayer(ctx context.Context, layer int) error
}

// waitLayer passes every gated sequence's entry gate of layer l, if it
// has one, before the layer computes anything.
func (e *Exec) waitLayer(l int) error {
	for _, g := range e.ws.gated {
		if eg, ok := g.gate.(LayerEntryGate); ok {
			if err := eg.WaitLayer(e.ctx, l); err != nil {
				return fmt.Errorf("model: waiting for layer %d: %w", l, err)
			}
		}
	}
	return nil
}

// gated is one batch sequence with a gate; its tokens end before batch
// token end.
type gated struct {
	gate LayerGate
	end  int
}

// waitKV passes every gated sequence's KV gate of layer l, before attention
// reads the pool's K and V of layer l.
func (e *Exec) waitKV(l int) error {
	for _, g := range e.ws.gated {
		if err := g.gate.WaitKV(e.ctx, l); err != nil {
			return fmt.Errorf("model: waiting for layer %d's KV: %w", l, err)
		}
	}
	return nil
}

// waitIndexK passes the index-K gate of layer l of every gated sequence
// whose tokens score their context from the pool's index-K (a context longer
// than top-k; the last token has the longest), before the indexer reads it.
func (e *Exec) waitIndexK(l, topK int) error {
	for _, g := range e.ws.gated {
		if len(e.ws.ctx[g.end-1]) <= topK {
			continue
		}
		if err := g.gate.WaitIndexK(e.ctx, l); err != nil {
			return fmt.Errorf("model: waiting for layer %d's index-K: %w", l, err)
		}
	}
	return nil
}
