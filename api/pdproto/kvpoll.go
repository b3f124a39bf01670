package pdproto

import "fmt"

// KVPoll is the transfer state of one request (one bootstrap room) on one
// rank. The numeric order matters: Failed is the smallest and Success the
// largest, so the MIN over the ranks of a TP group is the state of the
// slowest rank, and any rank that failed fails the request everywhere.
type KVPoll uint8

// The states, in the order a request moves through them.
const (
	Failed          KVPoll = 0 // terminal: the transfer will not complete
	Bootstrapping   KVPoll = 1 // peer not yet known (registry, handshake)
	WaitingForInput KVPoll = 2 // handshake done, waiting for the prefill forward
	Transferring    KVPoll = 3 // KV chunks are moving
	Success         KVPoll = 4 // terminal: every chunk landed and was acknowledged
)

var kvPollNames = [...]string{"Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"}

func (s KVPoll) String() string {
	if s.Valid() {
		return kvPollNames[s]
	}
	return fmt.Sprintf("KVPoll(%d)", uint8(s))
}

// ParseKVPoll is the state named name (as String writes it).
func ParseKVPoll(name string) (KVPoll, bool) {
	for i, n := range kvPollNames {
		if n == name {
			return KVPoll(i), true
		}
	}
	return 0, false
}

// Valid reports whether s is one of the five states.
func (s KVPoll) Valid() bool { return s <= Success }

// Terminal reports whether s is Failed or Success.
func (s KVPoll) Terminal() bool { return s == Failed || s == Success }

// Merge returns the state a rank holds for a request after it held old and
// learnt new (from a local event, a peer's STATUS or a reduction):
//
//   - Failed is sticky: once old is Failed the result is Failed;
//   - new Failed always wins, so Success never overwrites Failed and
//     Failed may replace any state;
//   - otherwise the state never moves backwards: the result is the larger
//     of old and new.
//
// A value outside the five states counts as Failed, so a corrupt state can
// only ever fail a request, never complete one.
func Merge(old, new KVPoll) KVPoll {
	if !old.Valid() || !new.Valid() || old == Failed || new == Failed {
		return Failed
	}
	return max(old, new)
}

// MinState is the state the ranks of a TP group agree on for one request:
// the smallest of their states. A value outside the five states counts as
// Failed, and so does an empty list: no rank's word is no evidence of
// progress.
func MinState(states ...KVPoll) KVPoll {
	if len(states) == 0 {
		return Failed
	}
	m := Success
	for _, s := range states {
		if !s.Valid() {
			return Failed
		}
		m = min(m, s)
	}
	return m
}
