package zmtp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// DefaultHandshakeTimeout bounds a handshake whose context has no earlier
// deadline.
const DefaultHandshakeTimeout = 5 * time.Second

// Push is a PUSH socket connected to one PULL peer. It is not safe for
// concurrent use.
type Push struct {
	zc *conn
}

// Dial connects to the PULL socket at endpoint (tcp://host:port) and
// completes the handshake, within ctx and DefaultHandshakeTimeout.
func Dial(ctx context.Context, endpoint string) (*Push, error) {
	return DialAuth(ctx, endpoint, nil)
}

// DialAuth is Dial presenting auth with the PLAIN mechanism, as an
// authenticated PD socket requires; nil auth is Dial. A peer that refuses
// the credential gives an error matching ErrAuthRefused; a peer that
// requires PLAIN when auth is nil, or NULL when it is not, one matching
// ErrAuthRequired.
func DialAuth(ctx context.Context, endpoint string, auth *PlainAuth) (*Push, error) {
	if auth != nil {
		if err := auth.validate(); err != nil {
			return nil, err
		}
	}
	return dial(ctx, endpoint, auth, nil)
}

// DialCurve is Dial as a CURVE client with curve's keys, as a pdkit
// control socket with a cluster secret requires: every frame is encrypted
// and authenticated. A server that does not open with curve.ServerPublic,
// or refuses the client key, gives an error matching ErrAuthRefused; one
// that speaks another mechanism, one matching ErrAuthRequired.
func DialCurve(ctx context.Context, endpoint string, curve *CurveAuth) (*Push, error) {
	if curve == nil {
		return nil, errors.New("zmtp: DialCurve without keys")
	}
	return dial(ctx, endpoint, nil, curve)
}

func dial(ctx context.Context, endpoint string, auth *PlainAuth, curve *CurveAuth) (*Push, error) {
	addr, err := tcpAddress(endpoint)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultHandshakeTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("zmtp: connecting to %s: %w", endpoint, err)
	}
	return newPush(ctx, c, auth, curve)
}

// newPush runs the PUSH side's handshake on c (closed on failure).
func newPush(ctx context.Context, c net.Conn, auth *PlainAuth, curve *CurveAuth) (*Push, error) {
	deadline, _ := ctx.Deadline()
	if deadline.IsZero() {
		deadline = time.Now().Add(DefaultHandshakeTimeout)
	}
	zc, err := handshake(c, TypePUSH, false, auth, curve, deadline)
	if err != nil {
		c.Close()
		return nil, err
	}
	return &Push{zc: zc}, nil
}

// Send writes frames as one multipart message; a nil error means the
// message was handed to the connection, not that the peer received it.
func (p *Push) Send(ctx context.Context, frames [][]byte) error {
	deadline, _ := ctx.Deadline()
	if err := p.zc.c.SetWriteDeadline(deadline); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { p.zc.c.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := p.zc.writeMessage(frames); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("zmtp: sending: %w", err)
	}
	return nil
}

// Close closes the connection. What was sent is still delivered: the peer
// reads it before it sees the end of the connection.
func (p *Push) Close() error { return p.zc.c.Close() }

// Send dials the PULL socket at endpoint, sends frames as one multipart
// message and closes the connection.
func Send(ctx context.Context, endpoint string, frames [][]byte) error {
	return SendAuth(ctx, endpoint, nil, frames)
}

// SendAuth is Send presenting auth (DialAuth).
func SendAuth(ctx context.Context, endpoint string, auth *PlainAuth, frames [][]byte) error {
	p, err := DialAuth(ctx, endpoint, auth)
	if err != nil {
		return err
	}
	defer p.Close()
	return p.Send(ctx, frames)
}

// ErrClosed is returned by Recv once the Pull is closed.
var ErrClosed = errors.New("zmtp: socket closed")

// Pull is a PULL socket bound to a TCP port: every PUSH peer that connects
// is read by a goroutine of its own, and Recv hands out their messages one
// at a time (in order per peer). A peer that breaks the protocol is
// disconnected; its error is kept for Errors. Safe for concurrent use.
type Pull struct {
	ln       net.Listener
	endpoint string
	auth     *PlainAuth // nil: the NULL mechanism
	msgs     chan [][]byte
	closing  chan struct{}
	wg       sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]bool
	errs  []error
}

// Listen binds a PULL socket to endpoint, tcp://host:port; port 0 picks a
// free port, and Endpoint reports the one bound.
func Listen(endpoint string) (*Pull, error) {
	return ListenAuth(endpoint, nil)
}

// ListenAuth is Listen admitting only peers that present auth with the
// PLAIN mechanism (as an authenticated PD socket does); nil auth is
// Listen. A refused peer's error, in Errors, matches ErrAuthRefused or
// ErrAuthRequired.
func ListenAuth(endpoint string, auth *PlainAuth) (*Pull, error) {
	if auth != nil {
		if err := auth.validate(); err != nil {
			return nil, err
		}
		a := *auth
		auth = &a
	}
	addr, err := tcpAddress(endpoint)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("zmtp: binding %s: %w", endpoint, err)
	}
	p := &Pull{ln: ln, endpoint: "tcp://" + ln.Addr().String(), auth: auth, msgs: make(chan [][]byte, 64),
		closing: make(chan struct{}), conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Endpoint is the bound endpoint, e.g. tcp://127.0.0.1:41003.
func (p *Pull) Endpoint() string { return p.endpoint }

func (p *Pull) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.mu.Lock()
		select {
		case <-p.closing:
			p.mu.Unlock()
			c.Close()
			return
		default:
		}
		p.conns[c] = true
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(c)
	}
}

// serve reads one peer's messages until it goes away or errs.
func (p *Pull) serve(c net.Conn) {
	defer p.wg.Done()
	defer func() {
		c.Close()
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
	}()
	zc, err := handshake(c, TypePULL, true, p.auth, nil, time.Now().Add(DefaultHandshakeTimeout))
	if err != nil {
		p.noteError(err)
		return
	}
	for {
		m, err := zc.readMessage()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) {
				p.noteError(err)
			}
			return
		}
		select {
		case p.msgs <- m:
		case <-p.closing:
			return
		}
	}
}

func (p *Pull) noteError(err error) {
	select {
	case <-p.closing:
		return
	default:
	}
	p.mu.Lock()
	if len(p.errs) < 16 {
		p.errs = append(p.errs, err)
	}
	p.mu.Unlock()
}

// Errors returns the errors that ended peers' connections (at most 16):
// refused handshakes and protocol violations.
func (p *Pull) Errors() []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]error(nil), p.errs...)
}

// Recv returns the next multipart message of any peer, ctx's error when
// it ends first, or ErrClosed.
func (p *Pull) Recv(ctx context.Context) ([][]byte, error) {
	select {
	case m := <-p.msgs:
		return m, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-p.closing:
		return nil, ErrClosed
	}
}

// Close stops listening, disconnects every peer and waits for their
// goroutines.
func (p *Pull) Close() error {
	p.mu.Lock()
	select {
	case <-p.closing:
		p.mu.Unlock()
		return nil
	default:
	}
	close(p.closing)
	err := p.ln.Close()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return err
}
