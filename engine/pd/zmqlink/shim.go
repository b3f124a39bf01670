package zmqlink

// The zero-copy backend (SocketOptions.ZeroCopy): a small cgo shim over
// libzmq's C API, for the KV data path. pebbe/zmq4 (pebbe.go, the default
// backend) keeps its context and socket handles private, copies every
// frame into a zmq_msg on send and allocates a Go slice per frame on
// receive; that caps KV transfer at a third to a half of raw TCP (see
// doc.go). The shim owns contexts and sockets itself, so it can send large
// frames without a copy (zmq_msg_init_data over pinned Go memory, released
// by libzmq's free callback) and lend received frames to the handler
// straight from the zmq_msg buffers.

/*
#cgo pkg-config: libzmq
#include <zmq.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// zl_ref counts the zmq_msgs that reference one outgoing message's pinned
// Go memory, plus one reference held by Go. Whoever drops the last one
// tells Go (zlFreed) that it may unpin.
typedef struct { long refs; uintptr_t h; } zl_ref;

extern void zlFreed(uintptr_t h);

static void zl_free(void *data, void *hint) {
	zl_ref *r = (zl_ref *)hint;
	(void)data;
	if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0) {
		uintptr_t h = r->h;
		free(r);
		zlFreed(h); // on a libzmq I/O thread: Go only queues h
	}
}

static zl_ref *zl_ref_new(uintptr_t h) {
	zl_ref *r = (zl_ref *)malloc(sizeof(zl_ref));
	if (r) { r->refs = 1; r->h = h; }
	return r;
}

// zl_ref_release drops Go's reference; 1 means it was the last (r is freed
// and Go must unpin itself).
static int zl_ref_release(zl_ref *r) {
	if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0) {
		free(r);
		return 1;
	}
	return 0;
}

// zl_send sends n frames as one multipart message without waiting. Frames
// of at least zc_min bytes (when r is not NULL) are sent without a copy:
// libzmq references ptrs[i] until zl_free. It returns 0, or the errno;
// EAGAIN can only come before the first frame was accepted.
// ptrs holds the frames' addresses as integers: Go writes them there, and
// a Go pointer stored into C memory through a pointer-typed slot would run
// the garbage collector's write barrier on whatever the slot held before.
static int zl_send(void *s, uintptr_t *ptrs, size_t *lens, int n, size_t zc_min, zl_ref *r) {
	for (int i = 0; i < n; i++) {
		zmq_msg_t m;
		int rc;
		if (r != NULL && lens[i] >= zc_min && lens[i] > 0) {
			__atomic_add_fetch(&r->refs, 1, __ATOMIC_ACQ_REL);
			rc = zmq_msg_init_data(&m, (void *)ptrs[i], lens[i], zl_free, r);
			if (rc != 0) {
				int e = errno;
				__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL);
				return e;
			}
		} else {
			rc = zmq_msg_init_size(&m, lens[i]);
			if (rc != 0) return errno;
			if (lens[i] > 0) memcpy(zmq_msg_data(&m), (void *)ptrs[i], lens[i]);
		}
		int flags = ZMQ_DONTWAIT | (i < n - 1 ? ZMQ_SNDMORE : 0);
		for (;;) {
			rc = zmq_msg_send(&m, s, flags);
			if (rc >= 0) break;
			int e = errno;
			if (e == EINTR) continue;
			zmq_msg_close(&m); // runs zl_free for a zero-copy frame
			return e;
		}
	}
	return 0;
}

// zl_recv receives the parts of one multipart message into msgs[*n..cap).
// It returns 0 when the message is complete, 1 when msgs is full and more
// parts follow, or the errno (EAGAIN with *n == 0: nothing to read).
static int zl_recv(void *s, zmq_msg_t *msgs, int cap, int *n) {
	while (*n < cap) {
		zmq_msg_t *m = &msgs[*n];
		zmq_msg_init(m);
		int rc;
		do {
			rc = zmq_msg_recv(m, s, ZMQ_DONTWAIT);
		} while (rc < 0 && errno == EINTR);
		if (rc < 0) {
			int e = errno;
			zmq_msg_close(m);
			return e;
		}
		(*n)++;
		if (!zmq_msg_more(m)) return 0;
	}
	return 1;
}

static void zl_close_msgs(zmq_msg_t *msgs, int n) {
	for (int i = 0; i < n; i++) zmq_msg_close(&msgs[i]);
}

static void zl_msgs_info(zmq_msg_t *msgs, int n, void **ptrs, size_t *lens) {
	for (int i = 0; i < n; i++) {
		ptrs[i] = zmq_msg_data(&msgs[i]);
		lens[i] = zmq_msg_size(&msgs[i]);
	}
}

static int zl_setint(void *s, int opt, int v) {
	return zmq_setsockopt(s, opt, &v, sizeof v) == 0 ? 0 : errno;
}

static int zl_setint64(void *s, int opt, int64_t v) {
	return zmq_setsockopt(s, opt, &v, sizeof v) == 0 ? 0 : errno;
}

static int zl_last_endpoint(void *s, char *buf, size_t cap) {
	size_t n = cap;
	return zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, buf, &n) == 0 ? 0 : errno;
}

static int zl_ctx_term(void *c) {
	int rc;
	do {
		rc = zmq_ctx_term(c);
	} while (rc != 0 && errno == EINTR);
	return rc == 0 ? 0 : errno;
}

static int zl_poll(zmq_pollitem_t *items, int n, long timeout_ms) {
	int rc = zmq_poll(items, n, timeout_ms);
	return rc >= 0 ? rc : -errno;
}

static int zl_setstr(void *s, int opt, const char *v, size_t n) {
	return zmq_setsockopt(s, opt, v, n) == 0 ? 0 : errno;
}

static int zl_monitor(void *s, const char *ep, int events) {
	return zmq_socket_monitor(s, ep, events) == 0 ? 0 : errno;
}

static int zl_close(void *s) { return zmq_close(s) == 0 ? 0 : errno; }
static int zl_bind(void *s, const char *ep) { return zmq_bind(s, ep) == 0 ? 0 : errno; }
static int zl_connect(void *s, const char *ep) { return zmq_connect(s, ep) == 0 ? 0 : errno; }
static int zl_ctx_set(void *c, int opt, int v) { return zmq_ctx_set(c, opt, v) == 0 ? 0 : errno; }
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// zErr is a libzmq error number.
type zErr syscall.Errno

const errTerm = zErr(C.ETERM)

func (e zErr) Error() string { return C.GoString(C.zmq_strerror(C.int(e))) }

func zerr(rc C.int) error {
	if rc == 0 {
		return nil
	}
	return zErr(rc)
}

// shimContext is a libzmq context of the shim backend, with the box that
// collects released messages.
type shimContext struct {
	p   unsafe.Pointer
	box *freeBox
}

// shimSocket is a socket of the shim backend, with its send scratch and
// receive buffer: each socket is used by one goroutine, but an Inbox's
// PULL socket and its ZAP handler's REP socket share a context.
type shimSocket struct {
	p  unsafe.Pointer
	c  *shimContext
	sc scratch
	rb recvBuf
}

func newShimContext(ioThreads int, box *freeBox) (*shimContext, error) {
	p, err := C.zmq_ctx_new()
	if p == nil {
		if en, ok := err.(syscall.Errno); ok {
			return nil, zErr(en)
		}
		return nil, zErr(syscall.ENOMEM)
	}
	if box == nil {
		box = newFreeBox()
	}
	c := &shimContext{p: p, box: box}
	if ioThreads > 0 {
		if err := zerr(C.zl_ctx_set(p, C.ZMQ_IO_THREADS, C.int(ioThreads))); err != nil {
			c.term()
			return nil, err
		}
	}
	return c, nil
}

// term terminates the context; every socket must be closed first. After
// it returns libzmq holds no message any more (all free callbacks ran), so
// it unpins them all.
func (c *shimContext) term() error {
	err := zerr(C.zl_ctx_term(c.p))
	c.box.drain()
	return err
}

func (c *shimContext) socket(k sockKind) (zSocket, error) {
	typ := C.int(C.ZMQ_PUSH)
	switch k {
	case kindPULL:
		typ = C.ZMQ_PULL
	case kindREP:
		typ = C.ZMQ_REP
	case kindPAIR:
		typ = C.ZMQ_PAIR
	}
	p, err := C.zmq_socket(c.p, typ)
	if p == nil {
		if en, ok := err.(syscall.Errno); ok {
			return nil, zErr(en)
		}
		return nil, zErr(syscall.EINVAL)
	}
	return &shimSocket{p: p, c: c}, nil
}

// poll waits up to d for the events of socks; it returns how many sockets
// are ready.
func (c *shimContext) poll(socks []zSocket, out bool, d time.Duration) (int, error) {
	if len(socks) == 0 {
		time.Sleep(d)
		return 0, nil
	}
	ev := C.short(C.ZMQ_POLLIN)
	if out {
		ev = C.ZMQ_POLLOUT
	}
	items := (*C.zmq_pollitem_t)(C.calloc(C.size_t(len(socks)), C.size_t(unsafe.Sizeof(C.zmq_pollitem_t{}))))
	defer C.free(unsafe.Pointer(items))
	is := unsafe.Slice(items, len(socks))
	for i, s := range socks {
		is[i].socket = s.(*shimSocket).p
		is[i].events = ev
	}
	rc := C.zl_poll(items, C.int(len(socks)), C.long(d/time.Millisecond))
	if rc < 0 {
		return 0, zErr(-rc)
	}
	return int(rc), nil
}

func (s *shimSocket) close() error {
	s.rb.free()
	s.sc.free()
	return zerr(C.zl_close(s.p))
}

func (s *shimSocket) setInt(opt C.int, v int) error { return zerr(C.zl_setint(s.p, opt, C.int(v))) }

func (s *shimSocket) setOpt(o sockOpt, v int) error {
	switch o {
	case optSndHWM:
		return s.setInt(C.ZMQ_SNDHWM, v)
	case optRcvHWM:
		return s.setInt(C.ZMQ_RCVHWM, v)
	case optSndBuf:
		return s.setInt(C.ZMQ_SNDBUF, v)
	case optRcvBuf:
		return s.setInt(C.ZMQ_RCVBUF, v)
	case optMaxMsgSize:
		return zerr(C.zl_setint64(s.p, C.ZMQ_MAXMSGSIZE, C.int64_t(v)))
	case optHandshakeIvl:
		return s.setInt(C.ZMQ_HANDSHAKE_IVL, v)
	case optPlainServer:
		return s.setInt(C.ZMQ_PLAIN_SERVER, v)
	case optCurveServer:
		return s.setInt(C.ZMQ_CURVE_SERVER, v)
	}
	return zErr(syscall.EINVAL)
}

// shimStrOpts maps the string options to libzmq's.
var shimStrOpts = map[sockOpt]C.int{
	optZapDomain:      C.ZMQ_ZAP_DOMAIN,
	optPlainUsername:  C.ZMQ_PLAIN_USERNAME,
	optPlainPassword:  C.ZMQ_PLAIN_PASSWORD,
	optCurvePublicKey: C.ZMQ_CURVE_PUBLICKEY,
	optCurveSecretKey: C.ZMQ_CURVE_SECRETKEY,
	optCurveServerKey: C.ZMQ_CURVE_SERVERKEY,
}

func (s *shimSocket) setStrOpt(o sockOpt, v string) error {
	opt, ok := shimStrOpts[o]
	if !ok {
		return zErr(syscall.EINVAL)
	}
	cs := C.CString(v) // C.CString copies, so v may hold NUL bytes (a raw key)
	defer C.free(unsafe.Pointer(cs))
	return zerr(C.zl_setstr(s.p, opt, cs, C.size_t(len(v))))
}

func (s *shimSocket) setLinger(d time.Duration) error {
	return s.setInt(C.ZMQ_LINGER, int(d/time.Millisecond))
}

func (s *shimSocket) bind(ep string) error {
	cs := C.CString(ep)
	defer C.free(unsafe.Pointer(cs))
	return zerr(C.zl_bind(s.p, cs))
}

func (s *shimSocket) connect(ep string) error {
	cs := C.CString(ep)
	defer C.free(unsafe.Pointer(cs))
	return zerr(C.zl_connect(s.p, cs))
}

func (s *shimSocket) monitor(ep string, events int) error {
	cs := C.CString(ep)
	defer C.free(unsafe.Pointer(cs))
	return zerr(C.zl_monitor(s.p, cs, C.int(events)))
}

func (s *shimSocket) lastEndpoint() (string, error) {
	const n = 1024
	buf := (*C.char)(C.malloc(n))
	defer C.free(unsafe.Pointer(buf))
	if err := zerr(C.zl_last_endpoint(s.p, buf, n)); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

// zeroCopyMin is the smallest frame sent without a copy. Smaller frames
// are copied into the zmq_msg (cheaper than pinning them and taking the
// free callback).
const zeroCopyMin = 32 << 10

// pinned is one outgoing message's pinned frames while libzmq may still
// reference them.
type pinned struct {
	pin runtime.Pinner
	ref *C.zl_ref // nil when no frame went without a copy
	h   cgo.Handle
	box *freeBox
}

// freeBox collects the messages whose last libzmq reference was dropped on
// an I/O thread, for the owner goroutine to unpin.
type freeBox struct {
	mu     sync.Mutex
	freed  []*pinned
	notify chan struct{} // capacity 1
}

func newFreeBox() *freeBox { return &freeBox{notify: make(chan struct{}, 1)} }

func (b *freeBox) put(p *pinned) {
	b.mu.Lock()
	b.freed = append(b.freed, p)
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
}

// drain unpins every message libzmq has released; owner goroutine only.
func (b *freeBox) drain() int {
	b.mu.Lock()
	f := b.freed
	b.freed = nil
	b.mu.Unlock()
	for _, p := range f {
		p.unpin()
	}
	return len(f)
}

//export zlFreed
func zlFreed(h C.uintptr_t) {
	p := cgo.Handle(h).Value().(*pinned)
	p.box.put(p)
}

// livePins counts the outgoing messages whose frames are pinned (for
// tests: it must come back to zero).
var livePins atomic.Int64

func (p *pinned) unpin() {
	livePins.Add(-1)
	p.pin.Unpin()
	if p.h != 0 {
		p.h.Delete()
		p.h = 0
	}
}

// release drops Go's reference once the message is sent or dropped: it
// unpins now when libzmq holds no frame, or later through the free box.
func (p *pinned) release() {
	if p.ref == nil {
		p.unpin()
		return
	}
	if C.zl_ref_release(p.ref) == 1 {
		p.ref = nil
		p.unpin()
	}
	// else: zlFreed queues p when libzmq drops its last frame.
}

// scratch is C memory for frame pointers and lengths. A sender writes
// its (pinned) frames' addresses into addrs, as integers: storing a Go
// pointer into C memory through a pointer-typed slot would run the
// garbage collector's write barrier on the slot's old contents, which in
// fresh C.malloc memory are garbage ("found bad pointer in Go heap"). A
// receiver's C code fills ptrs with libzmq's own pointers.
type scratch struct {
	ptrs  *unsafe.Pointer
	addrs *C.uintptr_t
	lens  *C.size_t
	cap   int
}

func (sc *scratch) grow(n int) {
	if n <= sc.cap {
		return
	}
	sc.free()
	c := max(n, 64)
	sc.ptrs = (*unsafe.Pointer)(C.calloc(C.size_t(c), C.size_t(unsafe.Sizeof(unsafe.Pointer(nil)))))
	sc.addrs = (*C.uintptr_t)(C.calloc(C.size_t(c), C.size_t(unsafe.Sizeof(C.uintptr_t(0)))))
	sc.lens = (*C.size_t)(C.calloc(C.size_t(c), C.size_t(unsafe.Sizeof(C.size_t(0)))))
	sc.cap = c
}

func (sc *scratch) free() {
	if sc.cap > 0 {
		C.free(unsafe.Pointer(sc.ptrs))
		C.free(unsafe.Pointer(sc.addrs))
		C.free(unsafe.Pointer(sc.lens))
		sc.cap = 0
	}
}

// send sends frames as one multipart message without waiting, pinning
// them (p, made on the first attempt) for as long as libzmq references
// them. EAGAIN means nothing was sent: try again later.
func (s *shimSocket) send(frames [][]byte, p **pinned) error {
	sc := &s.sc
	if *p == nil {
		q := &pinned{box: s.c.box}
		livePins.Add(1)
		zc := false
		for _, f := range frames {
			if len(f) > 0 {
				q.pin.Pin(&f[0])
				if len(f) >= zeroCopyMin {
					zc = true
				}
			}
		}
		if zc {
			q.h = cgo.NewHandle(q)
			q.ref = C.zl_ref_new(C.uintptr_t(q.h))
			if q.ref == nil {
				q.unpin()
				return zErr(syscall.ENOMEM)
			}
		}
		*p = q
	}
	sc.grow(len(frames))
	addrs := unsafe.Slice(sc.addrs, sc.cap)
	lens := unsafe.Slice(sc.lens, sc.cap)
	for i, f := range frames {
		addrs[i] = 0
		if len(f) > 0 {
			addrs[i] = C.uintptr_t(uintptr(unsafe.Pointer(&f[0]))) // pinned
		}
		lens[i] = C.size_t(len(f))
	}
	return zerr(C.zl_send(s.p, sc.addrs, sc.lens, C.int(len(frames)), zeroCopyMin, (*p).ref))
}

// recvBuf holds the zmq_msgs of the message being received, in C memory.
type recvBuf struct {
	msgs *C.zmq_msg_t
	cap  int
	n    int
	info scratch // the parts' data pointers and sizes
}

func (rb *recvBuf) grow() {
	c := max(2*rb.cap, 16)
	m := (*C.zmq_msg_t)(C.realloc(unsafe.Pointer(rb.msgs), C.size_t(c)*C.size_t(unsafe.Sizeof(C.zmq_msg_t{}))))
	if m == nil {
		panic("zmqlink: out of C memory")
	}
	rb.msgs, rb.cap = m, c
}

// recv receives one multipart message without waiting; EAGAIN means none
// is there. The frames it returns lend the zmq_msg buffers: valid until
// release.
func (s *shimSocket) recv() ([][]byte, error) {
	rb := &s.rb
	rb.n = 0
	if rb.cap == 0 {
		rb.grow()
	}
	for {
		var n C.int = C.int(rb.n)
		rc := C.zl_recv(s.p, rb.msgs, C.int(rb.cap), &n)
		rb.n = int(n)
		if rc == 0 {
			break
		}
		if rc == 1 {
			rb.grow()
			continue
		}
		rb.release()
		return nil, zErr(rc)
	}
	rb.info.grow(rb.n)
	C.zl_msgs_info(rb.msgs, C.int(rb.n), rb.info.ptrs, rb.info.lens)
	ptrs := unsafe.Slice(rb.info.ptrs, rb.n)
	lens := unsafe.Slice(rb.info.lens, rb.n)
	frames := make([][]byte, rb.n)
	for i := range frames {
		if sz := int(lens[i]); sz > 0 {
			frames[i] = unsafe.Slice((*byte)(ptrs[i]), sz)
		} else {
			frames[i] = []byte{}
		}
	}
	return frames, nil
}

// release closes the received zmq_msgs; the frames lent by recv die.
func (s *shimSocket) release() { s.rb.release() }

func (rb *recvBuf) release() {
	if rb.n > 0 {
		C.zl_close_msgs(rb.msgs, C.int(rb.n))
		rb.n = 0
	}
}

func (rb *recvBuf) free() {
	rb.release()
	if rb.cap > 0 {
		C.free(unsafe.Pointer(rb.msgs))
		rb.msgs, rb.cap = nil, 0
	}
	rb.info.free()
}
