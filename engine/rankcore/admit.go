package rankcore

import "fmt"

// A request joining the scheduler is matched by every rank against its
// own prefix cache: the device pages it matched stay locked, the host part
// past them stays pinned. Once Admit agreed the match every rank admits it
// at (AdmitAgreed), each rank decides what to do with its own match; the
// executor (engine/serve) locks, unlocks and loads the pages.

// Keep is what a rank does with its own match of a joining request.
type Keep uint8

const (
	// KeepLoad keeps the match whole: the device pages stay locked and
	// the host part pinned, to load the agreed part at the request's
	// first admission.
	KeepLoad Keep = iota
	// KeepUnpin keeps the device pages; the agreed match loads nothing
	// from host, so the host pins go now.
	KeepUnpin
	// KeepAgreed lets the rank's match go (a peer matched less on its
	// device) and locks the agreed device part alone.
	KeepAgreed
)

func (k Keep) String() string {
	switch k {
	case KeepLoad:
		return "keep, load from host"
	case KeepUnpin:
		return "keep, unpin host"
	case KeepAgreed:
		return "drop, lock the agreed part"
	}
	return fmt.Sprintf("keep(%d)", uint8(k))
}

// Admission is one rank's decision for a joining request's match.
type Admission struct {
	Own    Match // the rank's own match
	Agreed Match // the match every rank admits it at
	// Differ: the ranks' device caches matched it differently, so no
	// rank loads anything from host.
	Differ bool
	Keep   Keep
}

// Loaded is the agreed host part: the tokens every rank loads back.
func (a Admission) Loaded() int { return a.Agreed.Total - a.Agreed.Device }

func (a Admission) String() string {
	s := fmt.Sprintf("admit at %d", a.Agreed.Total)
	if n := a.Loaded(); n > 0 {
		s += fmt.Sprintf(" (%d on device, %d from host)", a.Agreed.Device, n)
	}
	s += fmt.Sprintf(": own %d+%d: %s", a.Own.Device, a.Own.Total-a.Own.Device, a.Keep)
	if a.Keep == KeepLoad && a.Own.Total > a.Agreed.Total {
		s += fmt.Sprintf(" (%d of %d)", a.Loaded(), a.Own.Total-a.Own.Device)
	}
	if a.Differ {
		s += " (device caches differ)"
	}
	return s
}

// PlanAdmit decides, per joining request, what this rank does with its own
// match (own, as proposed in AdmitProposal) once Admit MIN-reduced the
// proposals into reduced: a rank whose device matched more than the least
// lets its match go and locks the least; the others keep theirs, loading
// the agreed host part, or, when the agreed match has none (the least
// total is the device match, or the device caches differ), unpinning
// their host part now. Every MatchHost needs its LoadBack: each decision
// takes one.
func PlanAdmit(own []Match, reduced []int64) []Admission {
	k := len(own)
	out := make([]Admission, k)
	for i, m := range own {
		a := Admission{Own: m, Agreed: AdmitAgreed(reduced, i, k), Differ: -reduced[2*k+i] != reduced[i]}
		switch {
		case m.Device > a.Agreed.Device:
			a.Keep = KeepAgreed
		case a.Agreed.Total == a.Agreed.Device:
			a.Keep = KeepUnpin
		default:
			a.Keep = KeepLoad
		}
		out[i] = a
	}
	return out
}
