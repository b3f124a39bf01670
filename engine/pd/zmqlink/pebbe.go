package zmqlink

import (
	"fmt"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// The pebbe/zmq4 backend, the default: the project's ZeroMQ binding. It
// copies each frame into a zmq_msg on send and into a fresh Go slice on
// receive, which is cheap for control messages and costs about half the
// throughput of large KV frames (see doc.go); the KV path uses the shim.

type pebbeContext struct{ ctx *zmq.Context }

type pebbeSocket struct{ s *zmq.Socket }

func newPebbeContext(ioThreads int) (*pebbeContext, error) {
	ctx, err := zmq.NewContext()
	if err != nil {
		return nil, err
	}
	if ioThreads > 0 {
		if err := ctx.SetIoThreads(ioThreads); err != nil {
			ctx.Term()
			return nil, fmt.Errorf("io threads: %w", err)
		}
	}
	return &pebbeContext{ctx: ctx}, nil
}

func (c *pebbeContext) socket(k sockKind) (zSocket, error) {
	t := zmq.PUSH
	switch k {
	case kindPULL:
		t = zmq.PULL
	case kindREP:
		t = zmq.REP
	case kindPAIR:
		t = zmq.PAIR
	}
	s, err := c.ctx.NewSocket(t)
	if err != nil {
		return nil, err
	}
	return &pebbeSocket{s: s}, nil
}

func (c *pebbeContext) poll(socks []zSocket, out bool, d time.Duration) (int, error) {
	if len(socks) == 0 {
		time.Sleep(d)
		return 0, nil
	}
	ev := zmq.POLLIN
	if out {
		ev = zmq.POLLOUT
	}
	p := zmq.NewPoller()
	for _, s := range socks {
		p.Add(s.(*pebbeSocket).s, ev)
	}
	polled, err := p.Poll(d)
	return len(polled), err
}

func (c *pebbeContext) term() error { return c.ctx.Term() }

func (s *pebbeSocket) setLinger(d time.Duration) error { return s.s.SetLinger(d) }

func (s *pebbeSocket) setOpt(o sockOpt, v int) error {
	switch o {
	case optSndHWM:
		return s.s.SetSndhwm(v)
	case optRcvHWM:
		return s.s.SetRcvhwm(v)
	case optSndBuf:
		return s.s.SetSndbuf(v)
	case optRcvBuf:
		return s.s.SetRcvbuf(v)
	case optMaxMsgSize:
		return s.s.SetMaxmsgsize(int64(v))
	case optHandshakeIvl:
		return s.s.SetHandshakeIvl(time.Duration(v) * time.Millisecond)
	case optPlainServer:
		return s.s.SetPlainServer(v)
	case optCurveServer:
		return s.s.SetCurveServer(v)
	}
	return fmt.Errorf("unknown option %d", o)
}

func (s *pebbeSocket) setStrOpt(o sockOpt, v string) error {
	switch o {
	case optZapDomain:
		return s.s.SetZapDomain(v)
	case optPlainUsername:
		return s.s.SetPlainUsername(v)
	case optPlainPassword:
		return s.s.SetPlainPassword(v)
	case optCurvePublicKey:
		return s.s.SetCurvePublickey(v)
	case optCurveSecretKey:
		return s.s.SetCurveSecretkey(v)
	case optCurveServerKey:
		return s.s.SetCurveServerkey(v)
	}
	return fmt.Errorf("unknown option %d", o)
}

func (s *pebbeSocket) bind(ep string) error            { return s.s.Bind(ep) }
func (s *pebbeSocket) connect(ep string) error         { return s.s.Connect(ep) }
func (s *pebbeSocket) lastEndpoint() (string, error)   { return s.s.GetLastEndpoint() }
func (s *pebbeSocket) monitor(ep string, ev int) error { return s.s.Monitor(ep, zmq.Event(ev)) }
func (s *pebbeSocket) recv() ([][]byte, error)         { return s.s.RecvMessageBytes(zmq.DONTWAIT) }
func (s *pebbeSocket) release()                        {}
func (s *pebbeSocket) close() error                    { return s.s.Close() }

func (s *pebbeSocket) send(frames [][]byte, _ **pinned) error {
	_, err := s.s.SendMessageDontwait(frames)
	return err
}
