package zmqlink

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Handler handles one multipart message. It runs on the Inbox's receive
// goroutine, so messages are handled one at a time in arrival order, and
// while it runs nothing else is read from the socket (ZeroMQ buffers up to
// the receive high-water mark, then the senders' backlogs grow): a handler
// must return quickly, handing long work to another goroutine.
//
// The frames are lent, not given, whichever the backend: they are valid
// only until the handler returns. With SocketOptions.ZeroCopy their bytes
// are libzmq's receive buffers (no copy is made on receive), released when
// the handler returns; pebbe/zmq4 happens to hand over fresh copies, but a
// handler must not rely on it, so that it works on either backend. A
// handler that keeps any frame's bytes past its return (in a struct, a
// channel, another goroutine) must copy them first, for example with
// bytes.Clone or CloneFrames; the outer [][]byte slice itself is the
// handler's to keep. Reading a kept, uncopied zero-copy frame afterwards
// reads freed memory.
//
// A non-nil error counts the message as dropped (HandlerErrors); a panic is
// recovered and counted (HandlerPanics). Neither stops the loop. Wrapping a
// Handler in another (to count, trace, or inject faults for chaos tests)
// is the intended way to add behaviour.
type Handler func(frames [][]byte) error

// InboxOptions configure an Inbox. The zero value is usable.
type InboxOptions struct {
	SocketOptions
	// PollInterval bounds how long the receive goroutine waits in one poll,
	// and so how long Close waits for it to notice. Default 20ms.
	PollInterval time.Duration
	// CloseTimeout bounds Close. Default 5s.
	CloseTimeout time.Duration
	// MaxBatch is how many messages are read after one poll before the
	// goroutine checks for Close again. Default 64.
	MaxBatch int
	// MaxMsgSize bounds each frame a peer may send, in bytes
	// (ZMQ_MAXMSGSIZE; 0: no bound). libzmq drops the connection of a
	// peer that declares a larger frame when it reads the frame's header,
	// before it allocates the frame; the drop shows as a disconnect
	// (InboxStats.Disconnects).
	MaxMsgSize int64
	// HandshakeTimeout bounds how long a connection may take to complete
	// its ZMTP handshake (ZMQ_HANDSHAKE_IVL; 0: libzmq's 30s): a
	// connection that says nothing holds a descriptor until then, so a
	// stranger opening many of them is bounded by rate × this. With Auth
	// the dropped ones are counted in AuthDenied.
	HandshakeTimeout time.Duration
	// MaxConnections bounds the connections the socket holds at once (0:
	// no bound; DefaultMaxConnections suits a rank). libzmq has no such
	// limit: the cap shuts down what it will not keep and counts it
	// (InboxStats.ConnectionsRefused), so a stranger cannot take every
	// descriptor of the process. A refused ZeroMQ peer reconnects.
	MaxConnections int
	// MaxPending bounds, within MaxConnections, the connections not yet
	// past their handshake, and MaxPendingPerAddress those of one source
	// (an IPv4 address or an IPv6 /64); one that arrives past either
	// sheds the oldest such connection (conns.go), so that silent
	// connections cannot keep members out. 0: a quarter of
	// MaxConnections, and a quarter of MaxPending (at least 2).
	MaxPending, MaxPendingPerAddress int
}

const defaultInboxHWM = 1000

// InboxStats is a snapshot of an Inbox's counters for metrics and the
// debug API.
type InboxStats struct {
	Endpoint      string    `json:"endpoint"`
	Alive         bool      `json:"alive"`
	ExitReason    string    `json:"exit_reason,omitempty"`
	Messages      uint64    `json:"messages"`       // multipart messages received
	Bytes         uint64    `json:"bytes"`          // payload bytes received, all frames
	HandlerErrors uint64    `json:"handler_errors"` // handler returned an error: dropped
	HandlerPanics uint64    `json:"handler_panics"` // handler panicked: recovered, dropped
	RecvErrors    uint64    `json:"recv_errors"`    // socket errors while receiving
	LastMessage   time.Time `json:"last_message"`   // zero if none yet
	LastError     string    `json:"last_error,omitempty"`
	// Disconnects counts peer connections that ended, as libzmq's socket
	// monitor reports them. libzmq drops a peer that declares a frame over
	// MaxMsgSize and reports only that it disconnected, the same event as
	// a peer that closed, so a count that rises while no peer restarts is
	// oversized frames. With Auth the handshake monitor (auth.go), which
	// holds the socket's one monitor, counts them.
	Disconnects uint64 `json:"disconnects"`
	// Connections open now, and those of them not yet past their
	// handshake; ConnectionsRefused counts those the cap shut down
	// (MaxConnections), ConnectionsShed those of them shut while pending
	// to make room (MaxPending), and LastShed says whose and why.
	Connections        int64  `json:"connections"`
	ConnectionsPending int64  `json:"connections_pending"`
	ConnectionsRefused uint64 `json:"connections_refused"`
	ConnectionsShed    uint64 `json:"connections_shed"`
	LastShed           string `json:"last_shed,omitempty"`
	// With SocketOptions.Auth: connections admitted; connections refused
	// (none of their messages is delivered) for a wrong credential, none,
	// another mechanism, or for ending before they authenticated, as a
	// peer without a credential or a port scan may; handshakes that failed
	// for another protocol error; why the last refusal was made, with the
	// peer's address when ZAP had it.
	AuthAdmitted    uint64 `json:"auth_admitted"`
	AuthDenied      uint64 `json:"auth_denied"`
	HandshakeErrors uint64 `json:"handshake_errors"`
	LastAuthDenied  string `json:"last_auth_denied,omitempty"`
}

// Inbox receives multipart messages on a bound PULL socket.
type Inbox struct {
	endpoint string
	handler  Handler
	opts     InboxOptions

	closing   chan struct{}
	done      chan struct{}
	closeOnce sync.Once
	closeErr  error

	alive         atomic.Bool
	messages      atomic.Uint64
	bytes         atomic.Uint64
	handlerErrors atomic.Uint64
	handlerPanics atomic.Uint64
	recvErrors    atomic.Uint64
	disconnects   atomic.Uint64
	lastMessage   atomic.Int64 // unix nanoseconds
	exitReason    atomic.Pointer[string]
	lastError     atomic.Pointer[string]
	auth          authStats
	conns         *connCap
	probe         sysProbe
}

// Listen binds a PULL socket on endpoint (for example "tcp://127.0.0.1:0";
// a port 0 binds a free port, reported by Endpoint) and starts the receive
// goroutine, which calls h for each message until Close.
func Listen(endpoint string, h Handler, opts *InboxOptions) (*Inbox, error) {
	if h == nil {
		return nil, errors.New("zmqlink: nil handler")
	}
	in := &Inbox{handler: h, closing: make(chan struct{}), done: make(chan struct{})}
	if opts != nil {
		in.opts = *opts
	}
	if in.opts.PollInterval <= 0 {
		in.opts.PollInterval = 20 * time.Millisecond
	}
	if in.opts.CloseTimeout <= 0 {
		in.opts.CloseTimeout = 5 * time.Second
	}
	if in.opts.MaxBatch <= 0 {
		in.opts.MaxBatch = 64
	}
	if in.opts.HWM <= 0 {
		in.opts.HWM = defaultInboxHWM
	}
	if o := in.opts; o.MaxConnections < 0 || o.MaxPending < 0 || o.MaxPendingPerAddress < 0 {
		return nil, fmt.Errorf("zmqlink: max connections %d, pending %d, pending per address %d: want 0 (the default) or more",
			o.MaxConnections, o.MaxPending, o.MaxPendingPerAddress)
	}
	in.conns = newConnCap(in.opts.MaxConnections, in.opts.MaxPending, in.opts.MaxPendingPerAddress, in.opts.HandshakeTimeout, &in.probe)
	ready := make(chan error, 1)
	in.alive.Store(true)
	go in.run(endpoint, ready)
	if err := <-ready; err != nil {
		<-in.done
		return nil, err
	}
	return in, nil
}

// Endpoint is the endpoint the socket is bound to, with the real port when
// it was bound with port 0 (ZeroMQ's last endpoint).
func (in *Inbox) Endpoint() string { return in.endpoint }

// Alive reports whether the receive goroutine is running.
func (in *Inbox) Alive() bool { return in.alive.Load() }

// ExitReason is why the receive goroutine ended ("" while it runs).
func (in *Inbox) ExitReason() string {
	if p := in.exitReason.Load(); p != nil {
		return *p
	}
	return ""
}

// Stats returns a snapshot of the counters.
func (in *Inbox) Stats() InboxStats {
	s := InboxStats{
		Endpoint:      in.endpoint,
		Alive:         in.Alive(),
		ExitReason:    in.ExitReason(),
		Messages:      in.messages.Load(),
		Bytes:         in.bytes.Load(),
		HandlerErrors: in.handlerErrors.Load(),
		HandlerPanics: in.handlerPanics.Load(),
		RecvErrors:    in.recvErrors.Load(),
		Disconnects:   in.disconnects.Load(),
		LastMessage:   fromUnixNano(in.lastMessage.Load()),
	}
	if p := in.lastError.Load(); p != nil {
		s.LastError = *p
	}
	in.auth.fill(&s)
	s.Connections, s.ConnectionsPending = in.conns.open.Load(), in.conns.pendingNow.Load()
	s.ConnectionsRefused, s.ConnectionsShed = in.conns.refused.Load(), in.conns.shed.Load()
	if p := in.conns.lastShed.Load(); p != nil {
		s.LastShed = *p
	}
	return s
}

// Close stops the receive goroutine, which closes the socket and terminates
// the context. It waits at most the close timeout (ErrCloseTimeout if a
// handler does not return). Calling it again returns the first result.
func (in *Inbox) Close() error {
	in.closeOnce.Do(func() {
		in.closeErr = stopOwner(in.closing, in.done, in.opts.CloseTimeout)
	})
	return in.closeErr
}

func (in *Inbox) setExit(reason string) {
	in.exitReason.Store(&reason)
	in.alive.Store(false)
}

func (in *Inbox) noteError(err error) {
	s := err.Error()
	in.lastError.Store(&s)
}

// run is the owner goroutine: every call on the socket happens here.
func (in *Inbox) run(endpoint string, ready chan<- error) {
	defer close(in.done)
	ctx, err := newContext(in.opts.SocketOptions, nil)
	if err != nil {
		in.setExit(err.Error())
		ready <- err
		return
	}
	defer ctx.term()
	auth, err := in.startAuth(ctx)
	if err != nil {
		in.setExit(err.Error())
		ready <- err
		return
	}
	if auth != nil {
		defer auth.stop() // after the socket closes, before ctx.term
	}
	sock, err := in.bind(ctx, endpoint)
	if err != nil {
		in.setExit(err.Error())
		ready <- err
		return
	}
	defer sock.close() // runs before ctx.term
	var mon zSocket
	if auth == nil { // else the handshake monitor counts disconnects
		if mon, err = in.monitorDisconnects(ctx, sock); err != nil {
			in.setExit(err.Error())
			ready <- err
			return
		}
		defer mon.close() // runs before sock.close
	}
	ready <- nil

	reason := in.loop(ctx, sock, mon)
	in.setExit(reason)
}

// startAuth starts the handler that checks the credentials of every
// connection (auth.go), before the socket binds; nil without
// authentication.
func (in *Inbox) startAuth(ctx zContext) (*authHandler, error) {
	o := in.opts.SocketOptions
	switch {
	case o.Auth != nil:
		return startAuthHandler(ctx, admitPlain(*o.Auth), &in.auth, in.conns, in.opts.PollInterval)
	case o.Rotating != nil:
		return startAuthHandler(ctx, admitRotating(o.Rotating), &in.auth, in.conns, in.opts.PollInterval)
	case o.Curve != nil:
		return startAuthHandler(ctx, o.Curve.admit(), &in.auth, in.conns, in.opts.PollInterval)
	}
	return nil, nil
}

func (in *Inbox) bind(ctx zContext, endpoint string) (zSocket, error) {
	sock, err := ctx.socket(kindPULL)
	if err != nil {
		return nil, fmt.Errorf("zmqlink: new socket: %w", err)
	}
	fail := func(err error) (zSocket, error) {
		sock.close()
		return nil, err
	}
	if err := sock.setLinger(0); err != nil {
		return fail(fmt.Errorf("zmqlink: linger: %w", err))
	}
	if err := in.opts.apply(sock, false); err != nil {
		return fail(err)
	}
	if d := in.opts.HandshakeTimeout; d > 0 {
		if err := sock.setOpt(optHandshakeIvl, max(1, int(d/time.Millisecond))); err != nil {
			return fail(fmt.Errorf("zmqlink: handshake timeout: %w", err))
		}
	}
	if in.opts.MaxMsgSize > 0 {
		if err := sock.setOpt(optMaxMsgSize, int(in.opts.MaxMsgSize)); err != nil {
			return fail(fmt.Errorf("zmqlink: max message size: %w", err))
		}
	}
	if err := sock.bind(bindAddress(endpoint)); err != nil {
		return fail(fmt.Errorf("zmqlink: bind %s: %w", endpoint, err))
	}
	ep, err := sock.lastEndpoint()
	if err != nil {
		return fail(fmt.Errorf("zmqlink: last endpoint: %w", err))
	}
	in.endpoint = ep
	in.probe.bound(ep)
	return sock, nil
}

// The socket monitor that counts an Inbox's connections without Auth (with
// it, the handshake monitor does).
const disconnectMonitorEndpoint = "inproc://zmqlink.inbox.monitor"

// eventDisconnected is ZMQ_EVENT_DISCONNECTED (zmq.h).
const eventDisconnected = 0x0200

// monitorDisconnects has libzmq publish sock's accepted and ended
// connections on a PAIR socket, which the receive loop reads between
// messages.
func (in *Inbox) monitorDisconnects(ctx zContext, sock zSocket) (zSocket, error) {
	if err := sock.monitor(disconnectMonitorEndpoint, connEvents); err != nil {
		return nil, fmt.Errorf("zmqlink: monitor: %w", err)
	}
	mon, err := monitorSocket(ctx, disconnectMonitorEndpoint)
	if err != nil {
		return nil, fmt.Errorf("zmqlink: monitor: %w", err)
	}
	return mon, nil
}

// monitorQueue is how many events a monitor's reading end holds: a flood
// of connections publishes two each, and libzmq drops what does not fit.
const monitorQueue = 100_000

// monitorSocket connects the reading end of a socket monitor published on
// ep.
func monitorSocket(ctx zContext, ep string) (zSocket, error) {
	return innerSocket(ctx, kindPAIR, ep, false, monitorQueue)
}

// readDisconnects takes the events the monitor has published: each one's
// first frame is the event (16 bits) and its value (32 bits, here the
// connection's descriptor), in host byte order.
func (in *Inbox) readDisconnects(mon zSocket) {
	for {
		ev, err := mon.recv()
		if err != nil {
			return
		}
		if len(ev) > 0 && len(ev[0]) >= 6 {
			event := binary.NativeEndian.Uint16(ev[0])
			capped := in.conns.event(event, int32(binary.NativeEndian.Uint32(ev[0][2:])), time.Now())
			if event == eventDisconnected && !capped {
				in.disconnects.Add(1)
			}
		}
		mon.release()
	}
}

// loop polls and receives until Close; it returns the exit reason. Errors
// on one message never end it; only a terminated context does. mon, when
// not nil, is the disconnect monitor.
func (in *Inbox) loop(ctx zContext, sock, mon zSocket) string {
	socks := []zSocket{sock}
	if mon != nil {
		socks = append(socks, mon)
	}
	for {
		select {
		case <-in.closing:
			return "closed"
		default:
		}
		polled, err := ctx.poll(socks, false, in.opts.PollInterval)
		if err != nil {
			if isIntr(err) {
				continue
			}
			if isTerm(err) {
				return "context terminated: " + err.Error()
			}
			in.recvErrors.Add(1)
			in.noteError(err)
			continue
		}
		if polled == 0 {
			continue
		}
		if mon != nil {
			in.readDisconnects(mon)
		}
		for range in.opts.MaxBatch {
			frames, err := sock.recv()
			if err != nil {
				if isAgain(err) || isIntr(err) {
					break
				}
				if isTerm(err) {
					return "context terminated: " + err.Error()
				}
				in.recvErrors.Add(1)
				in.noteError(err)
				break
			}
			err = in.deliver(frames)
			sock.release() // the handler has returned: the frames die
			if errors.Is(err, ErrExitLoop) {
				return err.Error()
			}
		}
	}
}

// ErrExitLoop, returned (or wrapped) by a handler, ends the receive loop
// as if it had crashed: the socket closes, Alive turns false and the exit
// reason is the error's text. Only fault switches use it; a healthy handler
// never stops its loop.
var ErrExitLoop = errors.New("zmqlink: handler ended the receive loop")

func (in *Inbox) deliver(frames [][]byte) error {
	n := 0
	for _, f := range frames {
		n += len(f)
	}
	in.messages.Add(1)
	in.bytes.Add(uint64(n))
	in.lastMessage.Store(unixNano(time.Now()))
	err := in.call(frames)
	if err != nil {
		in.noteError(err)
	}
	return err
}

// call runs the handler, turning a panic into a counted error.
func (in *Inbox) call(frames [][]byte) (err error) {
	defer func() {
		if r := recover(); r != nil {
			in.handlerPanics.Add(1)
			err = fmt.Errorf("zmqlink: handler panic: %v", r)
		}
	}()
	if err := in.handler(frames); err != nil {
		in.handlerErrors.Add(1)
		return err
	}
	return nil
}

// CloneFrames returns a deep copy of frames, for a Handler that keeps a
// message past its return.
func CloneFrames(frames [][]byte) [][]byte {
	n := 0
	for _, f := range frames {
		n += len(f)
	}
	buf := make([]byte, 0, n)
	out := make([][]byte, len(frames))
	for i, f := range frames {
		buf = append(buf, f...)
		out[i] = buf[len(buf)-len(f) : len(buf) : len(buf)]
	}
	return out
}
