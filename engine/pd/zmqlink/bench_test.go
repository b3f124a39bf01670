package zmqlink

import (
	"context"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The throughput benchmarks move b.N messages one way over loopback TCP and
// report MB/s; the cost of connection authentication is 4MiB/plain (and
// 4MiB/curve) against 4MiB/default. BenchmarkZMQ runs every case over both backends
// (BenchmarkZMQ/pebbe/...: pebbe/zmq4, a copy per send, an allocation and
// a copy per receive; BenchmarkZMQ/shim/...: the zero-copy shim), and
// BenchmarkRawTCP is the yardstick they are compared with (run them in the
// same `go test -bench` run):
//
//	go test -run '^$' -bench 'ZMQ|RawTCP' ./engine/pd/zmqlink/

type zmqCase struct {
	name   string
	size   int // bytes per message
	frames int // the message is split into this many frames
	conns  int // Outboxes (so sockets and sender goroutines) to the Inbox
	opts   SocketOptions
}

const mib = 1 << 20

var zmqCases = []zmqCase{
	{name: "1MiB/default", size: mib, frames: 1, conns: 1},
	{name: "1MiB/buf4MiB", size: mib, frames: 1, conns: 1, opts: SocketOptions{SndBuf: 4 * mib, RcvBuf: 4 * mib}},
	{name: "1MiB/hwm8", size: mib, frames: 1, conns: 1, opts: SocketOptions{HWM: 8}},
	{name: "1MiB/hwm256", size: mib, frames: 1, conns: 1, opts: SocketOptions{HWM: 256}},
	{name: "1MiB/4x256KiB-frames", size: mib, frames: 4, conns: 1},
	{name: "1MiB/2conns", size: mib, frames: 1, conns: 2},
	{name: "1MiB/4conns", size: mib, frames: 1, conns: 4},
	{name: "256KiB/default", size: mib / 4, frames: 1, conns: 1},
	{name: "4MiB/default", size: 4 * mib, frames: 1, conns: 1},
	{name: "128KiB/4x32KiB-frames", size: mib / 8, frames: 4, conns: 1}, // a tiny model's KV_CHUNK
	{name: "128KiB/4x32KiB-buf4MiB", size: mib / 8, frames: 4, conns: 1, opts: SocketOptions{SndBuf: 4 * mib, RcvBuf: 4 * mib}},
	{name: "1KiB/default", size: 1 << 10, frames: 1, conns: 1},
	{name: "1KiB/hwm8", size: 1 << 10, frames: 1, conns: 1, opts: SocketOptions{HWM: 8}},
	{name: "4MiB/buf4MiB", size: 4 * mib, frames: 1, conns: 1, opts: SocketOptions{SndBuf: 4 * mib, RcvBuf: 4 * mib}},
	// Connection authentication, beside 4MiB/default (none): PLAIN with a
	// ZAP handler (SocketOptions.Auth), checked once per connection, and
	// CURVE, which also encrypts every byte.
	{name: "4MiB/plain", size: 4 * mib, frames: 1, conns: 1, opts: SocketOptions{Auth: &benchAuth}},
	{name: "4MiB/curve", size: 4 * mib, frames: 1, conns: 1, opts: SocketOptions{Curve: benchCurve}},
	{name: "1MiB/plain", size: mib, frames: 1, conns: 1, opts: SocketOptions{Auth: &benchAuth}},
	// What a cluster with a secret runs: CURVE on the control sockets,
	// whose messages are small (beside 1KiB/default), and the rotating
	// PLAIN credential on the KV sockets (beside 4MiB/default).
	{name: "1KiB/curve", size: 1 << 10, frames: 1, conns: 1, opts: SocketOptions{Curve: benchCurve}},
	{name: "4MiB/rotating", size: 4 * mib, frames: 1, conns: 1, opts: SocketOptions{Rotating: benchRotating}},
}

var (
	benchAuth     = PlainAuth{Username: "pdkit", Password: strings.Repeat("c3", 32)}
	benchCurve    = mustCurveKeys("pdkit-bench")
	benchRotating = &RotatingAuth{
		Credential: func(time.Time) (string, string) { return "pdkit-kv/0/bench", "bench" },
		Admit:      func(u, p []byte, _ time.Time) bool { return string(u) == "pdkit-kv/0/bench" && string(p) == "bench" },
		Rotate:     time.Hour,
	}
)

func mustCurveKeys(seed string) *CurveKeys {
	k, err := CurveKeysFrom(seed)
	if err != nil {
		panic(err)
	}
	return k
}

func BenchmarkZMQ(b *testing.B) {
	for _, be := range backends {
		for _, c := range zmqCases {
			c.opts.ZeroCopy = be.zc
			b.Run(be.name+"/"+c.name, func(b *testing.B) { benchZMQ(b, c) })
		}
	}
}

func benchZMQ(b *testing.B, c zmqCase) {
	payload := make([]byte, c.size)
	for i := range payload {
		payload[i] = byte(i)
	}
	frames := make([][]byte, c.frames)
	step := c.size / c.frames
	for i := range frames {
		frames[i] = payload[i*step : (i+1)*step]
	}
	var got, warm atomic.Int64
	all := make(chan struct{})
	want := int64(b.N)
	h := func(fr [][]byte) error {
		if len(fr) == 1 && len(fr[0]) == 1 { // a connecting message
			warm.Add(1)
			return nil
		}
		if got.Add(1) == want {
			close(all)
		}
		return nil
	}
	in, err := Listen("tcp://127.0.0.1:0", h, &InboxOptions{SocketOptions: c.opts})
	if err != nil {
		b.Fatal(err)
	}
	defer in.Close()
	outs := make([]*Outbox, c.conns)
	for i := range outs {
		if outs[i], err = NewOutbox(&OutboxOptions{SocketOptions: c.opts}); err != nil {
			b.Fatal(err)
		}
		defer outs[i].Close()
		// Connect before timing.
		if err := outs[i].Send(context.Background(), in.Endpoint(), [][]byte{{0}}); err != nil {
			b.Fatal(err)
		}
	}
	for warm.Load() < int64(c.conns) {
		runtime.Gosched()
	}
	b.SetBytes(int64(c.size))
	b.ResetTimer()
	var wg sync.WaitGroup
	for k, out := range outs {
		n := b.N / c.conns
		if k < b.N%c.conns {
			n++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range n {
				if err := out.Send(context.Background(), in.Endpoint(), frames); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	<-all
	b.StopTimer()
}

// BenchmarkRawTCP writes 1 MiB and 4 MiB buffers over a loopback
// net.Conn. "reuse" reads into one buffer, as a hand-written Go transport
// would; "alloc" allocates each message, as pebbe/zmq4's receive does.
func BenchmarkRawTCP(b *testing.B) {
	for _, size := range []int{mib, 4 * mib} {
		for _, alloc := range []bool{false, true} {
			name := fmt.Sprintf("%dMiB/reuse", size/mib)
			if alloc {
				name = fmt.Sprintf("%dMiB/alloc", size/mib)
			}
			b.Run(name, func(b *testing.B) { benchRawTCP(b, size, alloc) })
		}
	}
}

func benchRawTCP(b *testing.B, size int, alloc bool) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() {
		conn, err := l.Accept()
		if err != nil {
			done <- err
			return
		}
		defer conn.Close()
		buf := make([]byte, size)
		for range b.N {
			if alloc {
				buf = make([]byte, size)
			}
			if _, err := io.ReadFull(conn, buf); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	payload := make([]byte, size)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for range b.N {
		if _, err := conn.Write(payload); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
}

// BenchmarkAuthCost measures what connection authentication costs the
// KV path, with the two sides interleaved so that both see the same
// machine: each round sends a burst of 4 MiB messages over a pair without
// authentication, then over a pair with PLAIN (the order alternates), and
// times each. It reports each side's MB/s and their ratio (plain/none).
func BenchmarkAuthCost(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			none := newBenchPair(b, SocketOptions{ZeroCopy: be.zc})
			plain := newBenchPair(b, SocketOptions{ZeroCopy: be.zc, Auth: &benchAuth})
			frames := [][]byte{make([]byte, 4*mib)}
			const burst = 8
			b.SetBytes(2 * burst * 4 * mib)
			b.ResetTimer()
			var tNone, tPlain time.Duration
			for i := range b.N {
				if i%2 == 0 {
					tNone += none.burst(b, burst, frames)
					tPlain += plain.burst(b, burst, frames)
				} else {
					tPlain += plain.burst(b, burst, frames)
					tNone += none.burst(b, burst, frames)
				}
			}
			b.StopTimer()
			bytes := float64(b.N) * burst * 4 * mib / 1e6
			b.ReportMetric(bytes/tNone.Seconds(), "none-MB/s")
			b.ReportMetric(bytes/tPlain.Seconds(), "plain-MB/s")
			b.ReportMetric(tNone.Seconds()/tPlain.Seconds(), "plain/none")
		})
	}
}

// benchPair is an Outbox connected to an Inbox that counts what it gets.
type benchPair struct {
	in   *Inbox
	out  *Outbox
	got  atomic.Int64
	sent int64
}

func newBenchPair(b *testing.B, o SocketOptions) *benchPair {
	p := &benchPair{}
	in, err := Listen("tcp://127.0.0.1:0", func([][]byte) error { p.got.Add(1); return nil }, &InboxOptions{SocketOptions: o})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { in.Close() })
	out, err := NewOutbox(&OutboxOptions{SocketOptions: o})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { out.Close() })
	p.in, p.out = in, out
	p.burst(b, 1, [][]byte{{0}}) // connect (and authenticate) before timing
	return p
}

// burst sends n messages and waits until the Inbox has them all.
func (p *benchPair) burst(b *testing.B, n int, frames [][]byte) time.Duration {
	start := time.Now()
	for range n {
		if err := p.out.Send(context.Background(), p.in.Endpoint(), frames); err != nil {
			b.Fatal(err)
		}
	}
	p.sent += int64(n)
	for p.got.Load() < p.sent {
		runtime.Gosched()
	}
	return time.Since(start)
}
