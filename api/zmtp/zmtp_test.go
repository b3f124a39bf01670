package zmtp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// rawPeer is the far end of a net.Pipe, driven byte by byte by the test.
type rawPeer struct {
	t *testing.T
	c net.Conn
}

func (r *rawPeer) read(n int) []byte {
	r.t.Helper()
	b := make([]byte, n)
	r.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(r.c, b); err != nil {
		r.t.Fatalf("raw peer: reading %d bytes: %v", n, err)
	}
	return b
}

// write writes b from a goroutine (net.Pipe does not buffer).
func (r *rawPeer) write(b []byte) <-chan error {
	done := make(chan error, 1)
	go func() { _, err := r.c.Write(b); done <- err }()
	return done
}

// frame reads one short frame and returns its flags and body.
func (r *rawPeer) frame() (byte, []byte) {
	r.t.Helper()
	h := r.read(1)
	var n uint64
	if h[0]&flagLong != 0 {
		n = binary.BigEndian.Uint64(r.read(8))
	} else {
		n = uint64(r.read(1)[0])
	}
	return h[0], r.read(int(n))
}

func ready(socketType string) []byte {
	return appendFrame(nil, flagCommand, command("READY", [2]string{"Socket-Type", socketType}, [2]string{"Identity", ""}))
}

// expectHandshake reads the other side's greeting and READY and checks
// them.
func (r *rawPeer) expectHandshake(asServer bool, socketType string) {
	r.t.Helper()
	g := r.read(greetingLen)
	want := make([]byte, greetingLen)
	want[0], want[9], want[10] = 0xFF, 0x7F, 3
	copy(want[12:], "NULL")
	if asServer {
		want[32] = 1
	}
	if !bytes.Equal(g, want) {
		r.t.Fatalf("greeting\n got % x\nwant % x", g, want)
	}
	flags, body := r.frame()
	wantBody := command("READY", [2]string{"Socket-Type", socketType}, [2]string{"Identity", ""})
	if flags != flagCommand || !bytes.Equal(body, wantBody) {
		r.t.Fatalf("READY: flags %#x body %q, want %#x %q", flags, body, flagCommand, wantBody)
	}
}

func pipePush(t *testing.T, peerGreeting []byte) (*Push, *rawPeer, error) {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	peer := &rawPeer{t: t, c: b}
	res := make(chan struct {
		p   *Push
		err error
	}, 1)
	go func() {
		p, err := newPush(context.Background(), a, nil, nil)
		res <- struct {
			p   *Push
			err error
		}{p, err}
	}()
	w := peer.write(peerGreeting)
	r := <-res
	b.Close()
	<-w
	return r.p, peer, r.err
}

func TestPushSendsMultipart(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	peer := &rawPeer{t: t, c: b}
	got := make(chan error, 1)
	var push *Push
	go func() {
		var err error
		push, err = newPush(context.Background(), a, nil, nil)
		if err == nil {
			long := bytes.Repeat([]byte{'x'}, 300)
			err = push.Send(context.Background(), [][]byte{[]byte("PDKIT\x02"), {}, long})
		}
		got <- err
	}()
	w := peer.write(append(greeting(mechNULL, true), ready(TypePULL)...))
	peer.expectHandshake(false, TypePUSH)
	if f, body := peer.frame(); f != flagMore || string(body) != "PDKIT\x02" {
		t.Fatalf("frame 0: %#x %q", f, body)
	}
	if f, body := peer.frame(); f != flagMore || len(body) != 0 {
		t.Fatalf("frame 1: %#x %q", f, body)
	}
	if f, body := peer.frame(); f != flagLong || len(body) != 300 {
		t.Fatalf("frame 2: %#x, %d bytes", f, len(body))
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if err := <-w; err != nil {
		t.Fatal(err)
	}
	push.Close()
}

func TestHandshakeRefusals(t *testing.T) {
	bad := func(mutate func(g []byte) []byte) []byte {
		return mutate(append(greeting(mechNULL, true), ready(TypePULL)...))
	}
	tests := []struct {
		name  string
		input []byte
		want  string
	}{
		{"signature", bad(func(g []byte) []byte { g[9] = 0; return g }), "not a ZMTP 3 greeting: signature ff 00 00 00 00 00 00 00 00 00"},
		{"zmtp 2", bad(func(g []byte) []byte { g[10], g[11] = 2, 0; return g }), "peer speaks ZMTP 2.0, only 3.x is supported"},
		{"curve", bad(func(g []byte) []byte { copy(g[12:32], "CURVE\x00\x00\x00"); return g }), `the peer requires the CURVE mechanism: connect with CURVE keys (a CurveAuth, which pdctl derives from the cluster secret)`},
		{"gssapi", bad(func(g []byte) []byte { copy(g[12:32], "GSSAPI\x00\x00"); return g }), `peer asks for security mechanism "GSSAPI", only NULL, PLAIN and CURVE (as a client) are supported`},
		{"socket type", append(greeting(mechNULL, true), ready("PUB")...), "peer is a PUB socket, a PUSH socket only talks to PULL"},
		{"push to push", append(greeting(mechNULL, true), ready(TypePUSH)...), "peer is a PUSH socket, a PUSH socket only talks to PULL"},
		{"no socket type", append(greeting(mechNULL, true), appendFrame(nil, flagCommand, command("READY"))...), "READY without a Socket-Type property"},
		{"error command", append(greeting(mechNULL, true), appendFrame(nil, flagCommand, append(command("ERROR"), 4, 'n', 'o', 'p', 'e'))...), "peer refused the handshake: nope"},
		{"data before ready", append(greeting(mechNULL, true), appendFrame(nil, 0, []byte("hi"))...), "expected the READY command, got a data frame"},
		{"other command", append(greeting(mechNULL, true), appendFrame(nil, flagCommand, command("HELLO"))...), `expected the READY command, got "HELLO"`},
		{"reserved flags", append(greeting(mechNULL, true), 0x84, 0), "frame flags 0x84: reserved bits set"},
		{"cut property", append(greeting(mechNULL, true), appendFrame(nil, flagCommand, append(command("READY"), 11, 'S'))...), "READY property cut short"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := pipePush(t, tt.input)
			if err == nil || !errors.Is(err, ErrProtocol) || err.Error() != "zmtp: "+tt.want {
				t.Fatalf("err = %v, want zmtp: %s", err, tt.want)
			}
		})
	}
}

// pipePull serves one end of a net.Pipe with a Pull's peer loop.
func pipePull(t *testing.T) (*Pull, *rawPeer) {
	t.Helper()
	p, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	a, b := net.Pipe()
	t.Cleanup(func() { b.Close() })
	p.mu.Lock()
	p.conns[a] = true
	p.wg.Add(1)
	p.mu.Unlock()
	go p.serve(a)
	return p, &rawPeer{t: t, c: b}
}

func TestPullReceives(t *testing.T) {
	p, peer := pipePull(t)
	if !strings.HasPrefix(p.Endpoint(), "tcp://127.0.0.1:") || strings.HasSuffix(p.Endpoint(), ":0") {
		t.Fatalf("endpoint %q", p.Endpoint())
	}
	var msg []byte
	msg = append(msg, greeting(mechNULL, false)...)
	msg = append(msg, ready(TypePUSH)...)
	// A PING between messages is answered, then two messages: one of
	// three frames (one long) and one of a single empty frame.
	msg = appendFrame(msg, flagCommand, append(command("PING"), 0, 10, 'c', 't', 'x'))
	msg = appendFrame(msg, flagMore, []byte("a"))
	msg = appendFrame(msg, flagMore, bytes.Repeat([]byte{'b'}, 1000))
	msg = appendFrame(msg, 0, []byte("c"))
	msg = appendFrame(msg, 0, nil)
	w := peer.write(msg)
	peer.expectHandshake(true, TypePULL)
	if f, body := peer.frame(); f != flagCommand || !bytes.Equal(body, append(command("PONG"), 'c', 't', 'x')) {
		t.Fatalf("PONG: %#x %q", f, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m, err := p.Recv(ctx)
	if err != nil || len(m) != 3 || string(m[0]) != "a" || len(m[1]) != 1000 || string(m[2]) != "c" {
		t.Fatalf("first message: %d frames, %v", len(m), err)
	}
	m, err = p.Recv(ctx)
	if err != nil || len(m) != 1 || len(m[0]) != 0 {
		t.Fatalf("second message: %q, %v", m, err)
	}
	if err := <-w; err != nil {
		t.Fatal(err)
	}
	short, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	if _, err := p.Recv(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv with nothing sent: %v, want the deadline", err)
	}
	p.Close()
	if _, err := p.Recv(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Recv after Close: %v", err)
	}
}

func TestPullRefuses(t *testing.T) {
	tests := []struct {
		name string
		msg  []byte
		want string
	}{
		{"pull peer", ready(TypePULL), "zmtp: peer is a PULL socket, a PULL socket only talks to PUSH"},
		{"unknown command", append(ready(TypePUSH), appendFrame(nil, flagCommand, command("SUBSCRIBE"))...), `zmtp: unsupported command "SUBSCRIBE"`},
		{"command with more", append(ready(TypePUSH), flagCommand|flagMore, 0), "zmtp: command frame with the MORE flag"},
		{"command inside a message", append(appendFrame(ready(TypePUSH), flagMore, []byte("a")), appendFrame(nil, flagCommand, command("PING"))...), "zmtp: command frame inside a multipart message"},
		{"huge frame", append(ready(TypePUSH), flagLong, 0, 0, 0, 1, 0, 0, 0, 0), "zmtp: frame of 4294967296 bytes, over the limit of 67108864"},
		{"cut message", appendFrame(ready(TypePUSH), flagMore, []byte("a")), "unexpected EOF"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, peer := pipePull(t)
			w := peer.write(append(greeting(mechNULL, false), tt.msg...))
			if tt.name != "pull peer" { // refused before the Pull's READY is sent
				peer.read(greetingLen)
				peer.frame()
			}
			go io.Copy(io.Discard, peer.c)
			<-w
			if tt.name != "pull peer" {
				peer.c.Close()
			}
			waitfor.For(t, "an error recorded", 5*time.Second, func() bool { return len(p.Errors()) != 0 })
			if got := p.Errors()[0].Error(); got != tt.want {
				t.Fatalf("error %q, want %q", got, tt.want)
			}
		})
	}
}

func TestEndpoints(t *testing.T) {
	for _, ep := range []string{"ipc:///tmp/x", "tcp://nohost", "127.0.0.1:5"} {
		if _, err := Listen(ep); err == nil {
			t.Errorf("Listen(%q): no error", ep)
		}
		if _, err := Dial(context.Background(), ep); err == nil {
			t.Errorf("Dial(%q): no error", ep)
		}
	}
}

// TestOverTCP is a PUSH and a PULL of this package over loopback.
func TestOverTCP(t *testing.T) {
	p, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := range 3 {
		if err := Send(ctx, p.Endpoint(), [][]byte{{byte(i)}, []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[byte]bool{}
	for range 3 {
		m, err := p.Recv(ctx)
		if err != nil || len(m) != 2 {
			t.Fatalf("%q %v", m, err)
		}
		seen[m[0][0]] = true
	}
	if len(seen) != 3 {
		t.Fatalf("seen %v", seen)
	}
}
