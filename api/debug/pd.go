package debug

import (
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// PDPath is a prefill or decode server's PD state (GET, JSON PDResponse);
// a colocated server answers 404.
const PDPath = "/debug/v1/pd"

// PD queue names, as in PDEntry.Queue and the queue filter of GET
// /debug/v1/pd.
const (
	PDQueueBootstrap = "bootstrap" // prefill: waiting for the decode's transfer info
	PDQueueActive    = "active"    // prefill: in the scheduler, KV streamed per chunk
	PDQueueInflight  = "inflight"  // prefill: KV sent, waiting for the decode's ack
	PDQueuePrealloc  = "prealloc"  // decode: resolving the registry, reserving pages
	PDQueueTransfer  = "transfer"  // decode: waiting for the KV
	PDQueueAborting  = "aborting"  // decode: ABORT sent, pages held until acked
)

// PDQueues lists the PD queue names of both roles.
var PDQueues = []string{PDQueueBootstrap, PDQueueActive, PDQueueInflight, PDQueuePrealloc, PDQueueTransfer, PDQueueAborting}

// PDQueuesOf lists the PD queues of a server role, in the order a request
// moves through them; nil for a role without PD queues (colocated).
func PDQueuesOf(role string) []string {
	switch role {
	case pdproto.RolePrefill:
		return PDQueues[:3:3]
	case pdproto.RoleDecode:
		return PDQueues[3:]
	}
	return nil
}

// PDResponse is the body of GET /debug/v1/pd.
type PDResponse struct {
	Role string `json:"role"` // prefill or decode
	// Queue is the filter asked for; empty: every queue.
	Queue string `json:"queue,omitempty"`
	// FailedRequests counts the PD requests that failed since the server
	// started (client aborts not counted). FailuresByReason splits them by
	// the kind of their reason (PDFailureKinds); FailuresByQueue by the PD
	// queue each was in when it failed. Both leave out zeros.
	FailedRequests   uint64            `json:"failed_requests"`
	FailuresByReason map[string]uint64 `json:"failures_by_reason"`
	FailuresByQueue  map[string]uint64 `json:"failures_by_queue"`
	// TransferBytes is the KV payload moved, rank 0's share.
	TransferBytes uint64   `json:"transfer_bytes"`
	Ranks         []PDRank `json:"ranks"`
}

// The kinds of a PD failure's reason, the keys of
// PDResponse.FailuresByReason.
const (
	PDFailTimeout       = "timeout"        // the queue's deadline passed
	PDFailPeerAborted   = "peer-aborted"   // prefill: the decode sent ABORT (its client left, or it failed)
	PDFailPeerFailed    = "peer-failed"    // the peer sent STATUS Failed
	PDFailPeerLost      = "peer-lost"      // decode: the prefill peer left heartbeats unanswered
	PDFailPeerRestarted = "peer-restarted" // decode: the prefill peer answers with a new boot number
	PDFailSend          = "send"           // handing a message to the transport failed
	PDFailRefused       = "refused"        // the peer's TRANSFER_INFO or registry does not fit this server
	PDFailBadChunk      = "bad-chunk"      // decode: a KV chunk out of order, out of range or not writable
	PDFailScheduler     = "scheduler"      // prefill: the scheduler ended the request (its timeout, an error)
	PDFailOtherRank     = "other-rank"     // another rank of the server decided the failure
)

// PDFailureKinds lists the kinds of PDResponse.FailuresByReason, in the
// order tools list them.
var PDFailureKinds = []string{PDFailTimeout, PDFailPeerAborted, PDFailPeerFailed, PDFailPeerLost, PDFailPeerRestarted,
	PDFailSend, PDFailRefused, PDFailBadChunk, PDFailScheduler, PDFailOtherRank}

// PDRank is one rank's PD socket and queues.
type PDRank struct {
	Rank int `json:"rank"`
	// Boot is the rank group's boot number, which its heartbeats carry:
	// a decode hears it in a prefill's replies, and a new one means the
	// prefill restarted (or rebuilt its rank group).
	Boot   string   `json:"boot"`
	Socket PDSocket `json:"socket"`
	// Peers is a decode rank's table of the prefill ranks it probed, by
	// endpoint; absent on a prefill.
	Peers []PDPeer `json:"peers,omitempty"`
	// PendingKVBytes is, on a decode rank, the KV payload its socket
	// received and its loop has not applied yet: landed, not in transit.
	PendingKVBytes int64 `json:"pending_kv_bytes,omitempty"`
	// Counts has every queue's length on the rank, whatever the filter.
	Counts map[string]int `json:"counts"`
	// Entries are the rank's PD requests as the rank last published them
	// (after its last loop iteration), by id.
	Entries []PDEntry `json:"entries"`
}

// PDPeer is what a decode rank knows of one prefill rank from its
// heartbeats and its KV: a partition leaves the peer silent with its boot
// unchanged, a restart answers with a new boot (or from a new endpoint).
type PDPeer struct {
	Endpoint string `json:"endpoint"`
	// Boot is the boot number of the peer's last heartbeat reply; empty
	// before the first.
	Boot string `json:"boot,omitempty"`
	// LastWord is the peer's last heartbeat reply or mail for a room it
	// serves (its KV is a word: on a slow link replies wait behind it).
	LastWord *time.Time `json:"last_word"`
	// LastProbe is when the rank last probed it (only while a room waits
	// on it).
	LastProbe *time.Time `json:"last_probe"`
	// SilentMS is how long its oldest unanswered probe has waited; 0 when
	// none. It keeps growing after the rank stops probing (no room waits
	// on the peer): judge it against LastProbe.
	SilentMS float64 `json:"silent_ms"`
	// LostRooms counts the rooms the rank failed for the peer's silence
	// past the heartbeat timeout, LastLost the last of them.
	LostRooms uint64     `json:"lost_rooms"`
	LastLost  *time.Time `json:"last_lost,omitempty"`
	// BootAtLoss is the peer's boot as last heard before that loss: a
	// prefill that restarted on the same endpoint answers with another
	// boot later, which Boot then shows.
	BootAtLoss string `json:"boot_at_loss,omitempty"`
}

// PDSocket is a rank's PD socket: the receive loop of its inbox (control
// on a prefill rank, KV on a decode rank) and its outbox.
type PDSocket struct {
	Endpoint string `json:"endpoint"`
	// Advertised is the endpoint the rank hands to its peers (a prefill
	// registers it); it differs from Endpoint when the socket binds every
	// address or --advertise-host names another.
	Advertised string `json:"advertised,omitempty"`
	// AuthDenied counts peer connections the socket refused at the
	// handshake: no cluster credential, or another cluster's.
	AuthDenied uint64 `json:"auth_denied"`
	// AuthAdmitted counts the connections it admitted; LastAuthDenied
	// says why the last refusal was made (a wrong credential, with the
	// peer's address when known; none; a connection that ended first).
	AuthAdmitted   uint64 `json:"auth_admitted"`
	LastAuthDenied string `json:"last_auth_denied,omitempty"`
	// Connections open on the socket now, and those of them not yet past
	// their handshake; ConnectionsRefused counts the connections shut by
	// --pd-max-connections, ConnectionsShed those of them shut while
	// still before their handshake, to keep strangers' silent connections
	// to a quarter of the places (and to a sixteenth from one source);
	// LastShed names the last one shed and why.
	Connections        int64  `json:"connections"`
	ConnectionsPending int64  `json:"connections_pending"`
	ConnectionsRefused uint64 `json:"connections_refused"`
	ConnectionsShed    uint64 `json:"connections_shed"`
	LastShed           string `json:"last_shed,omitempty"`
	// Alive: the receive loop runs; ExitReason says why it ended.
	Alive         bool   `json:"alive"`
	ExitReason    string `json:"exit_reason,omitempty"`
	Messages      uint64 `json:"messages"`       // multipart messages received
	Bytes         uint64 `json:"bytes"`          // bytes received, all frames
	HandlerErrors uint64 `json:"handler_errors"` // malformed: refused by the handler, dropped
	HandlerPanics uint64 `json:"handler_panics"` // recovered, dropped
	RecvErrors    uint64 `json:"recv_errors"`
	// Disconnects counts peer connections that ended: a peer that sends a
	// frame over --max-message-bytes is dropped and shows only here.
	Disconnects uint64 `json:"disconnects"`
	// LastMessage is when the last message arrived; null before the first.
	LastMessage *time.Time `json:"last_message"`
	LastError   string     `json:"last_error,omitempty"`
	Late        uint64     `json:"late"`      // for rooms the rank does not have, dropped
	Misplaced   uint64     `json:"misplaced"` // of a type the role never receives, dropped
	Faulted     uint64     `json:"faulted"`   // dropped by a drop-* fault switch
	// OverQuota counts messages for a new room dropped because their
	// sender held its quota of early rooms (prefill); RepliesDropped the
	// replies (ABORT_ACK, heartbeats) dropped for a full reply queue or a
	// peer with a full backlog.
	OverQuota      uint64   `json:"over_quota"`
	RepliesDropped uint64   `json:"replies_dropped"`
	Outbox         PDOutbox `json:"outbox"`
}

// PDOutbox is a rank's sending side.
type PDOutbox struct {
	Alive      bool   `json:"alive"`
	Peers      int    `json:"peers"`   // connected peer sockets
	Queued     int    `json:"queued"`  // waiting in the send queue
	Backlog    int    `json:"backlog"` // held for peers at their high-water mark
	Sent       uint64 `json:"sent"`
	Bytes      uint64 `json:"bytes"`
	SendErrors uint64 `json:"send_errors"`
	Dropped    uint64 `json:"dropped"` // backlog overflow or timeout, forgotten peer, close
	// QueueFull counts messages refused because the queue or the peer's
	// backlog stayed full; Evicted and IdleClosed the peer sockets closed
	// to stay within --max-peer-sockets and after --peer-socket-idle.
	QueueFull  uint64 `json:"queue_full"`
	Evicted    uint64 `json:"evicted"`
	IdleClosed uint64 `json:"idle_closed"`
	LastError  string `json:"last_error,omitempty"`
}

// PDEntry is one PD request on one rank.
type PDEntry struct {
	ID ID `json:"id"` // the request's id on this server
	// ClientRequestID is the client's X-Request-Id, when it sent one.
	ClientRequestID string `json:"client_request_id,omitempty"`
	Room            ID     `json:"room"` // the bootstrap room
	Queue           string `json:"queue"`
	// InQueueMS is the time in the queue as of the rank's last iteration.
	InQueueMS float64 `json:"in_queue_ms"`
	Peer      string  `json:"peer,omitempty"` // the peer rank's endpoint, once known
	Tokens    int     `json:"tokens"`         // prompt tokens
	Chunks    int     `json:"chunks"`         // KV chunks sent (prefill) or applied (decode)
	Bytes     int     `json:"bytes"`          // KV payload bytes moved
	AbortSent bool    `json:"abort_sent"`     // decode: ABORT sent to the prefill rank
	Acked     bool    `json:"abort_acked"`    // decode: the prefill rank acknowledged the ABORT
	// Poll is the rank's own KVPoll judgement of the request in its last
	// iteration (Bootstrapping, WaitingForInput, Transferring, Success,
	// Failed); Agreed is the MIN over the server's ranks, the state every
	// rank acted on. A rank whose Poll is above Agreed waits for another.
	Poll   string `json:"poll"`
	Agreed string `json:"agreed"`
	Error  string `json:"error,omitempty"`
	// DeadlineInMS is how long the entry may still stay in its queue, as
	// of the rank's last iteration (negative once past it): a fixed
	// timeout, or a lease its peer's word renews (Leased: a prefill room
	// the decode keeps queued, a decode room waiting for pages while its
	// prefill lives). Null when nothing but the peer's liveness bounds it
	// (no request timeout).
	DeadlineInMS *float64 `json:"deadline_in_ms"`
	Leased       bool     `json:"leased,omitempty"`
	// Position is the room's place in the decode's queue of rooms waiting
	// for memory (on a prefill: as the decode last said in QUEUED).
	Position int `json:"position,omitempty"`
}
