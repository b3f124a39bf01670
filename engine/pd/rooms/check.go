package rooms

import (
	"fmt"
	"slices"
)

// Check verifies the machine's invariants: the vote order lists exactly
// the rooms, each room's phase belongs to the machine's role, a decode
// holds a sequence exactly in Transfer and Aborting, every Reserve is
// matched by one Release or one Arrived, and no event broke an invariant
// on its way (an agreed Success after an agreed Failed, pages released
// twice, a room past its deadline after Apply). Builds with -tags
// invariants or -race run it after every event.
func (m *Machine) Check() error {
	if m.violation != nil {
		return m.violation
	}
	if len(m.order) != len(m.rooms) || !slices.IsSorted(m.order) {
		return fmt.Errorf("rooms: %d ids in order for %d rooms", len(m.order), len(m.rooms))
	}
	held := 0
	for _, id := range m.order {
		q := m.rooms[id]
		if q == nil {
			return fmt.Errorf("rooms: request %d in order but unknown", id)
		}
		prefill := q.phase == Bootstrap || q.phase == Active || q.phase == Inflight
		if prefill != (m.cfg.Role == Prefill) {
			return fmt.Errorf("rooms: request %d in %v on a %v", id, q.phase, m.cfg.Role)
		}
		if want := q.phase == Transfer || q.phase == Aborting; q.held != want {
			return fmt.Errorf("rooms: request %d in %v holding pages %v", id, q.phase, q.held)
		}
		if q.held {
			held++
		}
	}
	if m.reserves != m.releases+m.arrivals+held {
		return fmt.Errorf("rooms: %d reserves, %d releases, %d arrivals, %d held", m.reserves, m.releases, m.arrivals, held)
	}
	return nil
}

func (m *Machine) violate(format string, args ...any) {
	if m.violation == nil {
		m.violation = fmt.Errorf("rooms: "+format, args...)
	}
	if invariants {
		panic(m.violation)
	}
}

// check runs Check after an event in builds with invariants on.
func (m *Machine) check() {
	if !invariants {
		return
	}
	if err := m.Check(); err != nil {
		panic(err)
	}
}
