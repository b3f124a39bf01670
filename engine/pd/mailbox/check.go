package mailbox

import (
	"fmt"
	"maps"
)

// Check verifies the machine's invariants: the early count is the rooms
// with mail that the loop does not have, and the count by sender sums to
// it; neither passes its bound; a decode has no early rooms and remembers
// no ended ones; a room's KV bytes are its chunks' and within the room's
// bound; a room holds only mail its role receives; an ended room is
// neither known nor holds mail, and is in the FIFO, which is within its
// bound; a room expecting a peer is known. The tests run it after every event; it walks every room, so the
// machine does not run it itself.
func (m *Machine) Check() error {
	early, from := 0, map[string]int{}
	for room, x := range m.rooms {
		if !m.known[room] {
			early++
			from[x.from]++
		}
		var n int64
		for _, c := range x.Chunks {
			n += int64(c.PayloadBytes())
		}
		switch {
		case n != x.kvBytes:
			return fmt.Errorf("mailbox: room %d counts %d KV bytes, its chunks hold %d", room, x.kvBytes, n)
		case m.cfg.RoomBytes > 0 && n > m.cfg.RoomBytes:
			return fmt.Errorf("mailbox: room %d holds %d KV bytes, past its bound %d", room, n, m.cfg.RoomBytes)
		case m.prefill && (len(x.Chunks) > 0 || x.Acked):
			return fmt.Errorf("mailbox: prefill room %d holds a decode's mail", room)
		case !m.prefill && (x.Info != nil || x.Abort != nil || x.Queued != nil):
			return fmt.Errorf("mailbox: decode room %d holds a prefill's mail", room)
		case x.Info != nil && !x.infoSeen:
			return fmt.Errorf("mailbox: room %d holds a TRANSFER_INFO it did not see", room)
		}
	}
	switch {
	case early != m.early:
		return fmt.Errorf("mailbox: %d early rooms counted, %d held", m.early, early)
	case !maps.Equal(from, m.earlyFrom):
		return fmt.Errorf("mailbox: early rooms by sender counted %v, held %v", m.earlyFrom, from)
	case early > m.bound:
		return fmt.Errorf("mailbox: %d early rooms, past the bound %d", early, m.bound)
	case !m.prefill && (early > 0 || len(m.ended) > 0):
		return fmt.Errorf("mailbox: a decode with %d early and %d ended rooms", early, len(m.ended))
	case len(m.endedOrder) > m.bound:
		return fmt.Errorf("mailbox: %d ended rooms remembered, past the bound %d", len(m.endedOrder), m.bound)
	}
	if q := m.cfg.PerSender; q > 0 {
		for s, n := range from {
			if n > q {
				return fmt.Errorf("mailbox: sender %q holds %d early rooms, past its quota %d", s, n, q)
			}
		}
	}
	inOrder := map[uint64]bool{}
	for _, room := range m.endedOrder {
		inOrder[room] = true
	}
	for room := range m.expect {
		if !m.known[room] {
			return fmt.Errorf("mailbox: room %d expects a peer but the loop does not have it", room)
		}
	}
	for room := range m.ended {
		switch {
		case m.known[room]:
			return fmt.Errorf("mailbox: room %d both known and ended", room)
		case !inOrder[room]:
			return fmt.Errorf("mailbox: ended room %d not in the FIFO", room)
		case m.rooms[room] != nil:
			return fmt.Errorf("mailbox: ended room %d holds mail", room)
		}
	}
	return nil
}
