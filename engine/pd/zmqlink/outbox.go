package zmqlink

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// OutboxOptions configure an Outbox. The zero value is usable.
type OutboxOptions struct {
	// SocketOptions apply to every peer socket; HWM is the per-peer send
	// high-water mark in messages (default 64).
	SocketOptions
	// QueueSize bounds the queue between Send and the sender goroutine
	// (default 256 messages).
	QueueSize int
	// Linger is ZMQ_LINGER of the peer sockets: how long messages still
	// queued in ZeroMQ may delay closing a socket (default 100ms), so
	// Close and Forget never hang on a dead peer.
	Linger time.Duration
	// MaxPending bounds the messages accepted by Send for one peer and not
	// yet handed to ZeroMQ (queued, or held while the peer's socket is at
	// its high-water mark); default 256. Send waits, up to its context,
	// while a peer has that many: a slow or dead peer pushes back on its
	// own senders without stalling the other peers.
	MaxPending int
	// SendTimeout is how long a message may be held for a peer at its
	// high-water mark before it is dropped and counted (default 5s).
	SendTimeout time.Duration
	// RetryInterval is how long the sender waits for a backlogged peer to
	// become writable before it looks at the queue again (default 5ms).
	RetryInterval time.Duration
	// CloseTimeout bounds Close and Forget (default 5s).
	CloseTimeout time.Duration
	// MaxPeers bounds the open peer sockets (default 256): a message for a
	// new peer beyond it closes the least recently used one first (one at
	// its high-water mark only when all are), dropping what it still held
	// (counted in Evicted and Dropped). Peers come from
	// what other processes name (a reply endpoint), so without a bound
	// every endpoint ever named would keep a socket open.
	MaxPeers int
	// PeerIdle closes a peer socket nothing was sent on for this long and
	// that holds nothing (default 1m; counted in IdleClosed); the next
	// message connects again.
	PeerIdle time.Duration
}

const (
	defaultOutboxHWM = 64
	// DefaultMaxPeers and DefaultPeerIdle are OutboxOptions' defaults.
	DefaultMaxPeers = 256
	DefaultPeerIdle = time.Minute
)

// OutboxStats is a snapshot of an Outbox's counters.
type OutboxStats struct {
	Alive      bool   `json:"alive"`
	Peers      int    `json:"peers"`       // connected peer sockets
	Queued     int    `json:"queued"`      // messages waiting in the send queue
	Backlog    int    `json:"backlog"`     // messages held for peers at their HWM
	Sent       uint64 `json:"sent"`        // messages handed to ZeroMQ
	Bytes      uint64 `json:"bytes"`       // payload bytes of those messages
	SendErrors uint64 `json:"send_errors"` // connect or send failures (message dropped)
	Dropped    uint64 `json:"dropped"`     // backlog overflow or timeout, forgotten peer, or Close
	QueueFull  uint64 `json:"queue_full"`  // Send or Offer calls refused: the queue or the peer's pending slots stayed full
	Evicted    uint64 `json:"evicted"`     // peer sockets closed to stay within MaxPeers
	IdleClosed uint64 `json:"idle_closed"` // peer sockets closed after PeerIdle without a message
	Rotated    uint64 `json:"rotated"`     // peer sockets made anew for a fresh rotating credential
	LastError  string `json:"last_error,omitempty"`
}

type outItem struct {
	endpoint string
	frames   [][]byte
	at       time.Time
	credit   chan struct{} // the peer's semaphore; released when the item is done
	pin      *pinned       // the frames, pinned from the first send attempt
	sent     bool          // from Send (a stream the caller waits on), not Offer
}

type forgetReq struct {
	endpoint string
	reply    chan struct{}
}

type peer struct {
	endpoint string
	sock     zSocket
	backlog  []outItem
	made     time.Time     // when the socket was made (and its credential)
	used     time.Time     // the last message for the peer
	sent     time.Time     // the last message Send (not Offer) gave it
	lru      *list.Element // the peer's place in sender.lru
}

// Outbox sends multipart messages to peers over PUSH sockets, all owned by
// one sender goroutine. Messages to one peer leave in Send order.
type Outbox struct {
	opts OutboxOptions

	queue   chan outItem
	forget  chan forgetReq
	credits sync.Map // endpoint -> chan struct{} of capacity MaxPending
	freed   *freeBox // messages libzmq has released, to unpin
	closing chan struct{}
	done    chan struct{}

	closeOnce sync.Once
	closeErr  error

	alive      atomic.Bool
	peers      atomic.Int64
	backlog    atomic.Int64
	sent       atomic.Uint64
	bytes      atomic.Uint64
	sendErrors atomic.Uint64
	dropped    atomic.Uint64
	queueFull  atomic.Uint64
	evicted    atomic.Uint64
	idleClosed atomic.Uint64
	rotated    atomic.Uint64
	lastError  atomic.Pointer[string]
}

// NewOutbox starts an Outbox's sender goroutine.
func NewOutbox(opts *OutboxOptions) (*Outbox, error) {
	o := &Outbox{}
	if opts != nil {
		o.opts = *opts
	}
	d := &o.opts
	if d.HWM <= 0 {
		d.HWM = defaultOutboxHWM
	}
	if d.QueueSize <= 0 {
		d.QueueSize = 256
	}
	if d.Linger <= 0 {
		d.Linger = 100 * time.Millisecond
	}
	if d.MaxPending <= 0 {
		d.MaxPending = 256
	}
	if d.SendTimeout <= 0 {
		d.SendTimeout = 5 * time.Second
	}
	if d.RetryInterval <= 0 {
		d.RetryInterval = 5 * time.Millisecond
	}
	if d.CloseTimeout <= 0 {
		d.CloseTimeout = 5 * time.Second
	}
	if d.MaxPeers <= 0 {
		d.MaxPeers = DefaultMaxPeers
	}
	if d.PeerIdle <= 0 {
		d.PeerIdle = DefaultPeerIdle
	}
	o.freed = newFreeBox()
	ctx, err := newContext(d.SocketOptions, o.freed)
	if err != nil {
		return nil, err
	}
	o.queue = make(chan outItem, d.QueueSize)
	o.forget = make(chan forgetReq)
	o.closing = make(chan struct{})
	o.done = make(chan struct{})
	o.alive.Store(true)
	go o.run(ctx)
	return o, nil
}

// Send queues a message for endpoint (a ZeroMQ endpoint such as
// "tcp://127.0.0.1:5555"; the first message connects). It returns when the
// message is queued, ErrQueueFull (wrapping ctx's error) when the queue
// stays full until ctx ends, or ErrClosed. The Outbox owns frames from
// then on: the caller must not modify them (with SocketOptions.ZeroCopy,
// frames of 32 KiB or more go to the socket without a copy, so libzmq may
// read them until it has written them out, after Stats counts them as
// sent). A nil error means queued, not delivered.
func (o *Outbox) Send(ctx context.Context, endpoint string, frames [][]byte) error {
	return o.enqueue(ctx, endpoint, frames, true)
}

// Offer is Send for a message that must never hold up its caller on one
// peer, such as a reply to an endpoint another process named: when
// endpoint already has MaxPending messages pending it fails at once
// (ErrQueueFull, counted), where Send would wait. It still waits, up to
// ctx, for room in the queue, which the sender goroutine drains without
// ever blocking on a peer.
func (o *Outbox) Offer(ctx context.Context, endpoint string, frames [][]byte) error {
	return o.enqueue(ctx, endpoint, frames, false)
}

// enqueue takes one of endpoint's pending slots, waiting up to ctx for one
// when waitPeer, and queues the message.
func (o *Outbox) enqueue(ctx context.Context, endpoint string, frames [][]byte, waitPeer bool) error {
	if len(frames) == 0 {
		return errors.New("zmqlink: empty message")
	}
	select {
	case <-o.closing:
		return ErrClosed
	default:
	}
	credit := o.credit(endpoint)
	select {
	case credit <- struct{}{}:
	default:
		if !waitPeer {
			o.queueFull.Add(1)
			return fmt.Errorf("%w: %d messages pending for %s", ErrQueueFull, cap(credit), endpoint)
		}
		select {
		case credit <- struct{}{}:
		case <-ctx.Done():
			o.queueFull.Add(1)
			return fmt.Errorf("%w: %d messages pending for %s: %w", ErrQueueFull, cap(credit), endpoint, ctx.Err())
		case <-o.closing:
			return ErrClosed
		}
	}
	it := outItem{endpoint: endpoint, frames: frames, at: time.Now(), credit: credit, sent: waitPeer}
	select {
	case o.queue <- it:
		return nil
	default:
	}
	select {
	case o.queue <- it:
		return nil
	case <-ctx.Done():
		<-credit
		o.dropCredit(endpoint) // no socket was made for it: nothing else will
		o.queueFull.Add(1)
		return fmt.Errorf("%w: %w", ErrQueueFull, ctx.Err())
	case <-o.closing:
		<-credit
		return ErrClosed
	}
}

// credit returns endpoint's semaphore of MaxPending slots.
func (o *Outbox) credit(endpoint string) chan struct{} {
	if c, ok := o.credits.Load(endpoint); ok {
		return c.(chan struct{})
	}
	c, _ := o.credits.LoadOrStore(endpoint, make(chan struct{}, o.opts.MaxPending))
	return c.(chan struct{})
}

// done releases the item's slot in its peer's semaphore, and its pinned
// frames once libzmq no longer references them: it was sent or dropped.
func (it *outItem) done() {
	if it.pin != nil {
		it.pin.release()
		it.pin = nil
	}
	<-it.credit
}

// Forget closes the socket to endpoint, dropping (and counting) what is
// still held for it, so that the next Send connects afresh, for a peer
// that restarted. Forgetting an unknown endpoint is a no-op.
func (o *Outbox) Forget(endpoint string) error {
	req := forgetReq{endpoint: endpoint, reply: make(chan struct{})}
	t := time.NewTimer(o.opts.CloseTimeout)
	defer t.Stop()
	select {
	case o.forget <- req:
	case <-o.done:
		return ErrClosed
	case <-t.C:
		return ErrCloseTimeout
	}
	select {
	case <-req.reply:
		return nil
	case <-o.done:
		return nil
	case <-t.C:
		return ErrCloseTimeout
	}
}

// Close stops the sender goroutine: it closes every peer socket (each
// lingering at most Linger) and terminates the context. Messages not yet
// handed to ZeroMQ are dropped and counted. It waits at most CloseTimeout;
// calling it again returns the first result.
func (o *Outbox) Close() error {
	o.closeOnce.Do(func() {
		o.closeErr = stopOwner(o.closing, o.done, o.opts.CloseTimeout)
	})
	return o.closeErr
}

// Alive reports whether the sender goroutine is running.
func (o *Outbox) Alive() bool { return o.alive.Load() }

// Stats returns a snapshot of the counters.
func (o *Outbox) Stats() OutboxStats {
	s := OutboxStats{
		Alive:      o.alive.Load(),
		Peers:      int(o.peers.Load()),
		Queued:     len(o.queue),
		Backlog:    int(o.backlog.Load()),
		Sent:       o.sent.Load(),
		Bytes:      o.bytes.Load(),
		SendErrors: o.sendErrors.Load(),
		Dropped:    o.dropped.Load(),
		QueueFull:  o.queueFull.Load(),
		Evicted:    o.evicted.Load(),
		IdleClosed: o.idleClosed.Load(),
		Rotated:    o.rotated.Load(),
	}
	if p := o.lastError.Load(); p != nil {
		s.LastError = *p
	}
	return s
}

func (o *Outbox) noteError(err error) {
	s := err.Error()
	o.lastError.Store(&s)
}

// sender is the state of the sender goroutine; only it touches sockets.
type sender struct {
	o      *Outbox
	ctx    zContext
	peers  map[string]*peer
	lru    *list.List // the peers, most recently used first
	nBlock int        // peers with a non-empty backlog
}

func (o *Outbox) run(ctx zContext) {
	defer close(o.done)
	s := &sender{o: o, ctx: ctx, peers: map[string]*peer{}, lru: list.New()}
	sweep := time.NewTicker(sweepInterval(o.opts.PeerIdle))
	defer sweep.Stop()
	defer func() {
		s.shutdown()
		o.alive.Store(false)
	}()
	for {
		if s.nBlock == 0 {
			select {
			case it := <-o.queue:
				s.handle(it)
			case req := <-o.forget:
				s.forget(req)
			case now := <-sweep.C:
				s.closeIdle(now)
			case <-o.freed.notify:
				o.freed.drain()
			case <-o.closing:
				return
			}
			continue
		}
		// Some peer is at its HWM: keep taking new work, then wait briefly
		// for a backlogged peer to become writable.
		select {
		case req := <-o.forget:
			s.forget(req)
		case now := <-sweep.C:
			s.closeIdle(now)
		case <-o.freed.notify:
			o.freed.drain()
		case <-o.closing:
			return
		default:
		}
	drain:
		for range cap(o.queue) {
			select {
			case it := <-o.queue:
				s.handle(it)
			default:
				break drain
			}
		}
		s.retry()
	}
}

// sweepInterval is how often the sender looks for idle peers: often
// enough that a peer closes within a fraction of idle past it.
func sweepInterval(idle time.Duration) time.Duration {
	return min(max(idle/4, time.Millisecond), time.Second)
}

// peer returns endpoint's peer, connecting when there is none (after
// evicting the least recently used peer at MaxPeers), as just used.
func (s *sender) peer(endpoint string) (*peer, error) {
	if p := s.peers[endpoint]; p != nil && !s.stale(p) {
		p.used = time.Now()
		s.lru.MoveToFront(p.lru)
		return p, nil
	} else if p != nil {
		s.o.rotated.Add(1)
		s.closePeer(endpoint, p) // lingers as configured: what libzmq holds still leaves
	}
	for len(s.peers) >= s.o.opts.MaxPeers {
		if !s.evict() {
			break // every peer streams: go over the bound rather than drop a stream
		}
	}
	sock, err := s.ctx.socket(kindPUSH)
	if err != nil {
		return nil, fmt.Errorf("zmqlink: new socket: %w", err)
	}
	fail := func(err error) (*peer, error) {
		sock.close()
		return nil, err
	}
	if err := sock.setLinger(s.o.opts.Linger); err != nil {
		return fail(fmt.Errorf("zmqlink: linger: %w", err))
	}
	if err := s.o.opts.apply(sock, true); err != nil {
		return fail(err)
	}
	if err := sock.connect(endpoint); err != nil {
		return fail(fmt.Errorf("zmqlink: connect %s: %w", endpoint, err))
	}
	now := time.Now()
	p := &peer{endpoint: endpoint, sock: sock, made: now, used: now}
	p.lru = s.lru.PushFront(p)
	s.peers[endpoint] = p
	s.o.peers.Add(1)
	return p, nil
}

// stale reports whether p's socket presents a rotating credential older
// than its Rotate and may be made anew: it holds no backlog and has been
// quiet (RotatingAuth.Quiet). A peer never quiet keeps its connection
// (libzmq would present the old credential only on a reconnect).
func (s *sender) stale(p *peer) bool {
	r := s.o.opts.Rotating
	if r == nil || len(p.backlog) > 0 {
		return false
	}
	quiet := r.Quiet
	if quiet <= 0 {
		quiet = DefaultRotateQuiet
	}
	now := time.Now()
	return now.Sub(p.made) >= r.Rotate && now.Sub(p.used) >= quiet
}

func (s *sender) handle(it outItem) {
	p, err := s.peer(it.endpoint)
	if err != nil {
		s.o.sendErrors.Add(1)
		s.o.noteError(err)
		it.done()
		s.o.dropCredit(it.endpoint) // no socket: nothing else will
		return
	}
	if it.sent {
		p.sent = p.used
	}
	if len(p.backlog) > 0 {
		s.hold(p, it)
		return
	}
	if !s.trySend(p, &it) {
		s.hold(p, it)
	}
}

// hold appends it to p's backlog, or drops it when the backlog is full.
func (s *sender) hold(p *peer, it outItem) {
	if len(p.backlog) >= s.o.opts.MaxPending { // cannot happen: Send holds a slot
		s.o.dropped.Add(1)
		it.done()
		return
	}
	if len(p.backlog) == 0 {
		s.nBlock++
	}
	p.backlog = append(p.backlog, it)
	s.o.backlog.Add(1)
}

// trySend sends without waiting. It reports false when the peer is at its
// high-water mark (try again later); any other outcome is final.
// ZeroMQ multipart messages are atomic: once the first frame is accepted
// the rest are, so EAGAIN can only come before anything was sent.
func (s *sender) trySend(p *peer, it *outItem) bool {
	for {
		err := p.sock.send(it.frames, &it.pin)
		switch {
		case err == nil:
			n := 0
			for _, f := range it.frames {
				n += len(f)
			}
			s.o.sent.Add(1)
			s.o.bytes.Add(uint64(n))
			it.done()
			return true
		case isAgain(err):
			return false
		case isIntr(err):
			continue
		default:
			s.o.sendErrors.Add(1)
			s.o.noteError(err)
			it.done()
			return true
		}
	}
}

// retry waits up to RetryInterval for backlogged peers to become writable,
// flushes what it can, and expires messages held longer than SendTimeout.
func (s *sender) retry() {
	socks := make([]zSocket, 0, s.nBlock)
	for _, p := range s.peers {
		if len(p.backlog) > 0 {
			socks = append(socks, p.sock)
		}
	}
	if _, err := s.ctx.poll(socks, true, s.o.opts.RetryInterval); err != nil && !isIntr(err) {
		s.o.noteError(err)
	}
	now := time.Now()
	for _, p := range s.peers {
		if len(p.backlog) == 0 {
			continue
		}
		i := 0
		for i < len(p.backlog) && s.trySend(p, &p.backlog[i]) {
			i++
		}
		for i < len(p.backlog) && now.Sub(p.backlog[i].at) > s.o.opts.SendTimeout {
			s.o.dropped.Add(1)
			p.backlog[i].done()
			i++
		}
		s.trim(p, i)
	}
}

// trim removes the first n messages of p's backlog.
func (s *sender) trim(p *peer, n int) {
	if n == 0 {
		return
	}
	clear(p.backlog[:n])
	p.backlog = p.backlog[n:]
	s.o.backlog.Add(-int64(n))
	if len(p.backlog) == 0 {
		p.backlog = nil
		s.nBlock--
	}
}

func (s *sender) closePeer(endpoint string, p *peer) {
	s.o.dropped.Add(uint64(len(p.backlog)))
	for i := range p.backlog {
		p.backlog[i].done()
	}
	s.trim(p, len(p.backlog))
	if err := p.sock.close(); err != nil {
		s.o.noteError(err)
	}
	delete(s.peers, endpoint)
	s.lru.Remove(p.lru)
	s.o.peers.Add(-1)
	s.o.dropCredit(endpoint)
}

// dropCredit forgets endpoint's semaphore when nothing holds a slot, so
// that the semaphores stay as bounded as the sockets. A Send racing with it
// may make a fresh one: the peer's bound is then briefly doubled, never
// lost.
func (o *Outbox) dropCredit(endpoint string) {
	if c, ok := o.credits.Load(endpoint); ok && len(c.(chan struct{})) == 0 {
		o.credits.CompareAndDelete(endpoint, c)
	}
}

// evict closes the least recently used peer that holds no backlog and
// streamed nothing through Send within PeerIdle, and reports whether there
// was one. A peer Send fed recently is a stream (a decode taking KV):
// libzmq may still hold messages for it that the socket's close, which
// does not linger, would drop although Send counted them sent; peers that
// only Offer reached (replies to endpoints other processes named) are the
// ones a flood makes, and the ones to close.
func (s *sender) evict() bool {
	now := time.Now()
	for e := s.lru.Back(); e != nil; e = e.Prev() {
		p := e.Value.(*peer)
		if len(p.backlog) == 0 && now.Sub(p.sent) >= s.o.opts.PeerIdle {
			s.o.evicted.Add(1)
			s.closeNow(p)
			return true
		}
	}
	return false
}

// closeNow closes p without lingering: an evicted or idle peer's socket
// must free its slot at once, or a stream of new peers would keep as many
// sockets lingering as it opens.
func (s *sender) closeNow(p *peer) {
	if err := p.sock.setLinger(0); err != nil {
		s.o.noteError(err)
	}
	s.closePeer(p.endpoint, p)
}

// closeIdle closes the peers unused for PeerIdle that hold nothing, least
// recently used first.
func (s *sender) closeIdle(now time.Time) {
	for e := s.lru.Back(); e != nil; {
		p := e.Value.(*peer)
		if now.Sub(p.used) < s.o.opts.PeerIdle {
			return // the rest were used later
		}
		e = e.Prev()
		if len(p.backlog) == 0 {
			s.o.idleClosed.Add(1)
			s.closeNow(p)
		}
	}
}

func (s *sender) forget(req forgetReq) {
	if p := s.peers[req.endpoint]; p != nil {
		s.closePeer(req.endpoint, p)
	}
	// Messages already queued for the endpoint were sent before Forget was
	// asked for; they go to the new connection when it is made.
	close(req.reply)
}

func (s *sender) shutdown() {
	for ep, p := range s.peers {
		s.closePeer(ep, p)
	}
	for {
		select {
		case it := <-s.o.queue:
			s.o.dropped.Add(1)
			it.done()
			continue
		default:
		}
		break
	}
	if err := s.ctx.term(); err != nil {
		s.o.noteError(err)
	}
	// The context is gone, and with it every message libzmq held: all
	// free callbacks have run, so nothing stays pinned (the shim's term
	// unpinned them).
	s.o.freed.drain()
}
