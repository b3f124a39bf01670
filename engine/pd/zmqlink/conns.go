package zmqlink

import (
	"net/url"
	"strconv"
	"sync/atomic"
)

// Connection cap (InboxOptions.MaxConnections). libzmq accepts every
// connection a listener is offered and has no limit of its own, so a
// stranger who opens thousands holds thousands of descriptors until each
// times out. The Inbox's socket monitor reports every accepted connection
// with its descriptor and every ended one; connCap keeps the set of open
// descriptors from those events and shuts down (shutdown(2), never close:
// the descriptor stays libzmq's, which then sees the peer gone and cleans
// up as for any hang-up) a connection accepted while the cap is reached.
//
// Events are read after the fact, so before it shuts a descriptor connCap
// checks that it is still a socket on the Inbox's own port: a descriptor
// closed meanwhile and reused elsewhere in the process is left alone. The
// monitor can drop events under a flood (its queue is bounded): a lost
// accept undercounts, and a lost hang-up is found when the cap is reached,
// by checking each remembered descriptor again (once per max refusals).
//
// The events of one connection come in order, and with one I/O thread (as
// every Inbox of engine/serve has) those of all connections do: a
// descriptor's hang-up is published before libzmq closes it, so before
// any accept that reuses it. Events are read late, though: when the cap
// is reached, a connection may be shut on an accept whose place a hang-up
// still in the queue had freed; being ZeroMQ, it reconnects. With more I/O
// threads a connection's accept may be published after another thread has
// already seen it end; the cap then still bounds the count but may shut a
// newer connection than the one past it.
//
// The cap cannot tell a stranger's connection from a member's before the
// handshake ends (libzmq's events do not say which connection
// authenticated), so while a stranger holds every place, members are
// refused as well, for as long as he keeps them: each silent connection
// ends with the handshake timeout. That is the trade: the PD socket is
// shut to newcomers during such a flood, instead of the process running
// out of descriptors for everything, HTTP included.

// Monitor events the connection cap reads (zmq.h): the value of each is
// the connection's descriptor.
const (
	eventAccepted = 0x0020 // ZMQ_EVENT_ACCEPTED
	connEvents    = eventAccepted | eventDisconnected
)

// DefaultMaxConnections is InboxOptions.MaxConnections's usual setting for
// a rank's PD socket: each peer rank keeps one connection, as many as an
// Outbox keeps peers (DefaultMaxPeers). It also bounds what strangers can
// make the socket hold before authentication: libzmq reads a handshake
// command of up to MaxMsgSize from each connection.
const DefaultMaxConnections = DefaultMaxPeers

// connCap tracks an Inbox's open connections and refuses those past max
// (0: none refused). It is used by the one goroutine that reads the
// socket's monitor; open and refused are read by Stats.
type connCap struct {
	max  int
	port atomic.Int64 // the Inbox's TCP port once bound; 0: nothing is shut down
	live map[int32]struct{}
	shut map[int32]struct{} // shut by the cap, until their hang-up
	// sinceCheck counts the accepts refused since the remembered
	// descriptors were last checked: a full set is checked again once
	// per max refusals, so that a flood costs a few system calls per
	// connection, not two per remembered one.
	sinceCheck int
	open       atomic.Int64
	closing    atomic.Int64 // len(shut)
	refused    atomic.Uint64
}

func newConnCap(max int) *connCap {
	return &connCap{max: max, live: make(map[int32]struct{}), shut: make(map[int32]struct{})}
}

// bound tells the cap the socket's endpoint, once it is bound.
func (c *connCap) bound(endpoint string) { c.port.Store(int64(endpointPort(endpoint))) }

// event takes one monitor event and reports whether it is the hang-up of
// a connection the cap shut, which the caller counts as neither a
// disconnect nor a failed authentication.
func (c *connCap) event(event uint16, fd int32) (capped bool) {
	switch event {
	case eventAccepted:
		c.accepted(fd)
	case eventDisconnected:
		if _, capped = c.shut[fd]; capped {
			delete(c.shut, fd)
		}
		delete(c.live, fd)
	default:
		return false
	}
	c.open.Store(int64(len(c.live)))
	c.closing.Store(int64(len(c.shut)))
	return capped
}

func (c *connCap) accepted(fd int32) {
	port := int(c.port.Load())
	if c.max > 0 && len(c.live) >= c.max && c.sinceCheck%c.max == 0 {
		for k := range c.live {
			if !isConnOnPort(int(k), port) {
				delete(c.live, k) // its hang-up event was lost
			}
		}
	}
	if c.max > 0 && len(c.live) >= c.max && port != 0 {
		c.sinceCheck++
		if shutdownConnOnPort(int(fd), port) {
			c.refused.Add(1)
			c.shut[fd] = struct{}{}
		}
		return // not tracked: its hang-up will find nothing to forget
	}
	c.sinceCheck = 0
	c.live[fd] = struct{}{}
}

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
