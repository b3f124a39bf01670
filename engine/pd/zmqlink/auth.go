package zmqlink

import (
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// Connection authentication (SocketOptions.Auth): ZeroMQ's PLAIN mechanism,
// checked by a ZAP handler (RFC 27) that the Inbox runs in its own
// ZeroMQ context. libzmq asks the handler once per incoming connection,
// during the handshake, before any message of that connection reaches
// the socket; a refused connection is closed and none of its messages is
// ever delivered. Messages on an admitted connection cost nothing more.

// PlainAuth is the credential of ZeroMQ's PLAIN mechanism. An Inbox with
// it admits only peers that present exactly this username and password;
// an Outbox with it presents them to every peer. Both are at most 255
// bytes and not empty.
type PlainAuth struct {
	Username, Password string
}

func (a *PlainAuth) validate() error {
	if a.Username == "" || a.Password == "" {
		return errors.New("zmqlink: auth: empty username or password")
	}
	if len(a.Username) > 255 || len(a.Password) > 255 {
		return errors.New("zmqlink: auth: username or password over 255 bytes")
	}
	return nil
}

// zapDomain is the ZAP domain of authenticated Inboxes.
const zapDomain = "pdkit"

// zapEndpoint is where libzmq sends its ZAP requests, in the same context.
const zapEndpoint = "inproc://zeromq.zap.01"

// applyAuth makes s a PLAIN server (server: an Inbox's socket) or client
// (an Outbox's) with a fixed or a rotating credential, or a CURVE one. No
// credential: NULL.
func (o SocketOptions) applyAuth(s zSocket, server bool) error {
	var err error
	switch {
	case (o.Auth != nil || o.Rotating != nil) && server: // ZAP checks either credential
		err = setOpts(s, []sockOpt{optZapDomain}, []string{zapDomain})
		if err == nil {
			err = s.setOpt(optPlainServer, 1)
		}
		if err == nil {
			err = s.monitor(monitorEndpoint, authEvents)
		}
	case o.Auth != nil:
		err = setOpts(s, []sockOpt{optPlainUsername, optPlainPassword}, []string{o.Auth.Username, o.Auth.Password})
	case o.Rotating != nil:
		user, pass := o.Rotating.Credential(time.Now())
		err = setOpts(s, []sockOpt{optPlainUsername, optPlainPassword}, []string{user, pass})
	case o.Curve != nil:
		err = o.Curve.apply(s, server)
	}
	if err != nil {
		return fmt.Errorf("zmqlink: auth: %w", err)
	}
	return nil
}

// setOpts sets string options in order.
func setOpts(s zSocket, opts []sockOpt, vals []string) error {
	for i, o := range opts {
		if err := s.setStrOpt(o, vals[i]); err != nil {
			return err
		}
	}
	return nil
}

// authStats counts an Inbox's refused and admitted connections.
type authStats struct {
	admitted        atomic.Uint64
	denied          atomic.Uint64
	handshakeErrors atomic.Uint64
	lastDenied      atomic.Pointer[string] // why, and the peer's address if known
	disconnects     atomic.Uint64          // the Inbox's Disconnects, while this monitor holds its socket's
}

func (st *authStats) fill(s *InboxStats) {
	s.AuthAdmitted = st.admitted.Load()
	s.AuthDenied = st.denied.Load()
	s.HandshakeErrors = st.handshakeErrors.Load()
	s.Disconnects += st.disconnects.Load()
	if p := st.lastDenied.Load(); p != nil {
		s.LastAuthDenied = *p
	}
}

func (st *authStats) deny(why string) {
	st.denied.Add(1)
	st.lastDenied.Store(&why)
}

// admitFunc decides one ZAP request from its mechanism and credential
// frames.
type admitFunc func(mechanism string, creds [][]byte) bool

// admitPlain admits the PLAIN credential a, comparing in constant time.
func admitPlain(a PlainAuth) admitFunc {
	user, pass := []byte(a.Username), []byte(a.Password)
	return func(mech string, creds [][]byte) bool {
		if mech != "PLAIN" || len(creds) != 2 {
			return false
		}
		ok := subtle.ConstantTimeCompare(creds[0], user) & subtle.ConstantTimeCompare(creds[1], pass)
		return ok == 1
	}
}

// RotatingAuth is PLAIN with a credential that changes with time
// (SocketOptions.Rotating), for the KV sockets: a credential sniffed on
// the wire is good for a bounded time only, without the cost of CURVE on
// every KV byte. An Outbox's socket presents Credential(now) when it is
// made, and is made anew with a fresh one once it is older than Rotate and
// quiet (see sender.peer); an Inbox admits what Admit says.
type RotatingAuth struct {
	// Credential is the PLAIN username and password to present at now.
	Credential func(now time.Time) (user, password string)
	// Admit says whether a peer presenting user and password at now is
	// admitted; it must take every credential Credential gave within
	// Rotate plus a reconnect's margin before now.
	Admit func(user, password []byte, now time.Time) bool
	// Rotate is how long an Outbox's socket keeps its credential, and
	// Quiet how long a peer must have had no message before its socket is
	// made anew (default DefaultRotateQuiet): what the old socket still
	// held has left by then, so that the new one cannot overtake it.
	Rotate, Quiet time.Duration
}

// DefaultRotateQuiet is RotatingAuth.Quiet's default.
const DefaultRotateQuiet = time.Second

func (a *RotatingAuth) validate() error {
	if a.Credential == nil || a.Admit == nil || a.Rotate <= 0 {
		return errors.New("zmqlink: auth: a rotating credential needs Credential, Admit and a positive Rotate")
	}
	return nil
}

// admitRotating admits PLAIN peers whose credential a admits now.
func admitRotating(a *RotatingAuth) admitFunc {
	return func(mech string, creds [][]byte) bool {
		return mech == "PLAIN" && len(creds) == 2 && a.Admit(creds[0], creds[1], time.Now())
	}
}

// monitorEndpoint is where an authenticating socket publishes its failed
// handshakes, in its own context.
const monitorEndpoint = "inproc://zmqlink.auth.monitor"

// libzmq's monitor events and protocol errors that the monitor reads
// (zmq.h; stable since libzmq 4.3).
const (
	eventHandshakeFailedNoDetail = 0x0800
	eventHandshakeFailedProtocol = 0x2000
	authEvents                   = eventHandshakeFailedNoDetail | eventHandshakeFailedProtocol | connEvents
	protoErrCryptographic        = 0x11000001
	protoErrMechanismMismatch    = 0x11000002
)

// authHandler is an Inbox's authentication: a REP socket bound to
// zapEndpoint answers libzmq's ZAP request for every connection that
// presents a credential, and a PAIR socket reads the failed handshakes
// of the Inbox's socket (monitorEndpoint), which is how a peer that
// presents no credential, or one of another mechanism, is counted: libzmq
// refuses it before asking ZAP. Both sockets belong to one goroutine, from
// startAuthHandler until stop, which must come before the context's term.
type authHandler struct {
	ctx   zContext
	zap   zSocket
	mon   zSocket
	admit admitFunc
	stats *authStats
	conns *connCap
	// endedEarly: the last event was a handshake that failed with no
	// detail, to be counted at the hang-up that follows it.
	endedEarly bool
	poll       time.Duration
	closing    chan struct{}
	done       chan struct{}
}

// startAuthHandler binds the ZAP handler of ctx, connects the monitor
// and starts their goroutine. It must run before the Inbox's socket binds.
func startAuthHandler(ctx zContext, admit admitFunc, stats *authStats, conns *connCap, poll time.Duration) (*authHandler, error) {
	h := &authHandler{ctx: ctx, admit: admit, stats: stats, conns: conns, poll: poll,
		closing: make(chan struct{}), done: make(chan struct{})}
	var err error
	if h.zap, err = innerSocket(ctx, kindREP, zapEndpoint, true, 0); err != nil {
		return nil, fmt.Errorf("zmqlink: zap handler: %w", err)
	}
	if h.mon, err = monitorSocket(ctx, monitorEndpoint); err != nil {
		h.zap.close()
		return nil, fmt.Errorf("zmqlink: auth monitor: %w", err)
	}
	go h.run()
	return h, nil
}

// innerSocket makes an inproc socket of kind k, bound to or connected to ep,
// that queues at most rcvHWM incoming messages (0: libzmq's default).
func innerSocket(ctx zContext, k sockKind, ep string, bind bool, rcvHWM int) (zSocket, error) {
	s, err := ctx.socket(k)
	if err != nil {
		return nil, err
	}
	err = s.setLinger(0)
	if err == nil && rcvHWM > 0 {
		err = s.setOpt(optRcvHWM, rcvHWM)
	}
	if err == nil && bind {
		err = s.bind(ep)
	} else if err == nil {
		err = s.connect(ep)
	}
	if err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// stop ends the goroutine and waits for it to close its sockets.
func (h *authHandler) stop() {
	close(h.closing)
	<-h.done
}

func (h *authHandler) run() {
	defer close(h.done)
	defer h.mon.close()
	defer h.zap.close()
	socks := []zSocket{h.zap, h.mon}
	for {
		select {
		case <-h.closing:
			return
		default:
		}
		n, err := h.ctx.poll(socks, false, h.poll)
		if isTerm(err) {
			return
		}
		if err != nil || n == 0 {
			continue
		}
		// Events first: a connection's accept is published before its
		// ZAP request is sent, so one the connection cap shuts is shut
		// before its handshake is answered, and nothing of it is delivered.
		if !h.readEvents() || !h.serveZAP() {
			return
		}
	}
}

// serveZAP answers one ZAP request, if there is one; false when the
// context is terminated.
func (h *authHandler) serveZAP() bool {
	req, err := h.zap.recv()
	if err != nil {
		return !isTerm(err)
	}
	reply := h.decide(req)
	h.zap.release()
	var pin *pinned
	err = h.zap.send(reply, &pin)
	if pin != nil {
		pin.release()
	}
	return !isTerm(err)
}

// decide makes the reply to one ZAP request: version, request id,
// domain, address, identity, mechanism, then the mechanism's credentials.
// The reply's frames are fresh: the request's are lent.
func (h *authHandler) decide(req [][]byte) [][]byte {
	var id []byte
	if len(req) > 1 {
		id = append([]byte{}, req[1]...)
	}
	ok := len(req) >= 6 && string(req[0]) == "1.0" && string(req[2]) == zapDomain &&
		h.admit(string(req[5]), req[6:])
	if ok {
		h.stats.admitted.Add(1)
		return zapReply(id, "200", "OK")
	}
	addr := "unknown"
	if len(req) > 3 {
		addr = string(req[3])
	}
	h.stats.deny("credentials refused: " + addr)
	return zapReply(id, "400", "credentials refused")
}

func zapReply(id []byte, code, text string) [][]byte {
	return [][]byte{[]byte("1.0"), id, []byte(code), []byte(text), {}, {}}
}

// readEvents counts the failed handshakes the monitor has published; false
// when the context is terminated.
func (h *authHandler) readEvents() bool {
	for {
		ev, err := h.mon.recv()
		if err != nil {
			return !isTerm(err)
		}
		h.countEvent(ev)
		h.mon.release()
	}
}

// countEvent counts one monitor event: its first frame is the event (16
// bits) and its value (32 bits), in host byte order. A peer with no
// credential fails in one of two ways, by a race between the two ends:
// the Inbox sees its greeting name another mechanism, or the peer, which
// saw the Inbox's greeting first, hangs up (a handshake failed with no
// detail, which a port scan also gives). Both are refusals. So is a
// connection that ends before it authenticates, unless the connection cap
// shut it: libzmq publishes that handshake failure (whose value is an
// errno, not the descriptor) just before the same connection's hang-up,
// so it is judged at the hang-up.
func (h *authHandler) countEvent(ev [][]byte) {
	if len(ev) == 0 || len(ev[0]) < 6 {
		return
	}
	event, value := binary.NativeEndian.Uint16(ev[0]), binary.NativeEndian.Uint32(ev[0][2:])
	capped := h.conns.event(event, int32(value), time.Now())
	switch {
	case event == eventDisconnected:
		if !capped {
			h.stats.disconnects.Add(1)
			if h.endedEarly {
				h.stats.deny("connection ended before it authenticated")
			}
		}
		h.endedEarly = false
	case event == eventHandshakeFailedNoDetail:
		h.endedEarly = true
	case event != eventHandshakeFailedProtocol:
	case value == protoErrMechanismMismatch:
		h.stats.deny("no credential, or another security mechanism")
	case value == protoErrCryptographic:
		h.stats.deny("cryptographic failure")
	default:
		h.stats.handshakeErrors.Add(1)
	}
}
