package zmqlink

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// scriptedProbe is the kernel as a test scripts it: each descriptor's
// peer, whether its peer is past the handshake, and whether it is open.
type scriptedProbe struct {
	peers map[int32]netip.AddrPort
	past  map[int32]bool
	shut  []int32
}

func newScriptedProbe() *scriptedProbe {
	return &scriptedProbe{peers: map[int32]netip.AddrPort{}, past: map[int32]bool{}}
}

func (p *scriptedProbe) peer(fd int32) (netip.AddrPort, bool) {
	a, ok := p.peers[fd]
	return a, ok
}
func (p *scriptedProbe) handshaken(fd int32) bool { return p.past[fd] }
func (p *scriptedProbe) shutdown(fd int32, peer netip.AddrPort) bool {
	if a, ok := p.peers[fd]; !ok || a != peer {
		return false
	}
	p.shut = append(p.shut, fd)
	return true
}

// capScript drives a connCap through accepts and hang-ups.
type capScript struct {
	t     *testing.T
	c     *connCap
	p     *scriptedProbe
	now   time.Time
	port  uint16
	shut0 int
}

func newCapScript(t *testing.T, max, pending, perAddr int) *capScript {
	p := newScriptedProbe()
	return &capScript{t: t, p: p, now: time.Unix(1000, 0), port: 40000,
		c: newConnCap(max, pending, perAddr, 10*time.Second, p)}
}

// accept has fd connect from addr and the cap read its accept.
func (s *capScript) accept(fd int32, addr string) {
	s.port++
	s.p.peers[fd] = netip.AddrPortFrom(netip.MustParseAddr(addr), s.port)
	s.c.event(eventAccepted, fd, s.now)
}

// hangUp ends fd and has the cap read its hang-up.
func (s *capScript) hangUp(fd int32) bool {
	delete(s.p.peers, fd)
	return s.c.event(eventDisconnected, fd, s.now)
}

// expectShut checks the descriptors shut since the last check.
func (s *capScript) expectShut(what string, fds ...int32) {
	s.t.Helper()
	got := s.p.shut[s.shut0:]
	s.shut0 = len(s.p.shut)
	if fmt.Sprint(got) != fmt.Sprint(append([]int32{}, fds...)) {
		s.t.Fatalf("%s: shut %v, want %v", what, got, fds)
	}
}

func (s *capScript) expectCounts(what string, open, pending int64, refused, shed uint64) {
	s.t.Helper()
	c := s.c
	if c.open.Load() != open || c.pendingNow.Load() != pending || c.refused.Load() != refused || c.shed.Load() != shed {
		s.t.Fatalf("%s: %d open, %d pending, %d refused, %d shed; want %d, %d, %d, %d", what,
			c.open.Load(), c.pendingNow.Load(), c.refused.Load(), c.shed.Load(), open, pending, refused, shed)
	}
}

// A source's silent connections shed one another, oldest first, and
// leave the rest of the places alone; a member's connection, past its
// handshake, keeps its place however many come after it.
func TestConnCapShedsASourcesOldestPending(t *testing.T) {
	s := newCapScript(t, 8, 4, 2)
	s.accept(10, "10.0.0.1") // a member
	s.p.past[10] = true
	for fd := int32(20); fd < 30; fd++ {
		s.accept(fd, "10.0.0.66")
	}
	s.expectShut("ten from one source, two pending places each", 20, 21, 22, 23, 24, 25, 26, 27)
	s.expectCounts("the flood", 3, 3, 8, 8) // the member is pending until room is needed from its own source
	if got := *s.c.lastShed.Load(); !strings.Contains(got, "10.0.0.66/32") {
		t.Fatalf("last shed %q: want it to name the source", got)
	}
	s.accept(11, "10.0.0.1")
	s.p.past[11] = true
	s.accept(12, "10.0.0.1") // the source at its bound: its connections, past the handshake, are not shed
	s.expectShut("the member's source at its bound")
	s.expectCounts("two more from the member's host", 5, 3, 8, 8)
	s.accept(13, "10.0.0.1")
	s.accept(14, "10.0.0.1")
	s.expectShut("the member's host, two silent and one more", 12)
	if capped := s.hangUp(28); capped {
		t.Fatal("the hang-up of a connection the cap kept was taken for a shed one")
	}
	if capped := s.hangUp(20); !capped {
		t.Fatal("the hang-up of a shed connection was not counted as the cap's")
	}
	s.expectCounts("hang-ups", 5, 3, 9, 9)
}

// Sources at their own bound but many of them: the pending connections as
// a whole are bounded, and the oldest of all is shed.
func TestConnCapBoundsPendingAcrossSources(t *testing.T) {
	s := newCapScript(t, 8, 3, 2)
	for i := range int32(6) {
		s.accept(20+i, fmt.Sprintf("10.0.1.%d", i))
	}
	s.expectShut("six sources, three pending places", 20, 21, 22)
	s.expectCounts("the flood", 3, 3, 3, 3)
	if got := *s.c.lastShed.Load(); !strings.Contains(got, "10.0.1.2:") || !strings.Contains(got, "3 unauthenticated") {
		t.Fatalf("last shed %q", got)
	}
}

// Every place held by members: a newcomer is refused, and no member is
// shed for it. One pending among members is shed instead of a newcomer.
func TestConnCapRefusesOnlyWhenMembersHoldEveryPlace(t *testing.T) {
	s := newCapScript(t, 4, 4, 4)
	for fd := int32(10); fd < 14; fd++ {
		s.accept(fd, "10.0.0.1")
		s.p.past[fd] = true
	}
	s.accept(20, "10.0.0.66")
	s.expectShut("a newcomer with every place a member's", 20)
	s.expectCounts("refused", 4, 0, 1, 0)
	if capped := s.hangUp(20); !capped {
		t.Fatal("a refused connection's hang-up")
	}
	s.hangUp(13)
	s.accept(21, "10.0.0.66") // silent
	s.accept(22, "10.0.0.2")  // takes the silent one's place
	s.expectShut("a newcomer at the cap with one pending", 21)
	s.expectCounts("shed for the newcomer", 4, 1, 2, 1)
}

// A connection older than the handshake timeout is past its handshake
// (libzmq would have closed it otherwise), where the kernel cannot tell.
func TestConnCapTakesTheHandshakeTimeoutAsProof(t *testing.T) {
	s := newCapScript(t, 8, 2, 2)
	s.accept(10, "10.0.0.1")
	s.now = s.now.Add(11 * time.Second)
	s.accept(20, "10.0.0.1")
	s.accept(21, "10.0.0.1")
	s.expectShut("past the timeout, a member", 20)
}

// A descriptor reused by a new connection before the cap read the old
// one's hang-up is not shut for the old one.
func TestConnCapSparesAReusedDescriptor(t *testing.T) {
	s := newCapScript(t, 8, 1, 1)
	s.accept(20, "10.0.0.66")
	s.p.peers[20] = netip.MustParseAddrPort("10.0.0.66:9") // closed and reused; events not yet read
	s.accept(21, "10.0.0.66")
	s.expectShut("the reused descriptor")
	s.expectCounts("the old entry dropped", 1, 1, 0, 0)
}

// IPv6 sources are /64s: one host's addresses share a bound.
func TestConnCapBoundsAnIPv6Slash64(t *testing.T) {
	s := newCapScript(t, 8, 4, 1)
	s.accept(20, "2001:db8::1")
	s.accept(21, "2001:db8::2")
	s.accept(22, "2001:db8:0:1::1")
	s.expectShut("two in one /64", 20)
}

// A connection whose hang-up the monitor dropped is found when the cap is
// reached: the descriptors remembered are no longer connections on the
// port, so they are forgotten and the new connection takes a place.
func TestConnCapForgetsLostHangUps(t *testing.T) {
	s := newCapScript(t, 2, 2, 2)
	s.accept(10, "10.0.0.1")
	s.accept(11, "10.0.0.2")
	s.p.past[10], s.p.past[11] = true, true
	delete(s.p.peers, 10) // hang-ups lost
	delete(s.p.peers, 11)
	s.accept(12, "10.0.0.3")
	s.expectShut("the cap reached by lost hang-ups")
	if _, ok := s.c.live[12]; !ok || s.c.open.Load() != 1 {
		t.Fatalf("live %v: want only the last accept", s.c.live)
	}
}

// TestRedTeamSilentConnectionsCannotShutMembersOut: a stranger with no
// credential opens twice MaxConnections silent connections to an Inbox
// from one address, and reopens them as they are shut. A member connected
// before keeps its connection, and a member that connects during the
// flood gets in: the stranger's source holds at most its pending places,
// whatever the flood's rate. Both backends, with and without Auth. Before
// the pending bounds, the first MaxConnections silent connections held
// every place until the handshake timeout (here a minute), and the
// newcomer was refused. From many sources the member must pass its
// handshake before the pending bound's worth of newer connections
// arrive, a race against the flood's rate that a loaded machine can
// lose; it runs with -tags redteam (conns_redteam_test.go).
func TestRedTeamSilentConnectionsCannotShutMembersOut(t *testing.T) {
	for _, b := range backends {
		for _, auth := range []*PlainAuth{nil, &testAuth} {
			t.Run(fmt.Sprintf("%s/auth=%v", b.name, auth != nil), func(t *testing.T) {
				testSilentFlood(t, b.zc, auth, 1)
			})
		}
	}
}

func testSilentFlood(t *testing.T, zc bool, auth *PlainAuth, sources int) {
	checkGoroutines(t)
	const limit = 16
	var c collector
	in, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth},
		HandshakeTimeout: time.Minute, MaxConnections: limit})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	member := func() *Outbox {
		out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { out.Close() })
		return out
	}
	before := member()
	if err := before.Send(ctx, in.Endpoint(), msg(1)); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the first member's message", 10*time.Second, func() bool { return c.len() == 1 })

	// The flood: 2×limit silent connections, each reopened once it is
	// shut, until the member that comes during it has got in.
	addr := strings.TrimPrefix(in.Endpoint(), "tcp://")
	stop := make(chan struct{})
	done := make(chan struct{})
	opened := make(chan struct{}, 1)
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		ended := make(chan int, 4*limit)
		dial := func(i int) {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1, byte(1+i%sources))}}
			conn, err := d.Dial("tcp", addr)
			if err != nil {
				return
			}
			conns = append(conns, conn)
			go func() {
				readUntilEnd(conn, time.Minute)
				ended <- i
			}()
		}
		for i := range 2 * limit {
			dial(i)
		}
		opened <- struct{}{}
		for {
			select {
			case <-stop:
				return
			case i := <-ended:
				dial(i)
			}
		}
	}()
	<-opened
	waitfor.For(t, "the flood past the cap", 10*time.Second, func() bool { return in.Stats().ConnectionsRefused >= limit })

	during := member()
	if err := during.Send(ctx, in.Endpoint(), msg(2)); err != nil {
		t.Fatal(err)
	}
	if err := before.Send(ctx, in.Endpoint(), msg(3)); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "both members' messages during the flood", 10*time.Second, func() bool { return c.len() == 3 })
	s := in.Stats()
	close(stop)
	<-done
	maxPending, perAddr := pendingBounds(limit, 0, 0)
	if held := min(maxPending, sources*perAddr); s.ConnectionsPending > int64(held)+2 {
		t.Errorf("%d connections pending during the flood: want at most %d and the two members'", s.ConnectionsPending, held)
	}
	if s.ConnectionsRefused != s.ConnectionsShed || s.LastShed == "" || !strings.Contains(s.LastShed, "127.0.1.") {
		t.Errorf("refused %d, shed %d, last shed %q: want every refusal a pending one shed, the last named", s.ConnectionsRefused, s.ConnectionsShed, s.LastShed)
	}
	if s.Disconnects != 0 {
		t.Errorf("%d disconnects: the member connected before the flood lost its connection", s.Disconnects)
	}
}

// TestRedTeamConnectionFlood: members hold every place; one more is
// refused at once and counted, and gets in once a place is freed. Both
// backends, with and without Auth (each has its own monitor).
func TestRedTeamConnectionFlood(t *testing.T) {
	for _, b := range backends {
		for _, auth := range []*PlainAuth{nil, &testAuth} {
			t.Run(fmt.Sprintf("%s/auth=%v", b.name, auth != nil), func(t *testing.T) {
				testMembersFill(t, b.zc, auth)
			})
		}
	}
}

func testMembersFill(t *testing.T, zc bool, auth *PlainAuth) {
	checkGoroutines(t)
	const limit = 4
	var c collector
	in, err := Listen("tcp://127.0.0.1:0", c.handle, &InboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth},
		HandshakeTimeout: time.Minute, MaxConnections: limit})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	outs := make([]*Outbox, limit+1)
	for i := range outs {
		out, err := NewOutbox(&OutboxOptions{SocketOptions: SocketOptions{ZeroCopy: zc, Auth: auth}})
		if err != nil {
			t.Fatal(err)
		}
		defer out.Close()
		outs[i] = out
	}
	for i, out := range outs[:limit] {
		if err := out.Send(ctx, in.Endpoint(), msg(i)); err != nil {
			t.Fatal(err)
		}
		waitfor.For(t, "a member's message", 10*time.Second, func() bool { return c.len() == i+1 })
	}
	// With Auth a refused connection is shut before its handshake is
	// answered, so nothing comes through it; without, the handshake needs
	// no answer from the Inbox and a message may slip through, or be
	// lost with the connection, before the shutdown: the member sends
	// again.
	if err := outs[limit].Send(ctx, in.Endpoint(), msg(limit)); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "the member past the cap refused", 10*time.Second, func() bool { return in.Stats().ConnectionsRefused >= 1 })
	if s := in.Stats(); s.ConnectionsShed != 0 || s.Connections != limit {
		t.Fatalf("%d shed, %d open: want no member shed for the newcomer", s.ConnectionsShed, s.Connections)
	}
	if auth != nil && c.len() != limit {
		t.Fatal("a message came through a connection past the cap")
	}
	outs[0].Close()
	if auth == nil {
		if err := outs[limit].Send(ctx, in.Endpoint(), msg(limit+1)); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.For(t, "the refused member's message, once a place was freed", 10*time.Second, func() bool { return c.len() >= limit+1 })
}
