package zmqlink

import "time"

// The two socket backends. Inbox and Outbox drive ZeroMQ through these
// small interfaces, on their owner goroutine only: pebbe/zmq4 by default,
// the cgo shim (shim.go) when SocketOptions.ZeroCopy is set. Both speak
// the same ZMTP through the same libzmq, so a PUSH socket of one talks to
// a PULL socket of the other.

// sockKind is the socket type: PUSH or PULL, or REP and PAIR for an
// Inbox's ZAP handler and handshake monitor (auth.go).
type sockKind int

const (
	kindPUSH sockKind = iota
	kindPULL
	kindREP
	kindPAIR
)

// zContext is a ZeroMQ context of one backend. It and its sockets are used
// by one goroutine only.
type zContext interface {
	// socket creates a socket of kind k.
	socket(k sockKind) (zSocket, error)
	// poll waits up to d until one of socks is readable (out false) or
	// writable (out true); it returns how many are ready.
	poll(socks []zSocket, out bool, d time.Duration) (int, error)
	// term terminates the context; every socket must be closed first.
	// After it returns libzmq holds no message of the context any more.
	term() error
}

// zSocket is a socket of one backend.
type zSocket interface {
	setLinger(d time.Duration) error
	// setOpt sets one of the integer options optSndHWM ... optCurveServer.
	setOpt(o sockOpt, v int) error
	// setStrOpt sets one of the string options optZapDomain ... optCurveServerKey.
	setStrOpt(o sockOpt, v string) error
	bind(endpoint string) error
	connect(endpoint string) error
	lastEndpoint() (string, error)
	// monitor publishes the socket's events (a ZMQ_EVENT_* mask) on a PAIR
	// socket bound to the inproc endpoint ep.
	monitor(ep string, events int) error
	// send sends frames as one multipart message without waiting; EAGAIN
	// means nothing was sent (try again later). pin is the message's
	// pinning state across attempts (used by the shim only): the caller
	// releases *pin once the message is sent or dropped.
	send(frames [][]byte, pin **pinned) error
	// recv receives one multipart message without waiting (EAGAIN: none).
	// The frames are valid until release, which must be called before the
	// next recv or close.
	recv() ([][]byte, error)
	release()
	close() error
}

// sockOpt names the socket options the package sets: integers, then
// strings.
type sockOpt int

const (
	optSndHWM sockOpt = iota
	optRcvHWM
	optSndBuf
	optRcvBuf
	optMaxMsgSize   // ZMQ_MAXMSGSIZE, an int64 in libzmq
	optHandshakeIvl // ZMQ_HANDSHAKE_IVL, milliseconds
	optPlainServer
	optCurveServer

	optZapDomain
	optPlainUsername
	optPlainPassword
	optCurvePublicKey
	optCurveSecretKey
	optCurveServerKey
)

// newBackendContext makes a context of the backend o selects, with
// ioThreads I/O threads (0: libzmq's default). box receives the shim's
// released messages (nil for an Inbox, which sends nothing).
func newBackendContext(o SocketOptions, box *freeBox) (zContext, error) {
	if o.ZeroCopy {
		return newShimContext(o.IOThreads, box)
	}
	return newPebbeContext(o.IOThreads)
}
