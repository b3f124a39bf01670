package zmqlink

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// openFDs counts the process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(ents)
}

// TestRedTeamPeerSocketsBounded: messages to 3,000 distinct endpoints (as a
// flood of ABORTs or heartbeats naming a fresh reply endpoint each makes a
// prefill send) keep the open peer sockets within MaxPeers: the least
// recently used peers are evicted and counted, the process's descriptors
// come back to a bound, and a real peer is served afterwards. Nothing
// listens on the endpoints. (libzmq frees a closed socket's slot on its
// reaper thread a little later, so during the burst a few messages may
// fail on its socket cap, counted as send errors; the cap never stays
// reached.)
func TestRedTeamPeerSocketsBounded(t *testing.T) {
	checkGoroutines(t)
	const endpoints, maxPeers = 3000, 64
	eachBackend(t, func(t *testing.T, zc bool) {
		fds := openFDs(t)
		out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc}, MaxPeers: maxPeers})
		if err != nil {
			t.Fatal(err)
		}
		defer out.Close()
		most := 0
		for i := range endpoints {
			ep := fmt.Sprintf("tcp://127.0.0.1:%d", 1+i) // privileged ports: refused
			// Replies to endpoints the attacker names go through Offer.
			if err := out.Offer(context.Background(), ep, [][]byte{[]byte("ack")}); err != nil {
				t.Fatal(err)
			}
			most = max(most, out.Stats().Peers)
		}
		waitfor.For(t, "every message handed to ZeroMQ or failed", 30*time.Second, func() bool {
			s := out.Stats()
			return s.Sent+s.SendErrors+s.Dropped == endpoints
		})
		s := out.Stats()
		if most > maxPeers || s.Peers > maxPeers {
			t.Errorf("open peer sockets: at most %d seen, %d now; the cap is %d", most, s.Peers, maxPeers)
		}
		if s.Evicted < endpoints-maxPeers-s.SendErrors {
			t.Errorf("evicted %d peers, want %d (%d send errors)", s.Evicted, endpoints-maxPeers, s.SendErrors)
		}
		// Each libzmq socket holds a descriptor or two; 3,000 would be far
		// past this.
		waitfor.For(t, "the closed sockets' descriptors freed", 30*time.Second, func() bool { return openFDs(t)-fds <= 4*maxPeers })
		got := make(chan string, 1)
		in, err := Listen("tcp://127.0.0.1:0", func(f [][]byte) error { got <- string(f[0]); return nil }, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		if err := out.Send(context.Background(), in.Endpoint(), [][]byte{[]byte("real")}); err != nil {
			t.Fatal(err)
		}
		if m := <-got; m != "real" {
			t.Fatalf("the real peer got %q", m)
		}
		t.Logf("peers at most %d, evicted %d, send errors during the burst %d", most, s.Evicted, s.SendErrors)
	})
}

// TestOutboxClosesIdlePeers: a peer nothing was sent to for PeerIdle is
// closed and counted; the next message connects again and arrives.
func TestOutboxClosesIdlePeers(t *testing.T) {
	checkGoroutines(t)
	got := make(chan string, 4)
	in, err := Listen("tcp://127.0.0.1:0", func(f [][]byte) error { got <- string(f[0]); return nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := NewOutbox(&OutboxOptions{PeerIdle: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	for _, msg := range []string{"one", "two"} {
		if err := out.Send(context.Background(), in.Endpoint(), [][]byte{[]byte(msg)}); err != nil {
			t.Fatal(err)
		}
		if m := <-got; m != msg {
			t.Fatalf("got %q, want %q", m, msg)
		}
		waitfor.For(t, "the idle peer closed", 5*time.Second, func() bool { return out.Stats().Peers == 0 })
	}
	if s := out.Stats(); s.IdleClosed != 2 {
		t.Errorf("idle closed %d peers, want 2", s.IdleClosed)
	}
}

// TestOutboxOfferNeverWaitsOnAPeer: Offer to a peer with MaxPending
// messages pending fails at once, counted, while Send would wait.
func TestOutboxOfferNeverWaitsOnAPeer(t *testing.T) {
	checkGoroutines(t)
	out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{HWM: 1}, MaxPending: 2, SendTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	const dead = "tcp://127.0.0.1:1"
	for range 10 { // one to libzmq's pipe, two held: the rest refused
		_ = out.Offer(context.Background(), dead, [][]byte{[]byte("ack")})
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // Offer must not need ctx to refuse
	waitfor.For(t, "the peer's slots full", 5*time.Second, func() bool {
		return out.Offer(ctx, dead, [][]byte{[]byte("ack")}) != nil && out.Stats().Backlog == 2
	})
	if s := out.Stats(); s.QueueFull == 0 {
		t.Errorf("refused offers not counted: %+v", s)
	}
}

// TestOutboxForgetsClosedPeersSemaphores: the per-peer semaphores go with
// their sockets, so 3,000 endpoints leave no more of them than sockets.
func TestOutboxForgetsClosedPeersSemaphores(t *testing.T) {
	checkGoroutines(t)
	const endpoints, maxPeers = 3000, 16
	out, err := NewOutbox(&OutboxOptions{MaxPeers: maxPeers})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	for i := range endpoints {
		if err := out.Offer(context.Background(), fmt.Sprintf("tcp://127.0.0.1:%d", 1+i), [][]byte{[]byte("ack")}); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "every message handed to ZeroMQ or failed", 30*time.Second, func() bool {
		s := out.Stats()
		return s.Sent+s.SendErrors+s.Dropped == endpoints
	})
	n := 0
	out.credits.Range(func(any, any) bool { n++; return true })
	if n > maxPeers {
		t.Errorf("%d per-peer semaphores kept for %d open peers", n, out.Stats().Peers)
	}
}

// TestOutboxEvictionSparesBusyPeers: at MaxPeers a new peer evicts the
// least recently used peer that holds no backlog, not an older one at its
// high-water mark, whose held messages eviction would drop.
func TestOutboxEvictionSparesBusyPeers(t *testing.T) {
	checkGoroutines(t)
	out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{HWM: 1}, MaxPeers: 2, SendTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	send := func(ep string) {
		t.Helper()
		if err := out.Send(context.Background(), ep, [][]byte{[]byte("m")}); err != nil {
			t.Fatal(err)
		}
	}
	offer := func(ep string) {
		t.Helper()
		if err := out.Offer(context.Background(), ep, [][]byte{[]byte("m")}); err != nil {
			t.Fatal(err)
		}
	}
	busy, idle := "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
	for range 4 { // one in libzmq's pipe, the rest held
		send(busy)
	}
	waitfor.For(t, "the busy peer's backlog", 5*time.Second, func() bool { return out.Stats().Backlog > 0 })
	offer(idle)
	offer("tcp://127.0.0.1:3")
	// The new peer's socket is counted after the eviction that made its room.
	waitfor.For(t, "an eviction and the new peer", 5*time.Second, func() bool { s := out.Stats(); return s.Evicted == 1 && s.Peers == 2 })
	if s := out.Stats(); s.Dropped != 0 || s.Backlog == 0 || s.Peers != 2 {
		t.Errorf("the busy peer was evicted: %+v", s)
	}
}

// TestOutboxEvictionSparesStreams: a peer Send has been streaming to keeps
// its socket when a flood of Offers to new endpoints reaches MaxPeers, even
// with no backlog of its own: libzmq may still hold messages for it that
// closing the socket would drop although Send counted them sent. The
// Outbox goes over its bound instead, and the stream arrives whole.
func TestOutboxEvictionSparesStreams(t *testing.T) {
	checkGoroutines(t)
	release := make(chan struct{})
	var got atomic.Int64
	in, err := Listen("tcp://127.0.0.1:0", func([][]byte) error {
		<-release
		got.Add(1)
		return nil
	}, &InboxOptions{SocketOptions: SocketOptions{HWM: 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := NewOutbox(&OutboxOptions{MaxPeers: 1, SendTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	const n = 40
	for range n {
		if err := out.Send(context.Background(), in.Endpoint(), [][]byte{make([]byte, 64<<10)}); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "the stream handed to ZeroMQ", 10*time.Second, func() bool { s := out.Stats(); return s.Sent+uint64(s.Backlog) >= n })
	if err := out.Offer(context.Background(), "tcp://127.0.0.1:1", [][]byte{[]byte("ack")}); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the offer handed over", 10*time.Second, func() bool { s := out.Stats(); return s.Sent+s.SendErrors+uint64(s.Backlog) > n })
	close(release)
	waitfor.For(t, "the whole stream received", 20*time.Second, func() bool { return got.Load() == n })
	if s := out.Stats(); s.Evicted != 0 {
		t.Errorf("the stream's peer was evicted: %+v", s)
	}
}
