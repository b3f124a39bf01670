package rooms

import (
	"errors"
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// Role is the side of the PD pair a machine serves.
type Role uint8

const (
	Prefill Role = iota
	Decode
)

func (r Role) String() string {
	if r == Prefill {
		return "prefill"
	}
	return "decode"
}

// Phase is where a room is on this rank.
type Phase uint8

const (
	Bootstrap Phase = iota // prefill: waiting for TRANSFER_INFO
	Active                 // prefill: in the scheduler, KV streaming
	Inflight               // prefill: KV sent, waiting for the decode's STATUS
	Prealloc               // decode: registry, then pages
	Transfer               // decode: TRANSFER_INFO sent, chunks landing
	Aborting               // decode: failed, pages held until acked
)

// Phases lists every phase, in the order of their numbers.
var Phases = []Phase{Bootstrap, Active, Inflight, Prealloc, Transfer, Aborting}

var phaseNames = [...]string{"bootstrap", "active", "inflight", "prealloc", "transfer", "aborting"}

func (p Phase) String() string {
	if int(p) < len(phaseNames) {
		return phaseNames[p]
	}
	return fmt.Sprintf("Phase(%d)", uint8(p))
}

// Kind classifies a failure, for code and metrics; the Reason's text is for
// people.
type Kind uint8

const (
	KindNone           Kind = iota
	KindAborted             // an abort was asked: the client, the router or an operator
	KindTimeout             // the phase's deadline passed
	KindPeerAborted         // the decode sent ABORT
	KindPeerFailed          // the peer sent STATUS Failed
	KindPeerLost            // the prefill peer left heartbeats unanswered
	KindPeerRestarted       // the prefill peer answers with a new boot number
	KindSend                // handing a message to the transport failed on this rank
	KindRefused             // the peer's TRANSFER_INFO or registry does not fit this server
	KindBadChunk            // a KV chunk out of order, out of range or not writable
	KindScheduler           // the prefill's scheduler ended the request (its timeout, an error)
	KindOtherRank           // another rank voted Failed; this one saw nothing wrong yet
	KindPromptMismatch      // the peer's prompt fingerprint is not this request's: two requests share the room
)

var kindNames = [...]string{"none", "aborted", "timeout", "peer-aborted", "peer-failed", "peer-lost", "peer-restarted",
	"send", "refused", "bad-chunk", "scheduler", "other-rank", "prompt-mismatch"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Kinds lists every failure kind but KindNone, for metrics.
var Kinds = []Kind{KindAborted, KindTimeout, KindPeerAborted, KindPeerFailed, KindPeerLost, KindPeerRestarted,
	KindSend, KindRefused, KindBadChunk, KindScheduler, KindOtherRank, KindPromptMismatch}

// Reason says why a room failed.
type Reason struct {
	Kind Kind
	Text string
	// Asked says the end was asked for (the client, the router, an
	// operator, on this side or the peer's): an abort, which the stream
	// ends as one, not a failure.
	Asked bool
}

func (r Reason) String() string { return r.Text }

// IsZero reports whether no failure is recorded.
func (r Reason) IsZero() bool { return r.Kind == KindNone }

func because(k Kind, format string, args ...any) Reason {
	return Reason{Kind: k, Text: fmt.Sprintf(format, args...)}
}

// Config is the machine's part of the server's settings. Every rank of a
// group has the same, but Rank and IndexKDType.
type Config struct {
	Role     Role
	Rank     int // this rank, in the TP group (the low bits of its votes)
	PageSize int
	// IndexKDType is the pool's index-K precision ("fp8", "bf16"; "" for a
	// model without an indexer); a prefill refuses TRANSFER_INFO for another.
	IndexKDType string

	BootstrapTimeout time.Duration // Bootstrap, Prealloc
	TransferTimeout  time.Duration // Active, Transfer
	InflightTimeout  time.Duration // Inflight
	AbortAckTimeout  time.Duration // Aborting
	HeartbeatTimeout time.Duration // a decode room's prefill peer may stay silent this long
	// RequestTimeout bounds a room's whole PD life, whatever it waits
	// for (zero: no bound beyond the phases' own deadlines and leases).
	RequestTimeout time.Duration
	// QueuedInterval is how often a decode tells the prefill of a room
	// that waits for its memory (QUEUED), renewing the room's lease there.
	QueuedInterval time.Duration

	// ReservedDecodeTokens is the decode's room for growth: a transfer
	// takes pages only while the pages left cover this many more output
	// tokens of every request held (see Budget). Negative: none.
	ReservedDecodeTokens int
}

// Validate refuses a configuration the machine cannot run: New calls it,
// and so does the server's own Validate with the configuration it will
// hand each rank's machine, so that a bad setting is refused at start-up in
// these words and never reaches New. Each error names a setting as the
// flag that sets it on a server does (BootstrapTimeout is
// --bootstrap-timeout), so a server passes the error on unchanged; Role,
// Rank and QueuedInterval, which a server derives, go by their own names.
func (c Config) Validate() error {
	if c.Role != Prefill && c.Role != Decode {
		return fmt.Errorf("rooms: role %d: want prefill or decode", c.Role)
	}
	if c.Rank < 0 || c.Rank > maxRank {
		return fmt.Errorf("rooms: rank %d: want 0 to %d", c.Rank, maxRank)
	}
	if c.PageSize < 1 {
		return fmt.Errorf("rooms: page size %d (--page-size) must be positive", c.PageSize)
	}
	for _, t := range []struct {
		name, flag string
		d          time.Duration
	}{{"bootstrap", "bootstrap-timeout", c.BootstrapTimeout}, {"transfer", "transfer-timeout", c.TransferTimeout},
		{"inflight", "inflight-timeout", c.InflightTimeout}, {"abort-ack", "abort-ack-timeout", c.AbortAckTimeout},
		{"heartbeat", "heartbeat-timeout", c.HeartbeatTimeout}} {
		if t.d <= 0 {
			return fmt.Errorf("rooms: %s timeout %v (--%s) must be positive: each phase needs a deadline", t.name, t.d, t.flag)
		}
	}
	if c.RequestTimeout < 0 {
		return fmt.Errorf("rooms: request timeout %v (--request-timeout) must not be negative (0: no bound)", c.RequestTimeout)
	}
	if c.Role == Decode && (c.QueuedInterval <= 0 || c.QueuedInterval >= c.BootstrapTimeout) {
		return fmt.Errorf("rooms: QUEUED every %v must be positive and within the prefill's bootstrap timeout %v (--bootstrap-timeout)", c.QueuedInterval, c.BootstrapTimeout)
	}
	return nil
}

// Request is a PD request as it arrives on every rank.
type Request struct {
	ID        uint64 // the engine's request id
	Room      uint64 // bootstrap room
	PromptLen int
	MaxTokens int    // tokens to generate (prefill: 1)
	URL       string // decode: the prefill's bootstrap registry
	// Prompt is the prompt's fingerprint: a TRANSFER_INFO (prefill) or a
	// KV chunk (decode) with another is for another request's prompt.
	Prompt pdproto.Fingerprint
}

// Mail is what this rank's socket received for a room since it was last
// filed.
type Mail struct {
	Info   *pdproto.TransferInfo // prefill: the decode's handshake
	Queued *pdproto.Queued       // prefill: the decode holds the room in its queue
	Abort  *pdproto.Abort        // prefill: the decode gave up
	Chunks []*pdproto.KVChunk    // decode: KV, in order
	Status *pdproto.Status       // the peer's verdict
	Acked  bool                  // decode: ABORT_ACK from the peer rank
}

// Empty reports whether m holds nothing.
func (m Mail) Empty() bool {
	return m.Info == nil && m.Queued == nil && m.Abort == nil && len(m.Chunks) == 0 && m.Status == nil && !m.Acked
}

// Liveness is what this rank knows of a prefill peer from heartbeats.
type Liveness struct {
	Silent time.Duration // how long its oldest unanswered probe has waited; 0 when none
	Boot   uint64        // its boot number from its last reply; 0 before the first
}

// Resolution is the outcome of a decode room's registry lookup on this rank.
type Resolution struct {
	Endpoint string // the prefill rank this rank pairs with
	Err      error
}

// Budget is what a decode may give to transfers in one iteration: agreed
// values (MIN over the ranks, or the same scheduler on every rank).
type Budget struct {
	FreePages int // pages free (and evictable) on every rank
	FreeRows  int // sequence rows free on every rank
	// SchedGrowth is the pages the scheduler's requests may still need
	// for their next ReservedDecodeTokens of output.
	SchedGrowth int
	// SchedSlots is the scheduler's free admission slots: rows kept for
	// requests it may start (a retracted one restarts on a fresh row).
	SchedSlots int
}

// Outcome is how a request's stream ends.
type Outcome struct {
	OK     bool   // prefill: the decode acknowledged the KV
	Reason Reason // why not, when !OK
	Phase  Phase  // the phase it ended in
	// Owner: this rank's vote decided the failure (the lowest rank that
	// voted Failed): it alone logs and counts it.
	Owner bool
	// Peer is the peer rank's endpoint, when known.
	Peer string
}

// Entry is one room as a debug reader sees it.
type Entry struct {
	ID, Room     uint64
	Phase        Phase
	Since        time.Duration // entered the phase, on the agreed clock
	Peer         string
	PromptLen    int
	Chunks       int // sent (prefill) or landed (decode)
	Bytes        int
	AbortSent    bool
	Acked        bool
	Vote, Agreed pdproto.KVPoll
	Reason       Reason // the rank's own failure reason, or the agreed one's
	// Deadline is when the room's phase times out on this rank, on the
	// agreed clock: a fixed timeout, or the end of a lease its peer's word
	// renews (Leased). NoDeadline when the only bound is a lease the peer's
	// liveness renews without end (no request timeout).
	Deadline time.Duration
	Leased   bool
	Position int // the room's place in the decode's queue (prefill: as the decode last said)
}

// NoDeadline is an Entry's Deadline when nothing bounds the phase but the
// peer's liveness.
const NoDeadline = time.Duration(1<<63 - 1)

// Stats count what the machine dropped.
type Stats struct {
	Misplaced uint64 // mail that made no sense in the room's phase
}

var (
	ErrDuplicate = errors.New("rooms: request or room already known")
	ErrInvalid   = errors.New("rooms: invalid request")
	ErrUnknown   = errors.New("rooms: unknown request")
	ErrVotes     = errors.New("rooms: agreed votes do not match the rooms")
)
