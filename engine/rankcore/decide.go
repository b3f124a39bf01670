package rankcore

import (
	"hash/fnv"

	"github.com/pdkit/pdkit/engine/sched"
)

// The decisions below take agreed values in and give what every rank
// does with them; they hold no state and read no clock.

// PlanDigest is FNV-1a over the step number and (id, start, tokens) of
// every batch item, in order: what Agree proves every rank planned alike.
func PlanDigest(step uint64, run []sched.Item) uint64 {
	h := fnv.New64a()
	var buf [24]byte
	put64(buf[:], step)
	h.Write(buf[:8])
	for _, it := range run {
		put64(buf[0:], it.ID)
		put64(buf[8:], uint64(it.Start))
		put64(buf[16:], uint64(it.Tokens))
		h.Write(buf[:])
	}
	return h.Sum64()
}

func put64(b []byte, v uint64) {
	for i := range 8 {
		b[i] = byte(v >> (8 * i))
	}
}

// AgreeProposal is a rank's proposal for Agree: its plan digest and the
// digest negated (shifted to stay clear of the int64 edge), so that one
// MAX-reduction yields both the maximum and the minimum.
func AgreeProposal(digest uint64) []int64 {
	v := int64(digest >> 2)
	return []int64{v, -v}
}

// PlansAgree reports whether the MAX-reduced Agree proposal says every
// rank planned the same step: the maximum equals the minimum.
func PlansAgree(reduced []int64) bool { return len(reduced) == 2 && reduced[0] == -reduced[1] }

// Match is one rank's prefix-cache match of a request joining the
// scheduler: the tokens its device cache holds, and those its device and
// host tier hold together.
type Match struct{ Device, Total int }

// AdmitProposal lays out a rank's matches for Admit: the device matches,
// the total matches, then the device matches negated, so that one
// MIN-reduction yields each request's least device match, least total and
// greatest device match.
func AdmitProposal(ms []Match) []int64 {
	k := len(ms)
	n := make([]int64, 3*k)
	for i, m := range ms {
		n[i], n[k+i], n[2*k+i] = int64(m.Device), int64(m.Total), -int64(m.Device)
	}
	return n
}

// AdmitAgreed is the match every rank admits request i of k at, from the
// MIN-reduced Admit proposal: the least device match, and the least total
// when every rank's device cache matched alike; when they differ (a rank
// matched more on its device), the host part is not loaded anywhere.
func AdmitAgreed(reduced []int64, i, k int) Match {
	dev, total := int(reduced[i]), int(reduced[k+i])
	if int(-reduced[2*k+i]) != dev {
		total = dev
	}
	return Match{Device: dev, Total: total}
}
