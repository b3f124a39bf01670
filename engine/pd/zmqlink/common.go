package zmqlink

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// ErrClosed is returned by operations on a closed Inbox or Outbox.
var ErrClosed = errors.New("zmqlink: closed")

// ErrQueueFull is returned by Outbox.Send when the send queue stayed full
// until the caller's context ended.
var ErrQueueFull = errors.New("zmqlink: send queue full")

// ErrCloseTimeout is returned by Close when the owner goroutine did not
// finish within the close timeout (for an Inbox: a handler that does not
// return).
var ErrCloseTimeout = errors.New("zmqlink: close timed out")

// bindAddress turns "tcp://host:0" into ZeroMQ's wildcard port form
// "tcp://host:*"; any other endpoint is returned unchanged.
func bindAddress(endpoint string) string {
	if strings.HasPrefix(endpoint, "tcp://") && strings.HasSuffix(endpoint, ":0") {
		return strings.TrimSuffix(endpoint, "0") + "*"
	}
	return endpoint
}

// isErrno reports whether err is errno e, from either backend.
func isErrno(err error, e syscall.Errno) bool {
	var z zErr
	if errors.As(err, &z) {
		return syscall.Errno(z) == e
	}
	var pz zmq.Errno
	if errors.As(err, &pz) {
		return syscall.Errno(pz) == e
	}
	var se syscall.Errno
	return errors.As(err, &se) && se == e
}

func isAgain(err error) bool { return isErrno(err, syscall.EAGAIN) }

func isTerm(err error) bool { return isErrno(err, syscall.Errno(errTerm)) }

func isIntr(err error) bool { return isErrno(err, syscall.EINTR) }

// newContext makes a ZeroMQ context of the backend o selects, with
// o.IOThreads I/O threads (0: libzmq's default).
func newContext(o SocketOptions, box *freeBox) (zContext, error) {
	if err := o.validateAuth(); err != nil {
		return nil, err
	}
	ctx, err := newBackendContext(o, box)
	if err != nil {
		return nil, fmt.Errorf("zmqlink: new context: %w", err)
	}
	return ctx, nil
}

// SocketOptions are the per-socket ZeroMQ options the package sets. Zero
// values keep libzmq's defaults unless noted.
type SocketOptions struct {
	// HWM is the high-water mark in messages (SNDHWM for an Outbox peer,
	// RCVHWM for an Inbox). 0 means the package default (see the types).
	HWM int
	// SndBuf and RcvBuf are the kernel socket buffer sizes in bytes
	// (SO_SNDBUF / SO_RCVBUF). 0 keeps the OS default.
	SndBuf, RcvBuf int
	// IOThreads is the number of libzmq I/O threads of the context.
	IOThreads int
	// ZeroCopy selects the backend. False (the default) uses pebbe/zmq4,
	// which copies every frame on send and on receive: right for control
	// messages. True uses the package's cgo shim over libzmq, which sends
	// frames of 32 KiB or more without a copy (they stay pinned until
	// libzmq has written them out) and lends received frames straight from
	// libzmq's buffers: for the KV data path. Both backends speak the same
	// ZMTP, so either end may use either, and both keep one contract: a
	// Handler's frames are valid only until it returns, and an Outbox owns
	// the frames given to Send.
	ZeroCopy bool
	// Auth turns on connection authentication (auth.go), nil leaves it
	// off: an Inbox admits only peers that present exactly this PLAIN
	// credential, checked once per connection by a ZAP handler, and
	// counts the refused ones (InboxStats.AuthDenied); an Outbox presents
	// it to every peer. Either backend may talk to the other with it.
	Auth *PlainAuth
	// Rotating is PLAIN with a credential that changes with time (the KV
	// sockets), Curve the CURVE mechanism (the control sockets); at most
	// one of Auth, Rotating and Curve is set.
	Rotating *RotatingAuth
	Curve    *CurveKeys
}

// validateAuth checks that at most one mechanism is set, and its
// credential.
func (o SocketOptions) validateAuth() error {
	n := 0
	for _, set := range []bool{o.Auth != nil, o.Rotating != nil, o.Curve != nil} {
		if set {
			n++
		}
	}
	switch {
	case n > 1:
		return errors.New("zmqlink: auth: more than one of Auth, Rotating and Curve")
	case o.Auth != nil:
		return o.Auth.validate()
	case o.Rotating != nil:
		return o.Rotating.validate()
	case o.Curve != nil:
		return o.Curve.validate()
	}
	return nil
}

// apply sets o's options on s, an Outbox's socket (outbox: HWM is the
// send high-water mark, and s presents o's credential) or an Inbox's.
func (o SocketOptions) apply(s zSocket, outbox bool) error {
	if err := o.applyAuth(s, !outbox); err != nil {
		return err
	}
	if o.HWM > 0 {
		var err error
		if outbox {
			err = s.setOpt(optSndHWM, o.HWM)
		} else {
			err = s.setOpt(optRcvHWM, o.HWM)
		}
		if err != nil {
			return fmt.Errorf("zmqlink: hwm: %w", err)
		}
	}
	if o.SndBuf > 0 {
		if err := s.setOpt(optSndBuf, o.SndBuf); err != nil {
			return fmt.Errorf("zmqlink: sndbuf: %w", err)
		}
	}
	if o.RcvBuf > 0 {
		if err := s.setOpt(optRcvBuf, o.RcvBuf); err != nil {
			return fmt.Errorf("zmqlink: rcvbuf: %w", err)
		}
	}
	return nil
}

func unixNano(t time.Time) int64 { return t.UnixNano() }

func fromUnixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// stopOwner closes closing, which tells an owner goroutine to stop, and
// waits at most d for it to close done.
func stopOwner(closing chan struct{}, done <-chan struct{}, d time.Duration) error {
	close(closing)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
		return ErrCloseTimeout
	}
}
