package zmtp

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
)

// The PLAIN security mechanism (https://rfc.zeromq.org/spec/24/, and
// ZMTP 3.0's PLAIN section), as libzmq speaks it. After the greetings
// (both name PLAIN; the PULL side is the server) the client sends HELLO
// with its username and password, the server answers WELCOME or ERROR,
// the client sends INITIATE with its metadata (Socket-Type, Identity) and
// the server answers READY with its own, or ERROR. The password crosses
// the wire in the clear: PLAIN authenticates the connection, it does not
// hide or protect its traffic.

// PlainAuth is a PLAIN credential: what a Push presents (DialAuth,
// SendAuth) and the only one a Pull admits (ListenAuth). Both are at most
// 255 bytes and not empty. A Pull with Admit set admits instead whatever
// credential Admit says (a rotating one, as pdkit's KV sockets present;
// Username and Password are then unused).
type PlainAuth struct {
	Username, Password string
	Admit              func(user, password []byte) bool
}

func (a *PlainAuth) validate() error {
	if a.Admit != nil {
		return nil
	}
	if a.Username == "" || a.Password == "" {
		return errors.New("zmtp: empty PLAIN username or password")
	}
	if len(a.Username) > 255 || len(a.Password) > 255 {
		return errors.New("zmtp: PLAIN username or password over 255 bytes")
	}
	return nil
}

// ErrAuthRequired is matched (errors.Is) when the two ends disagree on
// authentication: the peer requires PLAIN and no credential was given,
// or the other way round.
var ErrAuthRequired = errors.New("zmtp: authentication mismatch")

// ErrAuthRefused is matched (errors.Is) when the peer refused this side's
// credential, or the peer presented a wrong one to a Pull.
var ErrAuthRefused = errors.New("zmtp: credentials refused")

// authError is a handshake that failed on authentication; it also matches
// ErrProtocol.
type authError struct {
	kind error
	msg  string
}

func (e *authError) Error() string        { return "zmtp: " + e.msg }
func (e *authError) Is(target error) bool { return target == e.kind || target == ErrProtocol }

// handshakeRefused is an ERROR command in place of the one expected.
type handshakeRefused struct {
	reason string // the ERROR's reason; libzmq sends the ZAP status code
	after  string // the command that was expected
}

func (e *handshakeRefused) Error() string        { return "zmtp: peer refused the handshake: " + e.reason }
func (e *handshakeRefused) Is(target error) bool { return target == ErrProtocol }

// plainHandshake runs the PLAIN mechanism after the greetings (werr: how
// the writing of this side's ended) as a socket of type mine: the client side when it dialed, the server side when it
// accepted (libzmq leaves the greeting's as-server flag clear, so the
// roles come from who connected).
func (zc *conn) plainHandshake(mine string, asServer bool, auth *PlainAuth, werr <-chan error) error {
	// The greeting must be out before the first command.
	if err := <-werr; err != nil {
		return fmt.Errorf("zmtp: sending the greeting: %w", err)
	}
	if asServer {
		return zc.plainServer(mine, auth)
	}
	return zc.plainClient(mine, auth)
}

// plainClient presents auth (HELLO), then its metadata (INITIATE).
func (zc *conn) plainClient(mine string, auth *PlainAuth) error {
	if err := zc.writeCommand(hello(auth)); err != nil {
		return err
	}
	if _, err := zc.readCommand("WELCOME"); err != nil {
		var r *handshakeRefused
		if errors.As(err, &r) {
			return &authError{ErrAuthRefused, fmt.Sprintf("the peer refused the credentials of user %q (ERROR %s)", auth.Username, r.reason)}
		}
		return err
	}
	if err := zc.writeCommand(metadata("INITIATE", mine)); err != nil {
		return err
	}
	props, err := zc.readCommand("READY")
	if err != nil {
		return err
	}
	return checkSocketType(mine, "READY", props)
}

// plainServer admits only auth's credential (HELLO), then trades
// metadata (INITIATE, READY).
func (zc *conn) plainServer(mine string, auth *PlainAuth) error {
	flags, body, err := zc.readFrame()
	if err != nil {
		return eofIsUnexpected(err)
	}
	user, pass, err := parseHello(flags, body)
	if err != nil {
		return err
	}
	ok := false
	if auth.Admit != nil {
		ok = auth.Admit(user, pass)
	} else {
		ok = subtle.ConstantTimeCompare(user, []byte(auth.Username))&subtle.ConstantTimeCompare(pass, []byte(auth.Password)) == 1
	}
	if !ok {
		_ = zc.writeCommand(append(command("ERROR"), 3, '4', '0', '0'))
		return &authError{ErrAuthRefused, fmt.Sprintf("refused the credentials of user %q", user)}
	}
	if err := zc.writeCommand(command("WELCOME")); err != nil {
		return err
	}
	props, err := zc.readCommand("INITIATE")
	if err != nil {
		return err
	}
	if err := checkSocketType(mine, "INITIATE", props); err != nil {
		return err
	}
	return zc.writeCommand(metadata("READY", mine))
}

// hello is the HELLO command's body: the username and the password, each
// after its one-byte length.
func hello(a *PlainAuth) []byte {
	b := command("HELLO")
	b = append(b, byte(len(a.Username)))
	b = append(b, a.Username...)
	b = append(b, byte(len(a.Password)))
	return append(b, a.Password...)
}

// parseHello returns a HELLO command's username and password.
func parseHello(flags byte, body []byte) (user, pass []byte, err error) {
	if flags&flagCommand == 0 {
		return nil, nil, protof("expected the HELLO command, got a data frame")
	}
	name, _, err := parseCommand(body)
	if err != nil {
		return nil, nil, err
	}
	if name != "HELLO" {
		return nil, nil, protof("expected the HELLO command, got %q", name)
	}
	p := body[1+len(name):]
	if len(p) < 1 || len(p) < 1+int(p[0]) {
		return nil, nil, protof("HELLO cut short in its username")
	}
	user, p = p[1:1+int(p[0])], p[1+int(p[0]):]
	if len(p) < 1 || len(p) != 1+int(p[0]) {
		return nil, nil, protof("HELLO's password is cut short or followed by other bytes")
	}
	return user, p[1:], nil
}

// metadata is a READY or INITIATE command with this side's properties.
func metadata(name, mine string) []byte {
	return command(name, [2]string{"Socket-Type", mine}, [2]string{"Identity", ""})
}

func (zc *conn) writeCommand(body []byte) error {
	_, err := zc.c.Write(appendFrame(nil, flagCommand, body))
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}
