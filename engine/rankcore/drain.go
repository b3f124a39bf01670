package rankcore

import "slices"

// An index-K precision switch needs an engine that holds no index key in
// the old precision: rank 0 stops taking new requests, and at each
// iteration of the drain decides from agreed state whether the switch goes
// into this step input, and, once the drain's bound has passed, which of
// the requests still held the input aborts. Every rank then applies the
// same input.

// DrainFacts are what rank 0 knows of the engine at one drain iteration,
// all of it state every rank holds alike, and whether the bound passed
// (rank 0's clock, which enters the other ranks only through the input).
type DrainFacts struct {
	Scheduled   int  // requests the scheduler holds
	Rooms       int  // PD rooms the PD machine holds
	Handshaking int  // of those, rooms still in the handshake, which hold nothing in either precision
	Seqs        int  // requests the ranks hold token state for
	Joining     int  // new requests in this step input
	PastBound   bool // the drain's bound has passed
}

// DrainHeld is a request rank 0 holds a front for during a drain.
type DrainHeld struct {
	ID  uint64
	Cut bool // already cut: it is ending anyway
	// Spared: a PD room still in the handshake (it holds nothing) or one
	// that only waits for its peer's word or its deadline (an abort would
	// not change it, and its deadline bounds it).
	Spared bool
	Forks  []uint64 // its later samples, which end with it
}

// DrainDecision is one drain iteration's outcome.
type DrainDecision struct {
	Switch bool     // the switch goes into this step input
	Cut    []uint64 // the requests this input aborts, ascending
}

// DrainStep decides one drain iteration: the switch once the ranks hold no
// request but PD rooms still in the handshake; else, past the bound, the
// abort of every request held that is neither cut already nor spared, nor
// a later sample of a spared one. Past the bound every iteration cuts
// anew: a room spared while in the handshake may pass it later.
func DrainStep(f DrainFacts, held []DrainHeld) DrainDecision {
	if f.Scheduled == 0 && f.Rooms == f.Handshaking && f.Seqs == 0 && f.Joining == 0 {
		return DrainDecision{Switch: true}
	}
	if !f.PastBound {
		return DrainDecision{}
	}
	spared := map[uint64]bool{}
	for _, h := range held {
		if h.Spared {
			spared[h.ID] = true
			for _, id := range h.Forks {
				spared[id] = true
			}
		}
	}
	var d DrainDecision
	for _, h := range held {
		if !h.Cut && !spared[h.ID] {
			d.Cut = append(d.Cut, h.ID)
		}
	}
	slices.Sort(d.Cut)
	return d
}
