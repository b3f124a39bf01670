package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/serve"
)

// pdQueue is one PD queue gauge: the engine's queue name and the metric.
type pdQueue struct {
	queue string
	desc  *prometheus.Desc
}

// pdDescs are the metrics of a prefill or decode engine, read at scrape
// time from the engine's lock-free PD accessors (PDQueueEntries, PDLinks,
// PDFailures, PDTransferBytes).
type pdDescs struct {
	queues        []pdQueue // the role's queues, per rank
	failQueues    []string  // the queues a request of the role can fail in
	failed, bytes *prometheus.Desc
	rankBytes     *prometheus.Desc
	received      *prometheus.Desc
	dropped       *prometheus.Desc
	sent          *prometheus.Desc
	sendErrors    *prometheus.Desc
	loopUp        *prometheus.Desc
	refused       *prometheus.Desc // requests refused at the door, by reason
	evicted       *prometheus.Desc // decode: registry lookups dropped from the bounded cache
	authDenied    *prometheus.Desc // connections refused at the handshake
	lost          *prometheus.Desc // peer connections the socket lost
	conns         *prometheus.Desc // peer connections open on the socket
	connsRefused  *prometheus.Desc // connections shut past --pd-max-connections
	connsPending  *prometheus.Desc // connections open, not yet past their handshake
	connsShed     *prometheus.Desc // pending connections shut to make room
	closed        *prometheus.Desc // peer sockets closed by the Outbox's bounds, by reason
}

// Reasons of pdkit_pd_peer_sockets_closed_total.
const (
	PeerClosedEvicted = "evicted" // to stay within --max-peer-sockets
	PeerClosedIdle    = "idle"    // unused for --peer-socket-idle
)

// Reasons of pdkit_pd_refused_reqs_total.
const (
	RefusedRoomInUse    = "room_in_use"   // the room belongs to a live request of the server
	RefusedBootstrapURL = "bootstrap_url" // decode: bootstrap_url is not one of its prefill registries
	RefusedUnsigned     = "unsigned"      // not signed with the cluster secret (the server's HTTP handler refused it)
)

// Reasons of pdkit_pd_dropped_messages_total.
const (
	DropMalformed    = "malformed"     // the inbox handler refused it (undecodable, unknown type, bad guard)
	DropHandlerPanic = "handler_panic" // handling it panicked (recovered)
	DropLate         = "late"          // for a room the rank does not have
	DropMisplaced    = "misplaced"     // of a type the rank's role never receives
	DropFault        = "fault"         // by a drop-* fault switch
	DropOverQuota    = "over_quota"    // prefill: for a new room past its sender's quota of early rooms
	DropReply        = "reply"         // a reply the rank owed (ABORT_ACK, heartbeat): its queue or its peer's backlog was full
)

// newPDDescs returns the PD metrics of role; nil for a colocated engine.
func newPDDescs(role string) *pdDescs {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, labels, nil)
	}
	var queues []pdQueue
	switch role {
	case pdproto.RolePrefill:
		queues = []pdQueue{
			{"bootstrap", d("num_prefill_bootstrap_queue_reqs", "PD requests waiting for their decode's transfer info, per rank.", "rank")},
			{"inflight", d("num_prefill_inflight_queue_reqs", "PD requests whose KV is sent, waiting for the decode's acknowledgement, per rank.", "rank")},
		}
	case pdproto.RoleDecode:
		queues = []pdQueue{
			{"prealloc", d("num_decode_prealloc_queue_reqs", "PD requests resolving the prefill's registry or waiting for KV pages, per rank.", "rank")},
			{"transfer", d("num_decode_transfer_queue_reqs", "PD requests waiting for their KV from the prefill, per rank.", "rank")},
			{"aborting", d("num_decode_aborting_queue_reqs", "Aborted PD requests holding their pages until the prefill acknowledges the abort, per rank.", "rank")},
		}
	default:
		return nil
	}
	failQueues := []string{"bootstrap", "active", "inflight"}
	if role == pdproto.RoleDecode {
		failQueues = []string{"prealloc", "transfer"}
	}
	return &pdDescs{
		queues:       queues,
		failQueues:   failQueues,
		failed:       d("pd_failed_reqs_total", "PD requests that failed (bootstrap, transfer or peer failure; client aborts not counted), by the queue they failed in.", "queue"),
		rankBytes:    d("kv_transfer_rank_bytes_total", "KV payload bytes the rank sent (prefill) or applied (decode).", "rank"),
		bytes:        d("kv_transfer_bytes_total", "KV payload bytes sent (prefill) or received (decode), rank 0's share."),
		received:     d("pd_messages_received_total", "Messages the rank's PD socket received.", "rank"),
		dropped:      d("pd_dropped_messages_total", "Messages the rank's PD socket dropped, by reason (malformed, handler_panic, late, misplaced, fault, over_quota, reply).", "rank", "reason"),
		sent:         d("pd_messages_sent_total", "Messages the rank handed to ZeroMQ for its peers.", "rank"),
		sendErrors:   d("pd_send_errors_total", "Messages the rank failed to connect or send (dropped).", "rank"),
		loopUp:       d("pd_receive_loop_up", "1 while the rank's PD receive loop runs, 0 once it has exited.", "rank"),
		refused:      d("pd_refused_reqs_total", "PD requests refused on arrival, by reason (room_in_use: the room belongs to a live request; bootstrap_url: not one of the decode's prefill registries; unsigned: not signed with the cluster secret, so not from the cluster's router).", "reason"),
		evicted:      d("pd_bootstrap_lookups_evicted_total", "Prefill registry lookups a decode dropped to keep its cache within --bootstrap-cache-size."),
		authDenied:   d("pd_auth_denied_total", "Peer connections the rank's PD socket refused at the handshake: no cluster credential, or another cluster's.", "rank"),
		lost:         d("pd_peer_disconnects_total", "Peer connections the rank's PD socket lost, among them peers dropped for a frame over --max-message-bytes.", "rank"),
		conns:        d("pd_connections", "Peer connections open on the rank's PD socket.", "rank"),
		connsRefused: d("pd_connections_refused_total", "Connections the rank's PD socket shut down to stay within --pd-max-connections, among them those counted by pdkit_pd_connections_shed_total.", "rank"),
		connsPending: d("pd_connections_pending", "Connections open on the rank's PD socket and not yet past their handshake (they hold at most a quarter of --pd-max-connections).", "rank"),
		connsShed:    d("pd_connections_shed_total", "Connections the rank's PD socket shut down before their handshake, the oldest first, to keep unauthenticated connections to a quarter of --pd-max-connections and a sixteenth from one source: a rise while no peer restarts is a flood of strangers.", "rank"),
		closed:       d("pd_peer_sockets_closed_total", "Peer sockets the rank closed, by reason (evicted: to stay within --max-peer-sockets; idle: unused for --peer-socket-idle).", "rank", "reason"),
	}
}

func (p *pdDescs) describe(ch chan<- *prometheus.Desc) {
	if p == nil {
		return
	}
	for _, q := range p.queues {
		ch <- q.desc
	}
	for _, d := range []*prometheus.Desc{p.failed, p.bytes, p.rankBytes, p.received, p.dropped, p.sent, p.sendErrors, p.loopUp, p.refused, p.evicted, p.lost, p.closed, p.authDenied, p.conns, p.connsRefused, p.connsPending, p.connsShed} {
		ch <- d
	}
}

func (p *pdDescs) collect(eng *serve.Engine, unsigned uint64, ch chan<- prometheus.Metric) {
	if p == nil {
		return
	}
	val := func(d *prometheus.Desc, t prometheus.ValueType, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, t, v, labels...)
	}
	for r, entries := range eng.PD().QueueEntries() {
		n := map[string]int{}
		for _, e := range entries {
			n[e.Queue]++
		}
		rank := strconv.Itoa(r)
		for _, q := range p.queues {
			val(q.desc, prometheus.GaugeValue, float64(n[q.queue]), rank)
		}
	}
	fails := eng.PD().FailuresByQueue()
	for _, q := range p.failQueues {
		val(p.failed, prometheus.CounterValue, float64(fails[q]), q)
	}
	val(p.bytes, prometheus.CounterValue, float64(eng.PD().TransferBytes()))
	val(p.refused, prometheus.CounterValue, float64(eng.PD().RoomsInUse()), RefusedRoomInUse)
	val(p.refused, prometheus.CounterValue, float64(eng.PD().BootstrapRefused()), RefusedBootstrapURL)
	val(p.refused, prometheus.CounterValue, float64(unsigned), RefusedUnsigned)
	val(p.evicted, prometheus.CounterValue, float64(eng.PD().LookupsEvicted()))
	for _, l := range eng.PD().Links() {
		rank := strconv.Itoa(l.Rank)
		val(p.received, prometheus.CounterValue, float64(l.Inbox.Messages), rank)
		val(p.rankBytes, prometheus.CounterValue, float64(l.KVBytes), rank)
		val(p.dropped, prometheus.CounterValue, float64(l.Inbox.HandlerErrors), rank, DropMalformed)
		val(p.dropped, prometheus.CounterValue, float64(l.Inbox.HandlerPanics), rank, DropHandlerPanic)
		val(p.dropped, prometheus.CounterValue, float64(l.Late), rank, DropLate)
		val(p.dropped, prometheus.CounterValue, float64(l.Misplaced), rank, DropMisplaced)
		val(p.dropped, prometheus.CounterValue, float64(l.Faulted), rank, DropFault)
		val(p.dropped, prometheus.CounterValue, float64(l.OverQuota), rank, DropOverQuota)
		val(p.dropped, prometheus.CounterValue, float64(l.RepliesDropped), rank, DropReply)
		val(p.sent, prometheus.CounterValue, float64(l.Outbox.Sent), rank)
		val(p.sendErrors, prometheus.CounterValue, float64(l.Outbox.SendErrors), rank)
		val(p.lost, prometheus.CounterValue, float64(l.Inbox.Disconnects), rank)
		val(p.authDenied, prometheus.CounterValue, float64(l.Inbox.AuthDenied), rank)
		val(p.conns, prometheus.GaugeValue, float64(l.Inbox.Connections), rank)
		val(p.connsRefused, prometheus.CounterValue, float64(l.Inbox.ConnectionsRefused), rank)
		val(p.connsPending, prometheus.GaugeValue, float64(l.Inbox.ConnectionsPending), rank)
		val(p.connsShed, prometheus.CounterValue, float64(l.Inbox.ConnectionsShed), rank)
		val(p.closed, prometheus.CounterValue, float64(l.Outbox.Evicted), rank, PeerClosedEvicted)
		val(p.closed, prometheus.CounterValue, float64(l.Outbox.IdleClosed), rank, PeerClosedIdle)
		up := 0.0
		if l.Inbox.Alive {
			up = 1
		}
		val(p.loopUp, prometheus.GaugeValue, up, rank)
	}
}
