package pdproto

// Type is a message type: the ASCII text of frame 1.
type Type string

// The message types.
const (
	TypeTransferInfo Type = "TRANSFER_INFO" // decode → prefill rank
	TypeKVChunk      Type = "KV_CHUNK"      // prefill → decode rank
	TypeStatus       Type = "STATUS"        // prefill → decode rank (Failed); decode → prefill (Success: last chunk landed)
	TypeAbort        Type = "ABORT"         // decode → every prefill rank of the pair
	TypeAbortAck     Type = "ABORT_ACK"     // prefill → decode rank
	TypeHeartbeat    Type = "HEARTBEAT"     // decode → prefill and back
	TypeQueued       Type = "QUEUED"        // decode → prefill rank: the room waits for the decode's memory
)

// Types lists every message type.
var Types = []Type{TypeTransferInfo, TypeKVChunk, TypeStatus, TypeAbort, TypeAbortAck, TypeHeartbeat, TypeQueued}

// Message is one of *TransferInfo, *KVChunk, *Status, *Abort, *AbortAck,
// *Heartbeat and *Queued; no other type implements it.
type Message interface {
	// Type is the message's type, the text of its frame 1.
	Type() Type
	isMessage()
}

// TransferInfo tells a prefill rank where the KV of one request goes: it is
// the decode rank's half of the handshake, sent once the decode rank has
// reserved the destination pages. Each decode rank sends it to its peer
// prefill rank, so Pages are the pages of this rank's shard of the pool.
type TransferInfo struct {
	Room uint64 // bootstrap room: the request's correlation key
	// Endpoint is the decode rank's KV socket, where KV_CHUNK, STATUS and
	// ABORT_ACK for this room are to be sent ("tcp://10.0.0.2:41003").
	Endpoint string
	Rank     uint32 // the decode rank's TP rank
	// Pages are the destination page ids, in token order: token t of the
	// prompt lands in page Pages[t/pageSize].
	Pages []uint32
	// Tokens is the number of prompt tokens whose KV the decode expects.
	Tokens uint32
	// Prompt is the fingerprint of the decode's prompt; the prefill
	// refuses a room whose prompt has another.
	Prompt Fingerprint
	// IndexKDType is the decode pool's index-K precision ("fp8", "bf16");
	// the prefill refuses a room whose precision differs from its own.
	IndexKDType string
	// RequestID is the request's id on the decode side, for logs and the
	// debug API only; Room is the key.
	RequestID string
}

// LayerKV is one layer's share of a KV_CHUNK for one rank's shard: the K and
// V bytes of the chunk's tokens as the pool stores them, the index-K rows
// and their scales (empty for bf16 index-K, and all four empty for a layer
// without an indexer where it applies).
type LayerKV struct {
	K, V         []byte
	IndexK       []byte
	IndexKScales []byte
}

// ChunkFinal is what only the last chunk of a request carries.
type ChunkFinal struct {
	FirstToken   int32  // the token the prefill sampled after the prompt
	PromptTokens uint32 // prompt length as the prefill saw it
	CachedTokens uint32 // prompt tokens served from the prefill's prefix cache
}

// KVChunk carries the KV of the tokens [Start, End) of one request for one
// rank's shard, every layer. Chunks of a room are numbered from 0 and sent
// in order; the last one has Final set.
type KVChunk struct {
	Room       uint64
	Chunk      uint32 // index of this chunk within the room, from 0
	Start, End uint32 // token range [Start, End), Start ≤ End
	// Prompt is the fingerprint of the prompt the prefill computed the KV
	// of; the decode applies no chunk whose fingerprint differs from its
	// own prompt's.
	Prompt Fingerprint
	Layers []LayerKV
	// Final is set on the last chunk and only there; it is what is_last
	// means on the wire.
	Final *ChunkFinal
}

// Last reports whether c is the last chunk of its room.
func (c *KVChunk) Last() bool { return c.Final != nil }

// PayloadBytes is the number of KV, index-K and scale bytes c carries.
func (c *KVChunk) PayloadBytes() int {
	n := 0
	for _, l := range c.Layers {
		n += len(l.K) + len(l.V) + len(l.IndexK) + len(l.IndexKScales)
	}
	return n
}

// Status reports a room's state on one rank to its peer rank. A prefill
// rank sends Failed, with Error, to its decode peer when it aborted the
// request or the transfer failed; it writes nothing for the room after it.
// A decode rank sends Success to its prefill peer once the last chunk has
// landed, which lets the prefill release the request.
type Status struct {
	Room  uint64
	Rank  uint32 // the sending rank's TP rank
	State KVPoll
	Error string // why, when State is Failed; may be empty otherwise
	// Asked marks a Failed that someone asked for (the client, the
	// router, an operator): an abort, which the peer ends as an abort,
	// not as a failure (since version 5).
	Asked bool
}

// Abort tells a prefill rank that the decode side gave up on a room. The
// prefill rank fails the room, stops writing to it and answers ABORT_ACK to
// Endpoint once no write for the room is in flight. Endpoint is in the
// message, not looked up, so that an ABORT for a room the prefill has not
// seen yet (no TRANSFER_INFO) can still be acknowledged.
type Abort struct {
	Room     uint64
	Endpoint string // the decode rank's KV socket, where ABORT_ACK goes
	Rank     uint32 // the decode rank's TP rank
	Reason   string
	// Asked marks an abort someone asked for (the client, the router, an
	// operator), as against the decode's own failure (a timeout, a bad
	// chunk): the prefill ends the request as an abort (since version 5).
	Asked bool
}

// AbortAck answers an ABORT: from now on the prefill rank writes nothing
// for Room, so the decode may reuse the room's destination pages once every
// prefill rank it notified has acknowledged.
type AbortAck struct {
	Room uint64
	Rank uint32 // the acknowledging prefill rank's TP rank
	// InFlight reports whether a write for the room was in flight when the
	// ABORT arrived (the ack then waited for it to drain).
	InFlight bool
	// Known reports whether the rank had the room when the ABORT came
	// (and so failed it); false for a room it had not seen yet or had
	// already ended, which it only remembers as aborted.
	Known bool
}

// Queued tells a prefill rank that the decode holds the room in its queue,
// waiting for memory before it sends TRANSFER_INFO: the room is alive. A
// decode rank sends one per waiting room every heartbeat interval; each
// renews the room's lease on the prefill, whose bootstrap timeout then
// catches a silent or dead decode, never a busy one.
type Queued struct {
	Room     uint64
	Endpoint string // the decode rank's KV socket, where a STATUS Failed goes if the prefill ended the room
	Rank     uint32 // the decode rank's TP rank
	Position uint32 // the room's place among the decode's waiting rooms, from 0
}

// Heartbeat is a liveness probe and its answer: the decode sends one with
// Reply false to each prefill rank it depends on, and the prefill answers
// with Reply true, the same Seq and its own Sender, Boot and clock.
type Heartbeat struct {
	// Sender identifies the sender; for a probe it is the endpoint to
	// answer to.
	Sender string
	// Boot is a number the sender chose at start-up; a different Boot
	// from the same Sender means the peer restarted and forgot its rooms.
	Boot     uint64
	Seq      uint64 // probe sequence number, echoed by the reply
	UnixNano int64  // the sender's clock when it sent the message
	Reply    bool
}

func (*TransferInfo) Type() Type { return TypeTransferInfo }
func (*KVChunk) Type() Type      { return TypeKVChunk }
func (*Status) Type() Type       { return TypeStatus }
func (*Abort) Type() Type        { return TypeAbort }
func (*AbortAck) Type() Type     { return TypeAbortAck }
func (*Heartbeat) Type() Type    { return TypeHeartbeat }
func (*Queued) Type() Type       { return TypeQueued }

func (*TransferInfo) isMessage() {}
func (*KVChunk) isMessage()      {}
func (*Status) isMessage()       {}
func (*Abort) isMessage()        {}
func (*AbortAck) isMessage()     {}
func (*Heartbeat) isMessage()    {}
func (*Queued) isMessage()       {}

// RoomOf returns the bootstrap room m is about, and false for a HEARTBEAT,
// which is about none. A receiver uses it to drop late messages: those for
// a room it does not know (any more).
func RoomOf(m Message) (uint64, bool) {
	switch m := m.(type) {
	case *TransferInfo:
		return m.Room, true
	case *KVChunk:
		return m.Room, true
	case *Status:
		return m.Room, true
	case *Abort:
		return m.Room, true
	case *AbortAck:
		return m.Room, true
	case *Queued:
		return m.Room, true
	}
	return 0, false
}
