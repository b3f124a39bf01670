package serve

import (
	"fmt"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
)

// PDConfig configures the PD roles. Zero values take the defaults noted.
type PDConfig struct {
	// OnRankInfos, on a prefill server, is given the ranks' registry
	// entries (RankInfos) again after a live change of what they say (an
	// index-K precision switch), for the server to re-register them in its
	// bootstrap registry. It is called on rank 0's loop and must not block.
	OnRankInfos func([]pdproto.RankInfo) `json:"-"`
	// Secret is the cluster's shared secret: every PD socket admits only
	// peers presenting the credential derived from it, and presents it
	// (docs/protocol.md, "Authentication"). Nil: any peer is admitted, as
	// a loopback-only cluster may allow.
	Secret *clusterauth.Secret `json:"-"`
	// Host is the address the ranks' ZeroMQ sockets bind (default
	// 127.0.0.1).
	Host string
	// AdvertiseHost is the host peers dial the ranks' sockets at, put in
	// every endpoint the ranks hand out (registry entries, TRANSFER_INFO,
	// heartbeats). Default Host; required when Host is a wildcard such as
	// 0.0.0.0, which binds every address but names none a peer can dial.
	AdvertiseHost string
	// BootstrapTimeout bounds the bootstrap (prefill: waiting for the
	// decode's TRANSFER_INFO; decode: resolving the prefill's registry and
	// waiting for pages). Default 10s.
	BootstrapTimeout time.Duration
	// TransferTimeout bounds a decode request's wait for its KV once
	// TRANSFER_INFO is sent, and a prefill request's time in its
	// scheduler once TRANSFER_INFO arrived (the decode has given up by
	// then). Default 30s.
	TransferTimeout time.Duration
	// InflightTimeout bounds a prefill request's wait for the decode's
	// acknowledgement of the last chunk. Default 10s.
	InflightTimeout time.Duration
	// AbortAckTimeout is how long a decode keeps an aborted room's pages
	// reserved waiting for ABORT_ACK from every prefill rank. Default 5s.
	AbortAckTimeout time.Duration
	// SendTimeout bounds handing one message to the transport. Default 2s.
	SendTimeout time.Duration
	// HeartbeatInterval is how often a decode rank probes each prefill
	// rank it waits on, and tells it of each room it queues for memory
	// (QUEUED; at least three times per bootstrap timeout) (default 500ms); HeartbeatTimeout is how long a
	// probe may go unanswered before the rooms on that peer fail (default
	// 3s).
	HeartbeatInterval, HeartbeatTimeout time.Duration
	// ReservedDecodeTokens is the decode's room for growth: it reserves
	// pages for a transfer only while the pages left cover, for every
	// request it holds (running, parked, retracted, in transfer), the next
	// this many tokens of its output (fewer when its max_tokens ends
	// sooner), and a retracted request's whole recompute. Without it,
	// transfers take the pages running requests grow into, those are
	// retracted, and a retracted request can wait for ever behind the
	// parked transfers. Default 512; negative: no reserve.
	ReservedDecodeTokens int
	// PrefillBootstrap lists the bootstrap registries (http://host:port)
	// of the prefill servers a decode takes requests for. A request whose
	// bootstrap_url is not among them is refused (ErrBootstrapURL) before
	// anything is fetched: the URL comes from a client. A decode without
	// any refuses every request until AllowPrefillBootstrap adds one.
	PrefillBootstrap []string
	// BootstrapCacheSize bounds the registry lookups a decode keeps, the
	// least recently used dropped first. Default 64.
	BootstrapCacheSize int
	// MaxMessageBytes bounds each frame a rank's PD socket accepts
	// (ZMQ_MAXMSGSIZE): a peer that declares a larger one is dropped
	// (counted in the Inbox's Disconnects). 0: derived from the model's
	// shapes, the largest legal KV_CHUNK frame (decode) or TRANSFER_INFO
	// (prefill), and 64 KiB more.
	MaxMessageBytes int64
	// MaxPeerSockets bounds the peer sockets a rank keeps open, the least
	// recently used closed first (default zmqlink.DefaultMaxPeers), and
	// PeerSocketIdle closes one unused for that long (default
	// zmqlink.DefaultPeerIdle): peers are endpoints other processes name.
	MaxPeerSockets int
	PeerSocketIdle time.Duration
	// HandshakeTimeout bounds how long a connection to a rank's PD socket
	// may take to authenticate (to complete its ZMTP handshake): one that
	// says nothing is closed then, so silent connections cannot pile up
	// (default 5s; libzmq's own is 30s).
	HandshakeTimeout time.Duration
	// MaxConnections bounds the connections a rank's PD socket holds at
	// once (default zmqlink.DefaultMaxConnections), so a stranger opening
	// connections cannot take the process's descriptors; those not yet
	// authenticated hold at most a quarter of the places, so he cannot
	// shut members out either.
	MaxConnections int
	// ReplyQueue bounds the replies waiting to be sent (ABORT_ACK,
	// heartbeats, STATUS for a forgotten room); one that finds it full,
	// or its peer's backlog full, is dropped and counted
	// (PDLink.RepliesDropped). Default DefaultReplyQueue.
	ReplyQueue int
	// EarlyRoomsPerSender bounds the rooms one sender (the endpoint its
	// messages name) may hold in a prefill rank's mailbox before their
	// requests arrive, of the 4,096 all senders share; more are dropped
	// and counted (PDLink.OverQuota). Default DefaultEarlyRoomsPerSender.
	EarlyRoomsPerSender int
}

func (c *PDConfig) setDefaults() {
	if c.Host == "" {
		c.Host = "127.0.0.1"
	}
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{{&c.BootstrapTimeout, 10 * time.Second}, {&c.TransferTimeout, 30 * time.Second},
		{&c.InflightTimeout, 10 * time.Second}, {&c.AbortAckTimeout, 5 * time.Second}, {&c.SendTimeout, 2 * time.Second},
		{&c.HeartbeatInterval, 500 * time.Millisecond}, {&c.HeartbeatTimeout, 3 * time.Second},
		{&c.PeerSocketIdle, zmqlink.DefaultPeerIdle}, {&c.HandshakeTimeout, 5 * time.Second}} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if c.ReservedDecodeTokens == 0 {
		c.ReservedDecodeTokens = 512
	}
	if c.BootstrapCacheSize == 0 {
		c.BootstrapCacheSize = 64
	}
	for _, d := range []struct {
		v   *int
		def int
	}{{&c.MaxPeerSockets, zmqlink.DefaultMaxPeers}, {&c.MaxConnections, zmqlink.DefaultMaxConnections},
		{&c.ReplyQueue, DefaultReplyQueue}, {&c.EarlyRoomsPerSender, DefaultEarlyRoomsPerSender}} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
}

// validate refuses the PD settings the engine itself reads: its sockets,
// its heartbeats, its registry lookups. The settings of the rooms machine
// (the phases' timeouts) are the machine's to refuse, in its words:
// Config.Validate hands it the configuration every rank's machine gets
// (roomsConfig). Errors name the flags as Config.Validate's do.
func (c PDConfig) validate() error {
	if isWildcardHost(c.advertiseHost()) {
		return fmt.Errorf("PD host %q (--pd-host) binds every address and names none a peer can dial: set the advertise host (--advertise-host)", c.advertiseHost())
	}
	for _, d := range []struct {
		name, flag string
		v          time.Duration
	}{{"send timeout", "send-timeout", c.SendTimeout}, {"peer socket idle", "peer-socket-idle", c.PeerSocketIdle},
		{"handshake timeout", "pd-handshake-timeout", c.HandshakeTimeout}} {
		if d.v < 0 {
			return fmt.Errorf("PD %s %v (--%s) must not be negative", d.name, d.v, d.flag)
		}
	}
	for _, n := range []struct {
		name, flag string
		v          int64
	}{{"max message bytes", "max-message-bytes", c.MaxMessageBytes}, {"max peer sockets", "max-peer-sockets", int64(c.MaxPeerSockets)},
		{"max connections", "pd-max-connections", int64(c.MaxConnections)}, {"reply queue", "reply-queue", int64(c.ReplyQueue)},
		{"early rooms per sender", "early-rooms-per-sender", int64(c.EarlyRoomsPerSender)},
		{"bootstrap cache size", "bootstrap-cache-size", int64(c.BootstrapCacheSize)}} {
		if n.v < 0 {
			return fmt.Errorf("PD %s %d (--%s) must not be negative", n.name, n.v, n.flag)
		}
	}
	// The heartbeat timeout's own sign is the machine's rule (a phase
	// deadline); its interval is the engine's.
	if c.HeartbeatInterval <= 0 || (c.HeartbeatTimeout > 0 && c.HeartbeatTimeout <= c.HeartbeatInterval) {
		return fmt.Errorf("PD heartbeat interval %v (--heartbeat-interval) must be positive and shorter than the heartbeat timeout %v (--heartbeat-timeout)", c.HeartbeatInterval, c.HeartbeatTimeout)
	}
	return nil
}

// socketAuth sets on o the mechanism of a rank's inbox (inbox) or outbox
// of role, derived from the cluster secret (none without one): a
// prefill's inbox is its control socket and a decode's outbox talks to
// one, both CURVE; a decode's inbox is its KV socket and a prefill's
// outbox feeds it, both PLAIN with the rotating KV credential.
func (c *PDConfig) socketAuth(o *zmqlink.SocketOptions, prefill, inbox bool) {
	sp, ss, cp, cs, ok := c.Secret.CurveKeys()
	if !ok {
		return
	}
	if prefill == inbox { // the control socket's two ends
		o.Curve = &zmqlink.CurveKeys{ServerPublic: sp, ServerSecret: ss, ClientPublic: cp, ClientSecret: cs}
		return
	}
	o.Rotating = KVAuth(c.Secret)
}

// KVAuth is the rotating PLAIN credential of the KV sockets
// (clusterauth.Secret.KVCredential); nil without a secret.
func KVAuth(secret *clusterauth.Secret) *zmqlink.RotatingAuth {
	if !secret.Set() {
		return nil
	}
	return &zmqlink.RotatingAuth{Credential: secret.KVCredential, Admit: secret.KVAdmit, Rotate: clusterauth.KVEpoch}
}

// PDRequest is the PD part of a Request.
type PDRequest struct {
	Room uint64
	// BootstrapURL is the prefill server's registry (decode role only): one
	// of PDConfig.PrefillBootstrap.
	BootstrapURL string
}

// machineConfig is the rank's PD queue machine configuration.
func (e *Engine) machineConfig(rank int) rooms.Config {
	return e.cfg.roomsConfig(rank, e.view.indexKName())
}

// roomsConfig is the configuration of rank's PD queue machine, with the
// pool's index-K precision indexKDType ("" for a model without an
// indexer). Validate checks it by the machine's own rules before any rank
// is built, so a machine is never handed one it refuses.
func (c *Config) roomsConfig(rank int, indexKDType string) rooms.Config {
	p := &c.PD
	role := rooms.Decode
	if c.Role == pdproto.RolePrefill {
		role = rooms.Prefill
	}
	return rooms.Config{Role: role, Rank: rank, PageSize: c.PageSize, IndexKDType: indexKDType,
		BootstrapTimeout: p.BootstrapTimeout, TransferTimeout: p.TransferTimeout, InflightTimeout: p.InflightTimeout,
		AbortAckTimeout: p.AbortAckTimeout, HeartbeatTimeout: p.HeartbeatTimeout, ReservedDecodeTokens: p.ReservedDecodeTokens,
		RequestTimeout: max(0, c.RequestTimeout), QueuedInterval: min(p.HeartbeatInterval, p.BootstrapTimeout/3)}
}
