package hicache

// ringSlot is one producer slot of the loader: the per-layer done counters
// of the load that occupies it. Like the reference's LayerDoneCounter, slots
// are handed out round-robin and a slot is never reused while its load's last
// layer has not finished, so a counter never moves backwards under a reader.
type ringSlot struct {
	gen     uint64 // bumped each time a load takes the slot
	busy    bool   // the loader may still write the occupant's pages
	kvDone  int    // layers whose K and V are on the device
	idxDone int    // layers whose index-K rows and scales are on the device
	changed chan struct{}
}

// ring is the loader's slots and the producer's next index. Guarded by
// Loader.mu.
type ring struct {
	slots []ringSlot
	next  int
}

func newRing(n int) ring {
	r := ring{slots: make([]ringSlot, n)}
	for i := range r.slots {
		r.slots[i].changed = make(chan struct{})
	}
	return r
}

// take hands out the next slot in producer order, refusing one whose load
// has not finished its last layer.
func (r *ring) take() (index int, gen uint64, err error) {
	s := &r.slots[r.next]
	if s.busy {
		return 0, 0, ErrSlotBusy
	}
	index = r.next
	r.next = (r.next + 1) % len(r.slots)
	s.gen++
	s.busy = true
	s.kvDone, s.idxDone = 0, 0
	s.wake()
	return index, s.gen, nil
}

// wake tells every reader blocked on the slot to look again.
func (s *ringSlot) wake() {
	close(s.changed)
	s.changed = make(chan struct{})
}
