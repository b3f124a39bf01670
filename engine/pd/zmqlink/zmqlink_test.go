package zmqlink

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// checkGoroutines fails the test if, after it ends, the goroutine count
// does not come back to what it was when checkGoroutines was called.
func checkGoroutines(t *testing.T) {
	t.Helper()
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		if !waitfor.Poll(5*time.Second, func() bool { return runtime.NumGoroutine() <= base }) {
			buf := make([]byte, 1<<16)
			n := runtime.Stack(buf, true)
			t.Errorf("goroutines: %d, baseline %d, 5s after the test\n%s", runtime.NumGoroutine(), base, buf[:n])
		}
	})
}

// backends are the two socket backends the tests run over.
var backends = []struct {
	name string
	zc   bool // SocketOptions.ZeroCopy
}{{"pebbe", false}, {"shim", true}}

// eachBackend runs test once per backend, as subtests.
func eachBackend(t *testing.T, test func(t *testing.T, zc bool)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { test(t, b.zc) })
	}
}

func inOpts(zc bool) *InboxOptions {
	return &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc}}
}

func outOpts(zc bool) *OutboxOptions {
	return &OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc}}
}

// collector is a Handler that keeps (a copy of) every message.
type collector struct {
	mu   sync.Mutex
	msgs [][][]byte
}

func (c *collector) handle(frames [][]byte) error {
	c.mu.Lock()
	c.msgs = append(c.msgs, CloneFrames(frames))
	c.mu.Unlock()
	return nil
}

func (c *collector) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.msgs)
}

func (c *collector) snapshot() [][][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([][][]byte(nil), c.msgs...)
}

func newPair(t *testing.T, h Handler, zc bool) (*Inbox, *Outbox) {
	t.Helper()
	in, err := Listen("tcp://127.0.0.1:0", h, inOpts(zc))
	if err != nil {
		t.Fatal(err)
	}
	out, err := NewOutbox(outOpts(zc))
	if err != nil {
		in.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := out.Close(); err != nil {
			t.Error("outbox close:", err)
		}
		if err := in.Close(); err != nil {
			t.Error("inbox close:", err)
		}
	})
	return in, out
}

func msg(i int) [][]byte {
	var seq [8]byte
	binary.LittleEndian.PutUint64(seq[:], uint64(i))
	body := make([]byte, i%700)
	for j := range body {
		body[j] = byte(i + j)
	}
	return [][]byte{[]byte("PDK1"), seq[:], {}, body}
}

func TestRoundTripInOrder(t *testing.T) { eachBackend(t, testRoundTripInOrder) }

func testRoundTripInOrder(t *testing.T, zc bool) {
	checkGoroutines(t)
	var c collector
	in, out := newPair(t, c.handle, zc)
	if in.Endpoint() == "tcp://127.0.0.1:0" || in.Endpoint() == "" {
		t.Fatalf("endpoint %q: want the real port", in.Endpoint())
	}
	const n = 2000
	ctx := context.Background()
	wantBytes := 0
	for i := range n {
		m := msg(i)
		for _, f := range m {
			wantBytes += len(f)
		}
		if err := out.Send(ctx, in.Endpoint(), m); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "all messages", 10*time.Second, func() bool { return c.len() == n })
	for i, got := range c.snapshot() {
		want := msg(i)
		if len(got) != len(want) {
			t.Fatalf("message %d: %d frames, want %d", i, len(got), len(want))
		}
		for j := range want {
			if string(got[j]) != string(want[j]) {
				t.Fatalf("message %d frame %d differs", i, j)
			}
		}
	}
	st := in.Stats()
	if st.Messages != n || st.Bytes != uint64(wantBytes) || !st.Alive || st.LastMessage.IsZero() {
		t.Fatalf("inbox stats %+v, want %d messages, %d bytes", st, n, wantBytes)
	}
	os := out.Stats()
	if os.Sent != n || os.Bytes != uint64(wantBytes) || os.Peers != 1 || os.Dropped != 0 || os.SendErrors != 0 {
		t.Fatalf("outbox stats %+v", os)
	}
}

func TestHandlerPanicAndErrorRecovered(t *testing.T) {
	eachBackend(t, testHandlerPanicAndErrorRecovered)
}

func testHandlerPanicAndErrorRecovered(t *testing.T, zc bool) {
	checkGoroutines(t)
	var c collector
	h := func(frames [][]byte) error {
		switch string(frames[0]) {
		case "panic":
			panic("boom")
		case "error":
			return errors.New("bad message")
		}
		return c.handle(frames)
	}
	in, out := newPair(t, h, zc)
	ctx := context.Background()
	for _, s := range []string{"a", "panic", "b", "error", "c"} {
		if err := out.Send(ctx, in.Endpoint(), [][]byte{[]byte(s)}); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "3 good messages", 10*time.Second, func() bool { return c.len() == 3 })
	waitfor.For(t, "5 counted", 10*time.Second, func() bool { return in.Stats().Messages == 5 })
	got := ""
	for _, m := range c.snapshot() {
		got += string(m[0])
	}
	if got != "abc" {
		t.Fatalf("handled %q, want abc", got)
	}
	st := in.Stats()
	if st.HandlerPanics != 1 || st.HandlerErrors != 1 || !st.Alive || !in.Alive() {
		t.Fatalf("stats %+v", st)
	}
	if st.LastError == "" {
		t.Fatal("no last error")
	}
}

// deadEndpoint returns a loopback TCP endpoint nobody listens on.
func deadEndpoint(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "tcp://" + addr
}

func TestCloseWithPeerGone(t *testing.T) { eachBackend(t, testCloseWithPeerGone) }

func testCloseWithPeerGone(t *testing.T, zc bool) {
	checkGoroutines(t)
	out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{HWM: 4, ZeroCopy: zc}, MaxPending: 8})
	if err != nil {
		t.Fatal(err)
	}
	ep := deadEndpoint(t)
	big := make([]byte, 1<<20)
	accepted, refused := 0, 0
	for range 20 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err := out.Send(ctx, ep, [][]byte{big})
		cancel()
		switch {
		case err == nil:
			accepted++
		case errors.Is(err, ErrQueueFull):
			refused++
		default:
			t.Fatal(err)
		}
	}
	// About 4 in ZeroMQ's pipe (HWM), 8 pending: a dead peer pushes back
	// on Send.
	if accepted < 8 || refused == 0 {
		t.Fatalf("accepted %d, refused %d; want at least 8 accepted and some refused", accepted, refused)
	}
	// Sends are refused by a full queue, never block forever.
	small, err := NewOutbox(&OutboxOptions{QueueSize: 1, SocketOptions: SocketOptions{HWM: 1, ZeroCopy: zc}, MaxPending: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	var sendErr error
	for i := 0; i < 10000 && sendErr == nil; i++ {
		sendErr = small.Send(ctx, ep, [][]byte{big})
	}
	if !errors.Is(sendErr, ErrQueueFull) {
		t.Fatalf("send to a full queue: %v, want ErrQueueFull", sendErr)
	}
	start := time.Now()
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	if err := small.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("close took %v", d)
	}
	if err := out.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	if out.Alive() {
		t.Fatal("alive after close")
	}
	if err := out.Send(context.Background(), ep, [][]byte{big}); !errors.Is(err, ErrClosed) {
		t.Fatalf("send after close: %v", err)
	}
	st := out.Stats()
	if st.Sent+st.Dropped != uint64(accepted) || st.Dropped < 8 || st.QueueFull != uint64(refused) || st.Backlog != 0 || st.Peers != 0 {
		t.Fatalf("stats %+v: want sent+dropped = %d accepted, at least 8 dropped, %d refused", st, accepted, refused)
	}
}

func TestConcurrentSenders(t *testing.T) { eachBackend(t, testConcurrentSenders) }

func testConcurrentSenders(t *testing.T, zc bool) {
	checkGoroutines(t)
	var c collector
	in, out := newPair(t, c.handle, zc)
	const senders, each = 4, 50
	var wg sync.WaitGroup
	for s := range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				m := [][]byte{{byte(s)}, binary.LittleEndian.AppendUint32(nil, uint32(i))}
				if err := out.Send(context.Background(), in.Endpoint(), m); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	waitfor.For(t, "200 messages", 10*time.Second, func() bool { return c.len() == senders*each })
	next := make([]uint32, senders)
	for _, m := range c.snapshot() {
		s, i := m[0][0], binary.LittleEndian.Uint32(m[1])
		if i != next[s] {
			t.Fatalf("sender %d: got %d, want %d (per-sender order)", s, i, next[s])
		}
		next[s]++
	}
}

func TestForgetReconnectsRestartedPeer(t *testing.T) {
	eachBackend(t, testForgetReconnectsRestartedPeer)
}

func testForgetReconnectsRestartedPeer(t *testing.T, zc bool) {
	checkGoroutines(t)
	var c1 collector
	in1, err := Listen("tcp://127.0.0.1:0", c1.handle, inOpts(zc))
	if err != nil {
		t.Fatal(err)
	}
	ep := in1.Endpoint()
	out, err := NewOutbox(outOpts(zc))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := out.Send(context.Background(), ep, [][]byte{[]byte("one")}); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "first message", 10*time.Second, func() bool { return c1.len() == 1 })
	if err := in1.Close(); err != nil {
		t.Fatal(err)
	}
	if err := in1.Close(); err != nil {
		t.Fatal(err)
	}
	if in1.Alive() || in1.ExitReason() != "closed" {
		t.Fatalf("after close: alive %v, reason %q", in1.Alive(), in1.ExitReason())
	}
	var c2 collector
	in2, err := Listen(ep, c2.handle, inOpts(zc)) // the restarted peer, same endpoint
	if err != nil {
		t.Fatal(err)
	}
	defer in2.Close()
	if err := out.Forget(ep); err != nil {
		t.Fatal(err)
	}
	if err := out.Forget("tcp://127.0.0.1:1"); err != nil {
		t.Fatal(err)
	}
	if err := out.Send(context.Background(), ep, [][]byte{[]byte("two")}); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "message to the restarted peer", 10*time.Second, func() bool { return c2.len() == 1 })
}

func TestListenErrors(t *testing.T) { eachBackend(t, testListenErrors) }

func testListenErrors(t *testing.T, zc bool) {
	checkGoroutines(t)
	in, err := Listen("tcp://127.0.0.1:0", func([][]byte) error { return nil }, inOpts(zc))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if _, err := Listen(in.Endpoint(), func([][]byte) error { return nil }, inOpts(zc)); err == nil {
		t.Fatal("second bind on the same port succeeded")
	}
	if _, err := Listen("bogus://x", func([][]byte) error { return nil }, inOpts(zc)); err == nil {
		t.Fatal("bad endpoint accepted")
	}
	if _, err := Listen("tcp://127.0.0.1:0", nil, inOpts(zc)); err == nil {
		t.Fatal("nil handler accepted")
	}
}

func TestBindAddress(t *testing.T) {
	for in, want := range map[string]string{
		"tcp://127.0.0.1:0":    "tcp://127.0.0.1:*",
		"tcp://127.0.0.1:5550": "tcp://127.0.0.1:5550",
		"ipc:///tmp/x":         "ipc:///tmp/x",
	} {
		if got := bindAddress(in); got != want {
			t.Errorf("bindAddress(%q) = %q, want %q", in, got, want)
		}
	}
}

// A handler that returns ErrExitLoop ends the receive loop: what comes
// after is never handled, the inbox reports itself dead with the reason,
// and Close still returns.
func TestHandlerEndsLoop(t *testing.T) { eachBackend(t, testHandlerEndsLoop) }

func testHandlerEndsLoop(t *testing.T, zc bool) {
	checkGoroutines(t)
	var c collector
	h := func(frames [][]byte) error {
		if string(frames[0]) == "exit" {
			return fmt.Errorf("unknown message: %w", ErrExitLoop)
		}
		return c.handle(frames)
	}
	in, out := newPair(t, h, zc)
	ctx := context.Background()
	for _, s := range []string{"a", "exit", "b"} {
		if err := out.Send(ctx, in.Endpoint(), [][]byte{[]byte(s)}); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "loop ends", 10*time.Second, func() bool { return !in.Alive() })
	st := in.Stats()
	if c.len() != 1 || st.Alive || !strings.Contains(st.ExitReason, "unknown message") {
		t.Fatalf("handled %d, stats %+v", c.len(), st)
	}
}

// bigMsg is message i with frames below and above zeroCopyMin, two of
// them slices of one array.
func bigMsg(i int) [][]byte {
	arr := make([]byte, 3*zeroCopyMin+1000)
	for j := range arr {
		arr[j] = byte(i*7 + j*13)
	}
	big := make([]byte, 1<<20+17)
	for j := range big {
		big[j] = byte(i + j)
	}
	var seq [4]byte
	binary.BigEndian.PutUint32(seq[:], uint32(i))
	return [][]byte{seq[:], arr[:zeroCopyMin], {}, arr[zeroCopyMin : 2*zeroCopyMin-1], big, arr[len(arr)-1000:]}
}

func TestLargeFramesZeroCopy(t *testing.T) { eachBackend(t, testLargeFramesZeroCopy) }

func testLargeFramesZeroCopy(t *testing.T, zc bool) {
	checkGoroutines(t)
	const n = 100
	var mu sync.Mutex
	var bad []string
	got := 0
	h := func(frames [][]byte) error {
		i := int(binary.BigEndian.Uint32(frames[0]))
		want := bigMsg(i)
		mu.Lock()
		defer mu.Unlock()
		if i != got {
			bad = append(bad, fmt.Sprintf("message %d arrived as %d", i, got))
		}
		got++
		if len(frames) != len(want) {
			bad = append(bad, fmt.Sprintf("message %d: %d frames, want %d", i, len(frames), len(want)))
			return nil
		}
		for j := range want {
			if string(frames[j]) != string(want[j]) {
				bad = append(bad, fmt.Sprintf("message %d frame %d differs", i, j))
			}
		}
		return nil
	}
	in, out := newPair(t, h, zc)
	for i := range n {
		if err := out.Send(context.Background(), in.Endpoint(), bigMsg(i)); err != nil {
			t.Fatal(err)
		}
		if i%50 == 0 {
			runtime.GC() // pinned frames must survive collections
		}
	}
	waitfor.For(t, "all messages", 20*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return got == n })
	mu.Lock()
	if len(bad) > 0 {
		t.Fatalf("%d errors, first: %s", len(bad), bad[0])
	}
	mu.Unlock()
	// Everything was written out: libzmq released every frame without a
	// close.
	waitfor.For(t, "frames unpinned", 5*time.Second, func() bool { return livePins.Load() == 0 })
	if st := out.Stats(); st.Sent != n || st.Dropped != 0 || st.SendErrors != 0 {
		t.Fatalf("outbox stats %+v", st)
	}
}

// TestCloseReleasesPinnedFrames closes an Outbox holding large messages
// for a peer that never answers: Close returns promptly and every pinned
// frame is released.
func TestCloseReleasesPinnedFrames(t *testing.T) { eachBackend(t, testCloseReleasesPinnedFrames) }

func testCloseReleasesPinnedFrames(t *testing.T, zc bool) {
	checkGoroutines(t)
	l, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never reads
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		var conns []net.Conn
		for {
			c, err := l.Accept()
			if err != nil {
				for _, c := range conns {
					c.Close()
				}
				return
			}
			conns = append(conns, c)
		}
	}()
	out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc}, Linger: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + l.Addr().String()
	for i := range 100 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		err := out.Send(ctx, ep, bigMsg(i))
		cancel()
		if err != nil && !errors.Is(err, ErrQueueFull) {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "the sender taking every queued message", 10*time.Second, func() bool { return out.Stats().Queued == 0 })
	start := time.Now()
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Close took %v", d)
	}
	if n := livePins.Load(); n != 0 {
		t.Fatalf("%d messages still pinned after Close", n)
	}
	l.Close()
	<-accepted
}

func TestCloneFrames(t *testing.T) {
	in := [][]byte{[]byte("ab"), {}, nil, []byte("cde")}
	out := CloneFrames(in)
	in[0][0], in[3][0] = 'x', 'x'
	if len(out) != 4 || string(out[0]) != "ab" || len(out[1]) != 0 || len(out[2]) != 0 || string(out[3]) != "cde" {
		t.Fatalf("%q", out)
	}
	out[0] = append(out[0], 'z') // capped: must not overwrite out[1..]
	if string(out[3]) != "cde" {
		t.Fatalf("%q", out)
	}
}

// A pebbe/zmq4 Outbox talks to a shim Inbox and a shim Outbox to a
// pebbe/zmq4 Inbox: both backends speak the same ZMTP. Small and large
// (zero-copy) frames, empty frames, order and stats all survive.
func TestBackendsInteroperate(t *testing.T) {
	for _, dir := range []struct {
		name        string
		outZC, inZC bool
	}{{"pebbe-to-shim", false, true}, {"shim-to-pebbe", true, false}} {
		t.Run(dir.name, func(t *testing.T) {
			checkGoroutines(t)
			var c collector
			in, err := Listen("tcp://127.0.0.1:0", c.handle, inOpts(dir.inZC))
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			out, err := NewOutbox(outOpts(dir.outZC))
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			const n = 40
			var want [][][]byte
			for i := range n {
				m := msg(i)
				if i%2 == 1 {
					m = bigMsg(i)
				}
				want = append(want, CloneFrames(m))
				if err := out.Send(context.Background(), in.Endpoint(), m); err != nil {
					t.Fatal(err)
				}
			}
			waitfor.For(t, "all messages", 20*time.Second, func() bool { return c.len() == n })
			for i, got := range c.snapshot() {
				if len(got) != len(want[i]) {
					t.Fatalf("message %d: %d frames, want %d", i, len(got), len(want[i]))
				}
				for j := range got {
					if string(got[j]) != string(want[i][j]) {
						t.Fatalf("message %d frame %d differs", i, j)
					}
				}
			}
			if st := out.Stats(); st.Sent != n || st.Dropped != 0 || st.SendErrors != 0 {
				t.Fatalf("outbox stats %+v", st)
			}
			if st := in.Stats(); st.Messages != n || st.HandlerErrors != 0 || st.RecvErrors != 0 {
				t.Fatalf("inbox stats %+v", st)
			}
			if err := out.Close(); err != nil {
				t.Fatal(err)
			}
			if n := livePins.Load(); n != 0 {
				t.Fatalf("%d messages still pinned after Close", n)
			}
		})
	}
}
