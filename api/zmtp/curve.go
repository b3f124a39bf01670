package zmtp

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"golang.org/x/crypto/nacl/box"
)

// The CURVE mechanism's client side (CurveZMQ, https://rfc.zeromq.org/spec/26/,
// as ZMTP 3.0 carries it): what pdctl needs to send to a pdkit control
// socket, which is a CURVE server. The client makes a transient keypair
// per connection; HELLO proves it to the server's long-term key, WELCOME
// brings the server's transient key and a cookie, INITIATE vouches for the
// transient key with the client's long-term key and carries the metadata,
// READY the server's. Every frame after that travels as a MESSAGE command,
// encrypted and authenticated with the two transient keys (NaCl's
// crypto_box: X25519, XSalsa20, Poly1305).

// CurveAuth is a CURVE client's keys: its long-term keypair and the
// server's long-term public key (raw 32-byte X25519 keys).
type CurveAuth struct {
	ServerPublic, ClientPublic, ClientSecret [32]byte
}

const mechCURVE = "CURVE"

// Sizes of the CURVE commands' bodies, names included.
const (
	curveHelloLen   = 200
	curveWelcomeLen = 168
	curveCookieLen  = 96
)

// curveState is a connection's session after the handshake: the keys that
// seal its messages and the next nonce.
type curveState struct {
	peer, mine [32]byte // the server's transient public key, the client's transient secret key
	nonce      uint64   // the client's short nonce: counts every box it sealed
}

// shortNonce is a 24-byte nonce of a 16-byte prefix and a counter.
func shortNonce(prefix string, n uint64) *[24]byte {
	var b [24]byte
	copy(b[:16], prefix)
	binary.BigEndian.PutUint64(b[16:], n)
	return &b
}

// longNonce is a 24-byte nonce of an 8-byte prefix and 16 bytes given.
func longNonce(prefix string, tail []byte) *[24]byte {
	var b [24]byte
	copy(b[:8], prefix)
	copy(b[8:], tail)
	return &b
}

// curveClient runs the client side of CURVE after the greetings (werr:
// how the writing of this side's ended) as a socket of type mine.
func (zc *conn) curveClient(mine string, a *CurveAuth, werr <-chan error) error {
	if err := <-werr; err != nil {
		return fmt.Errorf("zmtp: sending the greeting: %w", err)
	}
	cPub, cSec, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return err
	}
	st := &curveState{mine: *cSec, nonce: 1}

	// HELLO: version 1.0, 72 bytes of padding (so that HELLO is no
	// smaller than WELCOME), C', the nonce, Box[64 zeros](C'->S).
	hello := command("HELLO")
	hello = append(hello, 1, 0)
	hello = append(hello, make([]byte, 72)...)
	hello = append(hello, cPub[:]...)
	hello = binary.BigEndian.AppendUint64(hello, st.nonce)
	hello = box.Seal(hello, make([]byte, 64), shortNonce("CurveZMQHELLO---", st.nonce), &a.ServerPublic, cSec)
	st.nonce++
	if len(hello) != curveHelloLen {
		return fmt.Errorf("zmtp: curve: HELLO of %d bytes", len(hello))
	}
	if err := zc.writeCommand(hello); err != nil {
		return err
	}

	// WELCOME: a long nonce, Box[S' + cookie](S->C').
	body, err := zc.readCurveCommand("WELCOME", curveWelcomeLen)
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return &authError{ErrAuthRefused, "the server hung up on HELLO: it is not the CURVE server this side expects (another cluster secret?)"}
	}
	if err != nil {
		return err
	}
	p := body[len("\x07WELCOME"):]
	welcome, ok := box.Open(nil, p[16:], longNonce("WELCOME-", p[:16]), &a.ServerPublic, cSec)
	if !ok || len(welcome) != 32+curveCookieLen {
		return &authError{ErrAuthRefused, "the server's WELCOME does not open with its public key: is it the cluster's control socket, with the same secret?"}
	}
	copy(st.peer[:], welcome[:32])
	cookie := welcome[32:]

	// INITIATE: the cookie, the nonce, Box[C + vouch + metadata](C'->S'),
	// where the vouch is a long nonce and Box[C' + S](C->S').
	vn := make([]byte, 16)
	if _, err := rand.Read(vn); err != nil {
		return err
	}
	vouch := box.Seal(append([]byte(nil), vn...), append(cPub[:], a.ServerPublic[:]...), longNonce("VOUCH---", vn), &st.peer, &a.ClientSecret)
	inner := append(append([]byte(nil), a.ClientPublic[:]...), vouch...)
	inner = append(inner, metadata("", mine)[1:]...) // the properties alone
	init := command("INITIATE")
	init = append(init, cookie...)
	init = binary.BigEndian.AppendUint64(init, st.nonce)
	init = box.Seal(init, inner, shortNonce("CurveZMQINITIATE", st.nonce), &st.peer, cSec)
	st.nonce++
	if err := zc.writeCommand(init); err != nil {
		return err
	}

	// READY: the server's nonce, Box[metadata](S'->C').
	body, err = zc.readCurveCommand("READY", 0)
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return &authError{ErrAuthRefused, "the server hung up on INITIATE: it refused this side's CURVE keys (another cluster secret?)"}
	}
	if err != nil {
		var r *handshakeRefused
		if errors.As(err, &r) {
			return &authError{ErrAuthRefused, "the peer refused this side's CURVE keys (ERROR " + r.reason + "): the cluster secret given differs from the servers'"}
		}
		return err
	}
	p = body[len("\x05READY"):]
	if len(p) < 8+box.Overhead {
		return protof("curve: READY cut short")
	}
	props, ok := box.Open(nil, p[8:], shortNonce("CurveZMQREADY---", binary.BigEndian.Uint64(p[:8])), &st.peer, cSec)
	if !ok {
		return protof("curve: READY does not open")
	}
	_, pm, err := parseCommand(append(command("READY"), props...))
	if err != nil {
		return err
	}
	if err := checkSocketType(mine, "READY", pm); err != nil {
		return err
	}
	zc.curve = st
	return nil
}

// readCurveCommand reads the command want of CURVE's handshake, of size
// bytes when size is not 0 (an ERROR is the peer refusing).
func (zc *conn) readCurveCommand(want string, size int) ([]byte, error) {
	flags, body, err := zc.readFrame()
	if err != nil {
		return nil, eofIsUnexpected(err)
	}
	if flags&flagCommand == 0 {
		return nil, protof("expected the %s command, got a data frame", want)
	}
	if len(body) < 1 || len(body) < 1+int(body[0]) {
		return nil, protof("command frame too short for its name")
	}
	// The name only: under CURVE, READY's properties are sealed.
	name := string(body[1 : 1+int(body[0])])
	switch {
	case name == "ERROR":
		return nil, &handshakeRefused{reason: errorReason(body), after: want}
	case name != want:
		return nil, protof("expected the %s command, got %q", want, name)
	case size != 0 && len(body) != size:
		return nil, protof("curve: %s of %d bytes, want %d", want, len(body), size)
	}
	return body, nil
}

// sealMessage appends one frame, sealed as a MESSAGE, to b. libzmq sends a
// MESSAGE as a data frame without the MORE flag (the frame's own MORE bit
// travels sealed, in the box's first byte), and so does this side.
func (st *curveState) sealMessage(b []byte, more bool, frame []byte) []byte {
	plain := make([]byte, 1+len(frame))
	if more {
		plain[0] = flagMore
	}
	copy(plain[1:], frame)
	body := command("MESSAGE")
	body = binary.BigEndian.AppendUint64(body, st.nonce)
	body = box.Seal(body, plain, shortNonce("CurveZMQMESSAGEC", st.nonce), &st.peer, &st.mine)
	st.nonce++
	return appendFrame(b, 0, body)
}
