// Package zmtp is a minimal, pure-Go ZeroMQ peer: exactly what pdctl needs
// to speak to the PD sockets of a pdkit cluster without cgo. It implements
// ZMTP 3.0 (https://rfc.zeromq.org/spec/23/) over TCP with the NULL and
// PLAIN security mechanisms, and CURVE as a client (curve.go: DialCurve,
// what a pdkit control socket with a cluster secret requires), for two
// socket types only:
//
//   - a PUSH socket that dials one PULL peer and sends multipart messages
//     (Dial, DialAuth, Push.Send), as a decode rank does to a prefill
//     rank's control socket;
//   - a PULL socket that binds a TCP port, accepts any number of PUSH peers
//     and hands their multipart messages out one at a time (Listen,
//     ListenAuth, Pull.Recv), as a decode rank's KV socket does.
//
// The greeting (signature 0xFF 00*8 0x7F, version 3.0, the mechanism,
// as-server flag) is sent as libzmq sends it, the mechanism only once the
// peer's signature is in, so that a libzmq peer that refuses the
// mechanism has said which one it wanted. With NULL (no credential) the
// READY commands (Socket-Type, an empty Identity) follow. With PLAIN
// (a PlainAuth; https://rfc.zeromq.org/spec/24/) the dialing side
// presents a username and password in HELLO, the accepting side answers
// WELCOME or ERROR, then INITIATE and READY carry the metadata; this is
// what a pdkit Inbox with zmqlink's SocketOptions.Auth requires. The
// password crosses the wire in the clear. Data and command frames use
// the MORE, LONG and COMMAND flags.
//
// Anything else (another major version, another mechanism, an
// incompatible socket type, an ERROR command, an unknown command, a reserved
// flag bit, a frame over the size limit) ends the connection with an error
// that says what was refused; a mechanism the two ends disagree on matches
// ErrAuthRequired, a refused credential ErrAuthRefused. PING is answered
// with PONG; no other socket type, transport or option is implemented.
package zmtp

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// Socket types this package speaks.
const (
	TypePUSH = "PUSH"
	TypePULL = "PULL"
)

// MaxFrame bounds one frame, MaxMessage one multipart message that a Pull
// accepts; larger ones end the connection.
const (
	MaxFrame   = 64 << 20
	MaxMessage = 256 << 20
)

// Frame flags.
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

const greetingLen = 64

// ErrProtocol is matched (errors.Is) by every error about what a peer sent.
var ErrProtocol = errors.New("zmtp: protocol error")

// protoError is a refused greeting, handshake or frame.
type protoError struct{ msg string }

func (e *protoError) Error() string        { return "zmtp: " + e.msg }
func (e *protoError) Is(target error) bool { return target == ErrProtocol }

func protof(format string, a ...any) error { return &protoError{msg: fmt.Sprintf(format, a...)} }

// Security mechanisms.
const (
	mechNULL  = "NULL"
	mechPLAIN = "PLAIN"
)

// greeting returns this side's 64-byte greeting for mechanism mech.
func greeting(mech string, asServer bool) []byte {
	g := make([]byte, greetingLen)
	g[0], g[9] = 0xFF, 0x7F
	g[10], g[11] = 3, 0 // version 3.0
	copy(g[12:32], mech)
	if asServer {
		g[32] = 1
	}
	return g
}

// checkGreeting validates a peer's greeting, which must name mechanism
// mech.
func checkGreeting(g []byte, mech string) error {
	if g[0] != 0xFF || g[9]&1 != 1 {
		return protof("not a ZMTP 3 greeting: signature % x", g[:10])
	}
	if g[10] < 3 {
		return protof("peer speaks ZMTP %d.%d, only 3.x is supported", g[10], g[11])
	}
	peer := string(bytes.TrimRight(g[12:32], "\x00"))
	switch {
	case peer == mech:
		return nil
	case peer == mechPLAIN && mech == mechNULL:
		return &authError{ErrAuthRequired, "the peer requires the PLAIN mechanism: connect with credentials (a PlainAuth)"}
	case peer == mechNULL && mech == mechPLAIN:
		return &authError{ErrAuthRequired, "the peer speaks NULL, without authentication, and this side requires PLAIN"}
	case peer == mechCURVE && mech != mechCURVE:
		return &authError{ErrAuthRequired, "the peer requires the CURVE mechanism: connect with CURVE keys (a CurveAuth, which pdctl derives from the cluster secret)"}
	case mech == mechCURVE:
		return &authError{ErrAuthRequired, fmt.Sprintf("the peer speaks %s, and this side requires CURVE", peer)}
	}
	return protof("peer asks for security mechanism %q, only NULL, PLAIN and CURVE (as a client) are supported", peer)
}

// compatible says whether a socket of type mine may talk to one of type peer.
func compatible(mine, peer string) bool {
	return mine == TypePUSH && peer == TypePULL || mine == TypePULL && peer == TypePUSH
}

// conn is one ZMTP connection after or during its handshake.
type conn struct {
	c     net.Conn
	r     *bufio.Reader
	wb    []byte      // frame header buffer
	curve *curveState // the CURVE session, nil under NULL and PLAIN
}

// command encodes a command frame's body: the name, then properties.
func command(name string, props ...[2]string) []byte {
	b := []byte{byte(len(name))}
	b = append(b, name...)
	for _, p := range props {
		b = append(b, byte(len(p[0])))
		b = append(b, p[0]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(p[1])))
		b = append(b, p[1]...)
	}
	return b
}

// appendFrame appends one frame (header and body) to b.
func appendFrame(b []byte, flags byte, body []byte) []byte {
	if len(body) > 255 {
		b = append(b, flags|flagLong)
		b = binary.BigEndian.AppendUint64(b, uint64(len(body)))
	} else {
		b = append(b, flags, byte(len(body)))
	}
	return append(b, body...)
}

// handshake exchanges greetings and READY commands as a socket of type
// mine, by deadline; with auth, it runs the PLAIN mechanism instead
// (plain.go), with curve (a client only) CURVE (curve.go).
func handshake(c net.Conn, mine string, asServer bool, auth *PlainAuth, curve *CurveAuth, deadline time.Time) (*conn, error) {
	if err := c.SetDeadline(deadline); err != nil {
		return nil, err
	}
	zc := &conn{c: c, r: bufio.NewReaderSize(c, 64<<10)}
	mech, after := mechNULL, appendFrame(nil, flagCommand, metadata("READY", mine))
	switch {
	case curve != nil:
		mech, after = mechCURVE, nil
	case auth != nil:
		mech, after = mechPLAIN, nil
	}
	_, werr, err := zc.greet(mech, asServer, after)
	if err != nil {
		return nil, err
	}
	switch {
	case curve != nil:
		err = zc.curveClient(mine, curve, werr)
	case auth != nil:
		err = zc.plainHandshake(mine, asServer, auth, werr)
	default:
		err = zc.readReady(mine)
	}
	if err != nil {
		c.Close() // unblocks the writer
		<-werr
		return nil, err
	}
	if err := <-werr; err != nil {
		return nil, fmt.Errorf("zmtp: sending the greeting: %w", err)
	}
	// A peer gone already is reported by the next read or write, after
	// what it sent is read.
	_ = c.SetDeadline(time.Time{})
	return zc, nil
}

// greetingHead is the part of a greeting sent before the peer's is read:
// the signature and the major version.
const greetingHead = 11

// greet writes this side's greeting for mech, then after, while it reads
// the peer's greeting, which it returns, with the channel that tells how
// the writing ended. It sends the mechanism only once the peer's head is
// in, as libzmq does: libzmq sends its own mechanism only then, and a
// libzmq peer that refuses ours hangs up at once, so a side that sent its
// whole greeting first would never learn which mechanism the peer wanted.
// The writing runs beside the reading, so that an unbuffered connection
// (net.Pipe) cannot deadlock. On error the connection is closed.
func (zc *conn) greet(mech string, asServer bool, after []byte) ([]byte, <-chan error, error) {
	mine := greeting(mech, asServer)
	headIn := make(chan bool, 1) // true: the peer's head is in, go on
	werr := make(chan error, 1)
	go func() {
		_, err := zc.c.Write(mine[:greetingHead])
		if err == nil && <-headIn {
			_, err = zc.c.Write(append(mine[greetingHead:], after...))
		}
		werr <- err
		close(werr) // later receives see nil: the outcome is taken once
	}()
	g, err := zc.readGreeting(mech, headIn)
	if err != nil {
		var ae *authError
		if errors.As(err, &ae) {
			// Let this side's mechanism out, so the peer can say why.
			_ = zc.c.SetWriteDeadline(time.Now().Add(greetingLinger))
			<-werr
		}
		zc.c.Close() // unblocks the writer
		<-werr
		return nil, nil, err
	}
	return g, werr, nil
}

// greetingLinger bounds how long a refused greeting waits for this side's
// own to be written out.
const greetingLinger = 100 * time.Millisecond

func (zc *conn) readReady(mine string) error {
	props, err := zc.readCommand("READY")
	if err != nil {
		return err
	}
	return checkSocketType(mine, "READY", props)
}

// readGreeting reads the peer's greeting, which must name mechanism mech.
// Once its head is in and valid it sends true on headIn (false if not).
func (zc *conn) readGreeting(mech string, headIn chan<- bool) ([]byte, error) {
	g := make([]byte, greetingLen)
	if err := zc.readGreetingHead(g); err != nil {
		headIn <- false
		return nil, err
	}
	headIn <- true
	if _, err := io.ReadFull(zc.r, g[greetingHead:]); err != nil {
		return nil, fmt.Errorf("zmtp: reading the greeting: %w", err)
	}
	return g, checkGreeting(g, mech)
}

// readGreetingHead reads the signature, which it checks, and the major
// version.
func (zc *conn) readGreetingHead(g []byte) error {
	if _, err := io.ReadFull(zc.r, g[:10]); err != nil {
		return fmt.Errorf("zmtp: reading the greeting: %w", err)
	}
	if g[0] != 0xFF || g[9]&1 != 1 {
		return protof("not a ZMTP 3 greeting: signature % x", g[:10])
	}
	if _, err := io.ReadFull(zc.r, g[10:greetingHead]); err != nil {
		return fmt.Errorf("zmtp: reading the greeting: %w", err)
	}
	return nil
}

// readCommand reads one command frame, which must be want (an ERROR is
// the peer refusing the handshake), and returns its properties.
func (zc *conn) readCommand(want string) (map[string]string, error) {
	flags, body, err := zc.readFrame()
	if err != nil {
		return nil, err
	}
	if flags&flagCommand == 0 {
		return nil, protof("expected the %s command, got a data frame", want)
	}
	name, props, err := parseCommand(body)
	if err != nil {
		return nil, err
	}
	switch name {
	case want:
		return props, nil
	case "ERROR":
		return nil, &handshakeRefused{reason: errorReason(body), after: want}
	}
	return nil, protof("expected the %s command, got %q", want, name)
}

// checkSocketType checks the Socket-Type property of the peer's command
// cmd against mine.
func checkSocketType(mine, cmd string, props map[string]string) error {
	st, ok := props["socket-type"]
	if !ok {
		return protof("%s without a Socket-Type property", cmd)
	}
	if !compatible(mine, st) {
		return protof("peer is a %s socket, a %s socket only talks to %s", st, mine, map[string]string{TypePUSH: TypePULL, TypePULL: TypePUSH}[mine])
	}
	return nil
}

// errorReason is an ERROR command's reason.
func errorReason(body []byte) string {
	n := int(body[0])
	rest := body[1+n:]
	if len(rest) < 1 || len(rest) < 1+int(rest[0]) {
		return "(no reason)"
	}
	return string(rest[1 : 1+int(rest[0])])
}

// parseCommand splits a command body into its name and its properties
// (names lower-cased: they are case-insensitive). A body that is not a
// well-formed command, or whose properties do not parse (READY,
// INITIATE), is an error.
func parseCommand(body []byte) (string, map[string]string, error) {
	if len(body) < 1 || len(body) < 1+int(body[0]) {
		return "", nil, protof("command frame too short for its name")
	}
	name := string(body[1 : 1+int(body[0])])
	if name != "READY" && name != "INITIATE" {
		return name, nil, nil
	}
	props := map[string]string{}
	p := body[1+int(body[0]):]
	for len(p) > 0 {
		n := int(p[0])
		if n == 0 || len(p) < 1+n+4 {
			return "", nil, protof("%s property cut short", name)
		}
		key := strings.ToLower(string(p[1 : 1+n]))
		p = p[1+n:]
		vl := binary.BigEndian.Uint32(p)
		p = p[4:]
		if uint64(vl) > uint64(len(p)) {
			return "", nil, protof("%s property %q: value of %d bytes, %d left", name, key, vl, len(p))
		}
		props[key] = string(p[:vl])
		p = p[vl:]
	}
	return name, props, nil
}

// readFrame reads one frame: its flags and body.
func (zc *conn) readFrame() (byte, []byte, error) {
	flags, err := zc.r.ReadByte()
	if err != nil {
		return 0, nil, err
	}
	if flags&^(flagMore|flagLong|flagCommand) != 0 {
		return 0, nil, protof("frame flags %#02x: reserved bits set", flags)
	}
	if flags&flagCommand != 0 && flags&flagMore != 0 {
		return 0, nil, protof("command frame with the MORE flag")
	}
	var size uint64
	if flags&flagLong != 0 {
		var b [8]byte
		if _, err := io.ReadFull(zc.r, b[:]); err != nil {
			return 0, nil, eofIsUnexpected(err)
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		b, err := zc.r.ReadByte()
		if err != nil {
			return 0, nil, eofIsUnexpected(err)
		}
		size = uint64(b)
	}
	if size > MaxFrame {
		return 0, nil, protof("frame of %d bytes, over the limit of %d", size, MaxFrame)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(zc.r, body); err != nil {
		return 0, nil, eofIsUnexpected(err)
	}
	if flags&flagCommand != 0 && bytes.HasPrefix(body, libzmqErrorName) {
		body = append([]byte("\x05ERROR"), body[len(libzmqErrorName):]...)
	}
	return flags, body, nil
}

// libzmqErrorName is how libzmq 4.3 names its ERROR command: its source
// writes "\x5ERROR", which C reads as the byte 0x5E then "RROR", so the
// name's length byte is lost. readFrame turns it back into ERROR.
var libzmqErrorName = []byte("\x5eRROR")

func eofIsUnexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// readMessage reads one multipart message, answering PING with PONG and
// refusing any other command.
func (zc *conn) readMessage() ([][]byte, error) {
	var frames [][]byte
	total := 0
	for {
		flags, body, err := zc.readFrame()
		if err != nil {
			if err == io.EOF && len(frames) > 0 {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		if flags&flagCommand != 0 {
			if len(frames) > 0 {
				return nil, protof("command frame inside a multipart message")
			}
			name, _, err := parseCommand(body)
			if err != nil {
				return nil, err
			}
			switch name {
			case "PING":
				if err := zc.ping(body); err != nil {
					return nil, err
				}
				continue
			case "PONG":
				continue
			case "ERROR":
				return nil, protof("peer sent ERROR: %s", errorReason(body))
			default:
				return nil, protof("unsupported command %q", name)
			}
		}
		total += len(body)
		if total > MaxMessage {
			return nil, protof("message over the limit of %d bytes", MaxMessage)
		}
		frames = append(frames, body)
		if flags&flagMore == 0 {
			return frames, nil
		}
	}
}

// ping answers a PING (name, 2-byte TTL, context) with a PONG echoing the
// context.
func (zc *conn) ping(body []byte) error {
	var ctx []byte
	if len(body) > 1+4+2 {
		ctx = body[1+4+2:]
	}
	pong := append(command("PONG"), ctx...)
	_, err := zc.c.Write(appendFrame(nil, flagCommand, pong))
	return err
}

// writeMessage writes frames as one multipart message.
func (zc *conn) writeMessage(frames [][]byte) error {
	if len(frames) == 0 {
		return errors.New("zmtp: empty message")
	}
	b := zc.wb[:0]
	for i, f := range frames {
		if zc.curve != nil {
			b = zc.curve.sealMessage(b, i < len(frames)-1, f)
			continue
		}
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		b = appendFrame(b, flags, f)
	}
	zc.wb = b[:0]
	_, err := zc.c.Write(b)
	return err
}

// tcpAddress turns "tcp://host:port" into "host:port".
func tcpAddress(endpoint string) (string, error) {
	addr, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("zmtp: endpoint %q: only tcp:// endpoints are supported", endpoint)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", fmt.Errorf("zmtp: endpoint %q: %w", endpoint, err)
	}
	return addr, nil
}
