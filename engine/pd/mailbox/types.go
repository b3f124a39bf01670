package mailbox

import (
	"errors"
	"fmt"
	"math"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
)

// MaxUnknownRooms bounds the rooms a prefill keeps mail for before their
// requests arrive, and the failed rooms it remembers.
const MaxUnknownRooms = 4096

// Config is the mailbox's part of a rank's settings.
type Config struct {
	Role rooms.Role
	Rank int // the rank's TP rank, in the acks and STATUS it sends
	// PerSender bounds the early rooms one sender may hold (0: only the
	// table's bound, MaxUnknownRooms).
	PerSender int
	// RoomBytes bounds the KV bytes filed for one room and not yet taken
	// (0: no bound): a whole context's KV for the rank, which no legal
	// transfer exceeds.
	RoomBytes int64
	// Sender and Boot go in the heartbeat replies: the rank's advertised
	// endpoint (see SetSender) and its boot number.
	Sender string
	Boot   uint64
}

func (c Config) validate() error {
	switch {
	case c.Role != rooms.Prefill && c.Role != rooms.Decode:
		return fmt.Errorf("mailbox: role %d", c.Role)
	case c.Rank < 0 || uint64(c.Rank) > math.MaxUint32:
		return fmt.Errorf("mailbox: rank %d out of range", c.Rank)
	case c.PerSender < 0 || c.RoomBytes < 0:
		return errors.New("mailbox: a bound must not be negative")
	}
	return nil
}

// Drop says why a message was not filed.
type Drop uint8

const (
	Kept      Drop = iota // not dropped: filed, answered or recorded
	Late                  // for a room or peer the rank does not have, or no longer
	Misplaced             // never sent to this role, or a second TRANSFER_INFO
	OverQuota             // past a sender's or a room's bound
)

var dropNames = [...]string{"kept", "late", "misplaced", "over-quota"}

func (d Drop) String() string {
	if int(d) < len(dropNames) {
		return dropNames[d]
	}
	return fmt.Sprintf("Drop(%d)", uint8(d))
}

// Decision is what became of one message.
type Decision struct {
	Filed bool // filed under its room, for the loop to take
	// Wake says the loop has something new: mail filed, or a peer's
	// heartbeat reply (which is not mail).
	Wake bool
	Drop Drop
	// Answer is what the rank owes the sender now, from the receive side
	// (nil: nothing), and To where it goes: an endpoint the message named.
	Answer pdproto.Message
	To     string
}

// Format writes a decision as one line of a trace.
func Format(d Decision) string {
	var s string
	switch {
	case d.Drop != Kept:
		s = "dropped " + d.Drop.String()
	case d.Filed:
		s = "filed"
	case d.Wake:
		s = "recorded"
	default:
		s = "not filed"
	}
	if d.Answer != nil {
		s += ", answer " + formatMessage(d.Answer) + " to=" + d.To
	}
	return s
}

// formatMessage writes an answer the machine makes.
func formatMessage(m pdproto.Message) string {
	switch m := m.(type) {
	case *pdproto.AbortAck:
		s := fmt.Sprintf("abort-ack room=%d rank=%d", m.Room, m.Rank)
		if m.Known {
			s += " known"
		}
		return s
	case *pdproto.Status:
		return fmt.Sprintf("status room=%d rank=%d %v %q", m.Room, m.Rank, m.State, m.Error)
	case *pdproto.Heartbeat:
		kind := "probe"
		if m.Reply {
			kind = "reply"
		}
		return fmt.Sprintf("heartbeat %s seq=%d sender=%s boot=%d", kind, m.Seq, m.Sender, m.Boot)
	}
	return fmt.Sprintf("%T", m)
}
