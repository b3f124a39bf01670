package zmqlink

import (
	"fmt"
	"net/netip"
	"net/url"
	"strconv"
	"sync/atomic"
	"time"
)

// Connection cap (InboxOptions.MaxConnections). libzmq accepts every
// connection a listener is offered and has no limit of its own, so a
// stranger who opens thousands holds thousands of descriptors until each
// times out. The Inbox's socket monitor reports every accepted connection
// with its descriptor and every ended one; connCap keeps the set of open
// connections from those events and shuts down (shutdown(2), never close:
// the descriptor stays libzmq's, which then sees the peer gone and cleans
// up as for any hang-up) those it will not keep.
//
// A place is not given to whoever comes first. A connection is pending
// until it is past its handshake, and pending connections are bounded
// apart from the rest: at most MaxPending in all and MaxPendingPerAddress
// from one source (an IPv4 address, or an IPv6 /64, which one host
// holds). A connection that arrives when its source, or the pending
// connections as a whole, are at their bound sheds the oldest pending one
// of that source, or of all; so does one that arrives when every place is
// taken. A newcomer is refused only when every place is held by
// connections past their handshake. A stranger without the credential
// can then hold no more than MaxPending places, churning among them,
// while a member's connection passes its handshake in a round trip or
// two and keeps its place: silent connections cannot shut members out.
//
// Past its handshake means the Inbox has sent the peer more than its
// greeting: in ZMTP 3 the server's next command (PLAIN's WELCOME, NULL's
// READY) goes out only once the peer has authenticated, and a refused
// peer gets an ERROR and is closed. The kernel counts what the peer has
// acknowledged (TCP_INFO, Linux; a peer that holds back its
// acknowledgements only stays pending longer). A connection older than
// the handshake timeout is past it too, since libzmq closes one that is
// not; that is the only test where TCP_INFO is missing. Connections are
// judged lazily, oldest first, when room is needed, so each one costs at
// most one such check.
//
// Events are read after the fact, so before it shuts a descriptor connCap
// checks that it is still the same connection (a socket on the Inbox's
// port with the same peer address and port): a descriptor closed
// meanwhile and reused is left alone. The monitor can drop events under a
// flood (its queue is bounded): a lost accept undercounts, and a lost
// hang-up is found when the cap is reached, by checking each remembered
// descriptor again (once per max refusals).
//
// The events of one connection come in order, and with one I/O thread (as
// every Inbox of engine/serve has) those of all connections do: a
// descriptor's hang-up is published before libzmq closes it, so before
// any accept that reuses it.

// Monitor events the connection cap reads (zmq.h): the value of each is
// the connection's descriptor.
const (
	eventAccepted = 0x0020 // ZMQ_EVENT_ACCEPTED
	connEvents    = eventAccepted | eventDisconnected
)

// greetingBytes is the size of a ZMTP 3 greeting: what the Inbox sends a
// peer before the peer has authenticated.
const greetingBytes = 64

// DefaultMaxConnections is InboxOptions.MaxConnections's usual setting for
// a rank's PD socket: each peer rank keeps one connection, as many as an
// Outbox keeps peers (DefaultMaxPeers). It also bounds what strangers can
// make the socket hold before authentication: libzmq reads a handshake
// command of up to MaxMsgSize from each connection.
const DefaultMaxConnections = DefaultMaxPeers

// defaultHandshake is libzmq's handshake timeout (ZMQ_HANDSHAKE_IVL).
const defaultHandshake = 30 * time.Second

// pendingBounds are the defaults of InboxOptions.MaxPending (a quarter of
// the places, so three quarters are kept for members) and
// MaxPendingPerAddress (a quarter of those, so one host cannot take them
// all; at least 2, since a host's ranks may connect at once).
func pendingBounds(maxConns, maxPending, perAddr int) (int, int) {
	if maxPending <= 0 {
		maxPending = max(1, maxConns/4)
	}
	if perAddr <= 0 {
		perAddr = min(maxPending, max(2, maxPending/4))
	}
	return maxPending, perAddr
}

// connProbe is what the cap asks the kernel about a descriptor; sysProbe
// asks it, tests script it.
type connProbe interface {
	// peer is the remote address of fd, when fd is a connection on the
	// Inbox's port.
	peer(fd int32) (netip.AddrPort, bool)
	// handshaken reports whether the peer of fd has acknowledged more
	// than the Inbox's greeting.
	handshaken(fd int32) bool
	// shutdown ends fd if it is still the connection to peer, and
	// reports whether it did.
	shutdown(fd int32, peer netip.AddrPort) bool
}

// conn is one open connection the cap keeps.
type conn struct {
	fd     int32
	peer   netip.AddrPort
	source netip.Prefix
	at     time.Time // when its accept was read
}

// connCap tracks an Inbox's open connections, bounds the pending ones and
// refuses those past max (0: none refused). It is used by the one
// goroutine that reads the socket's monitor; the atomics are read by
// Stats.
type connCap struct {
	max, maxPending, perAddr int
	handshake                time.Duration
	probe                    connProbe

	live    map[int32]*conn
	pending []*conn // not yet known past the handshake, oldest first
	sources map[netip.Prefix]int
	shut    map[int32]struct{} // shut by the cap, until their hang-up
	// sinceCheck counts the accepts refused since the remembered
	// descriptors were last checked: a full set is checked again once
	// per max refusals, so that a flood costs a few system calls per
	// connection, not two per remembered one.
	sinceCheck int

	open       atomic.Int64
	pendingNow atomic.Int64
	closing    atomic.Int64 // len(shut)
	refused    atomic.Uint64
	shed       atomic.Uint64
	lastShed   atomic.Pointer[string]
}

func newConnCap(max, maxPending, perAddr int, handshake time.Duration, probe connProbe) *connCap {
	if handshake <= 0 {
		handshake = defaultHandshake
	}
	maxPending, perAddr = pendingBounds(max, maxPending, perAddr)
	return &connCap{max: max, maxPending: maxPending, perAddr: perAddr, handshake: handshake, probe: probe,
		live: make(map[int32]*conn), sources: make(map[netip.Prefix]int), shut: make(map[int32]struct{})}
}

// event takes one monitor event, read at now, and reports whether it is
// the hang-up of a connection the cap shut, which the caller counts as
// neither a disconnect nor a failed authentication.
func (c *connCap) event(event uint16, fd int32, now time.Time) (capped bool) {
	switch event {
	case eventAccepted:
		c.accepted(fd, now)
	case eventDisconnected:
		if _, capped = c.shut[fd]; capped {
			delete(c.shut, fd)
		}
		c.forget(fd)
	default:
		return false
	}
	c.open.Store(int64(len(c.live)))
	c.pendingNow.Store(int64(len(c.pending)))
	c.closing.Store(int64(len(c.shut)))
	return capped
}

func (c *connCap) accepted(fd int32, now time.Time) {
	peer, ok := c.probe.peer(fd)
	if !ok {
		return // already gone: its hang-up will find nothing to forget
	}
	c.forget(fd) // a reused descriptor whose hang-up was lost
	n := &conn{fd: fd, peer: peer, source: sourceOf(peer.Addr()), at: now}
	if c.max == 0 || !peer.IsValid() {
		c.live[fd] = n // counted only: no cap, or not a TCP port
		return
	}
	if c.sources[n.source] >= c.perAddr {
		c.shedOldest(now, n.source, shedSource)
	}
	if len(c.pending) >= c.maxPending {
		c.shedOldest(now, netip.Prefix{}, shedPending)
	}
	if len(c.live) >= c.max {
		c.checkLive()
	}
	if len(c.live) >= c.max && !c.shedOldest(now, netip.Prefix{}, shedFull) {
		c.sinceCheck++
		if c.probe.shutdown(fd, peer) {
			c.refused.Add(1)
			c.shut[fd] = struct{}{}
		}
		return // not tracked: its hang-up will find nothing to forget
	}
	c.sinceCheck = 0
	c.add(n)
}

func (c *connCap) add(n *conn) {
	c.live[n.fd] = n
	c.pending = append(c.pending, n)
	c.sources[n.source]++
}

// Why a pending connection was shed.
const (
	shedSource  = iota // its source was at MaxPendingPerAddress
	shedPending        // MaxPending were pending
	shedFull           // every place was taken
)

// shedOldest shuts the oldest pending connection of source (any when
// source is the zero prefix) that is still before its handshake, first
// taking those past it out of pending; false if none is left to shed.
func (c *connCap) shedOldest(now time.Time, source netip.Prefix, why int) bool {
	for i := 0; i < len(c.pending); {
		n := c.pending[i]
		if source.IsValid() && n.source != source {
			i++
			continue
		}
		if now.Sub(n.at) > c.handshake || c.probe.handshaken(n.fd) {
			c.unpend(i) // a member: it keeps its place
			continue
		}
		c.unpend(i)
		delete(c.live, n.fd)
		if c.probe.shutdown(n.fd, n.peer) {
			c.refused.Add(1)
			c.shed.Add(1)
			c.shut[n.fd] = struct{}{}
			c.noteShed(n, why)
		}
		return true
	}
	return false
}

// noteShed keeps why n was shed, for Stats.
func (c *connCap) noteShed(n *conn, why int) {
	var s string
	switch why {
	case shedSource:
		s = fmt.Sprintf("%s: the oldest of %d unauthenticated connections from %s", n.peer, c.perAddr, n.source)
	case shedPending:
		s = fmt.Sprintf("%s: the oldest of %d unauthenticated connections", n.peer, c.maxPending)
	default:
		s = fmt.Sprintf("%s: the oldest unauthenticated connection, for a newcomer with all %d places taken", n.peer, c.max)
	}
	c.lastShed.Store(&s)
}

// unpend takes pending[i] out of pending.
func (c *connCap) unpend(i int) {
	n := c.pending[i]
	c.pending = append(c.pending[:i], c.pending[i+1:]...)
	if c.sources[n.source]--; c.sources[n.source] <= 0 {
		delete(c.sources, n.source)
	}
}

// forget drops fd's connection, if the cap keeps one.
func (c *connCap) forget(fd int32) {
	if _, ok := c.live[fd]; !ok {
		return
	}
	delete(c.live, fd)
	for i, n := range c.pending {
		if n.fd == fd {
			c.unpend(i)
			break
		}
	}
}

// checkLive forgets, once per max refusals, the remembered connections
// that are no longer there (their hang-up event was lost).
func (c *connCap) checkLive() {
	if c.sinceCheck%c.max != 0 {
		return
	}
	for fd, n := range c.live {
		if p, ok := c.probe.peer(fd); !ok || p != n.peer {
			c.forget(fd)
		}
	}
}

// sourceOf is the source a connection is bounded by: its IPv4 address,
// or the /64 of its IPv6 one.
func sourceOf(a netip.Addr) netip.Prefix {
	a = a.Unmap()
	bits := 32
	if a.Is6() {
		bits = 64
	}
	p, err := a.Prefix(bits)
	if err != nil {
		return netip.PrefixFrom(a, a.BitLen()) // no address: all such share one
	}
	return p
}

// sysProbe asks the kernel about the Inbox's descriptors (conns_unix.go,
// conns_linux.go). Until the Inbox is bound on a TCP port, port is 0 and
// nothing is shut down.
type sysProbe struct {
	port atomic.Int64
}

// bound tells the probe the socket's endpoint, once it is bound.
func (p *sysProbe) bound(endpoint string) { p.port.Store(int64(endpointPort(endpoint))) }

// endpointPort is the TCP port of a bound endpoint such as
// tcp://127.0.0.1:5557; 0 for another transport.
func endpointPort(endpoint string) int {
	u, err := url.Parse(endpoint)
	if err != nil || u.Scheme != "tcp" {
		return 0
	}
	p, err := strconv.Atoi(u.Port())
	if err != nil {
		return 0
	}
	return p
}
