package rooms

import (
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// Action is one thing the loop does for the machine, in the order given.
// A send that fails is reported back with [Machine.SendFailed]; a chunk
// that cannot be written with [Machine.Failed].
type Action interface{ action() }

// Reserve: start request ID's sequence with room for Tokens prompt tokens
// (decode). The SendTransferInfo that follows names the slots.
type Reserve struct {
	ID     uint64
	Tokens int
}

// SendTransferInfo: send TRANSFER_INFO for the reserved sequence to Peer.
type SendTransferInfo struct {
	ID, Room uint64
	Peer     string
	Tokens   int
}

// SendQueued: tell the prefill rank that the room waits in the decode's
// queue, at Position (decode).
type SendQueued struct {
	ID, Room uint64
	Peer     string
	Position int
}

// SendChunk: copy the KV of the prompt tokens [Start, End) of ID's sequence
// into chunk Index of Room and send it to Peer, the last one with Final.
type SendChunk struct {
	ID, Room   uint64
	Peer       string
	Index      int
	Start, End int
	Final      *pdproto.ChunkFinal
}

// ApplyChunk: write a landed chunk into ID's reserved slots (decode).
type ApplyChunk struct {
	ID    uint64
	Chunk *pdproto.KVChunk
}

// SendStatus: tell the peer the room's verdict.
type SendStatus struct {
	ID, Room uint64
	Peer     string
	State    pdproto.KVPoll
	Error    string
	Asked    bool // a Failed someone asked for: an abort (pdproto.Status.Asked)
}

// SendAbort: tell the prefill rank the decode gave up on the room.
type SendAbort struct {
	ID, Room uint64
	Peer     string
	Reason   string
	Asked    bool // an abort someone asked for, not the decode's failure (pdproto.Abort.Asked)
}

// SendAbortAck: answer an ABORT; nothing more is written for the room.
type SendAbortAck struct {
	ID, Room uint64
	To       string
}

// Admit: a prefill room's TRANSFER_INFO is in on every rank: add the
// request to the scheduler (with the prefix-cache match).
type Admit struct{ ID uint64 }

// Cut: abort the prefill request in the scheduler; its finish comes back
// through [Machine.SchedFinished].
type Cut struct {
	ID     uint64
	Reason Reason
}

// Arrived: the prompt's KV is in on every rank (decode): commit the
// sequence and add the request to the scheduler with the prefill's first
// token. The room has left the machine.
type Arrived struct {
	ID    uint64
	First pdproto.ChunkFinal
	Bytes int
	Took  time.Duration // from TRANSFER_INFO to the last chunk, on the agreed clock
}

// Release: free ID's reserved sequence (decode); exactly once per Reserve.
type Release struct{ ID uint64 }

// End: the request's stream ends with Outcome. The room may stay (a
// decode holds its pages in Aborting) until Forget.
type End struct {
	ID      uint64
	Outcome Outcome
}

// Forget: the room left the machine; mail for it is late from now on.
// Why, when it failed, is what a prefill answers a decode that asks about
// the room later (TRANSFER_INFO or QUEUED of a decode that kept waiting).
type Forget struct {
	ID, Room uint64
	Why      string
	Asked    bool // the room ended by an abort someone asked for
}

func (Reserve) action()          {}
func (SendTransferInfo) action() {}
func (SendChunk) action()        {}
func (SendQueued) action()       {}
func (ApplyChunk) action()       {}
func (SendStatus) action()       {}
func (SendAbort) action()        {}
func (SendAbortAck) action()     {}
func (Admit) action()            {}
func (Cut) action()              {}
func (Arrived) action()          {}
func (Release) action()          {}
func (End) action()              {}
func (Forget) action()           {}

// Format writes an action as one line of a trace.
func Format(a Action) string {
	switch a := a.(type) {
	case Reserve:
		return fmt.Sprintf("reserve %d tokens=%d", a.ID, a.Tokens)
	case SendTransferInfo:
		return fmt.Sprintf("send-transfer-info %d room=%d to=%s tokens=%d", a.ID, a.Room, a.Peer, a.Tokens)
	case SendQueued:
		return fmt.Sprintf("send-queued %d room=%d to=%s position=%d", a.ID, a.Room, a.Peer, a.Position)
	case SendChunk:
		s := fmt.Sprintf("send-chunk %d room=%d to=%s index=%d [%d,%d)", a.ID, a.Room, a.Peer, a.Index, a.Start, a.End)
		if a.Final != nil {
			s += fmt.Sprintf(" final first=%d", a.Final.FirstToken)
		}
		return s
	case ApplyChunk:
		return fmt.Sprintf("apply-chunk %d index=%d [%d,%d)", a.ID, a.Chunk.Chunk, a.Chunk.Start, a.Chunk.End)
	case SendStatus:
		s := fmt.Sprintf("send-status %d room=%d to=%s %v", a.ID, a.Room, a.Peer, a.State)
		if a.Error != "" {
			s += fmt.Sprintf(" %q", a.Error)
		}
		return s
	case SendAbort:
		return fmt.Sprintf("send-abort %d room=%d to=%s %q", a.ID, a.Room, a.Peer, a.Reason)
	case SendAbortAck:
		return fmt.Sprintf("send-abort-ack %d room=%d to=%s", a.ID, a.Room, a.To)
	case Admit:
		return fmt.Sprintf("admit %d", a.ID)
	case Cut:
		return fmt.Sprintf("cut %d %v %q", a.ID, a.Reason.Kind, a.Reason.Text)
	case Arrived:
		return fmt.Sprintf("arrived %d first=%d bytes=%d took=%v", a.ID, a.First.FirstToken, a.Bytes, a.Took)
	case Release:
		return fmt.Sprintf("release %d", a.ID)
	case End:
		o := a.Outcome
		if o.OK {
			return fmt.Sprintf("end %d ok in %v", a.ID, o.Phase)
		}
		owner := ""
		if o.Owner {
			owner = " owner"
		}
		return fmt.Sprintf("end %d %v in %v%s %q", a.ID, o.Reason.Kind, o.Phase, owner, o.Reason.Text)
	case Forget:
		return fmt.Sprintf("forget %d room=%d", a.ID, a.Room)
	}
	return fmt.Sprintf("%T", a)
}
