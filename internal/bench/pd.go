package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
)

// PDConfig chooses what the PD benchmark measures. Zero values take the
// defaults noted per field.
type PDConfig struct {
	Home    string        // cache folder for the built-in models
	Arch    string        // built-in architecture (default llama)
	Size    string        // built-in size (default small)
	Type    kernels.DType // weight type (the zero value is F32)
	TP      int           // tensor-parallel ranks of every engine (default 1)
	Threads int           // kernel threads per rank (default: every CPU / TP, at least 1)
	// Prompts are the prompt lengths measured (default 128 and 1024).
	Prompts []int
	// Requests is the number of requests per prompt length, run one after
	// the other on each setup (default 8).
	Requests  int
	MaxTokens int // tokens generated per request, greedy, EOS ignored (default 8)
	// RequestTimeout bounds each request (default 2 minutes).
	RequestTimeout time.Duration
	// TransportTime is how long the pure transport loop sends KV chunks
	// (default 2s); TransportTokens is the tokens of KV per chunk (default
	// 256).
	TransportTime   time.Duration
	TransportTokens int
	// Seed chooses the prompts (default 1).
	Seed uint64
	// KVType is the element type every engine's pools store K and V in:
	// F32 (the zero value), BF16 or F16.
	KVType kernels.DType
}

func (c *PDConfig) setDefaults() {
	setDefault(&c.Arch, model.ArchLlama)
	setDefault(&c.Size, builtin.SizeSmall)
	setDefault(&c.TP, 1)
	setDefault(&c.Threads, max(1, runtime.NumCPU()/c.TP))
	if len(c.Prompts) == 0 {
		c.Prompts = []int{128, 1024}
	}
	setDefault(&c.Requests, 8)
	setDefault(&c.MaxTokens, 8)
	setDefault(&c.RequestTimeout, 2*time.Minute)
	setDefault(&c.TransportTime, 2*time.Second)
	setDefault(&c.TransportTokens, 256)
	setDefault(&c.Seed, 1)
}

// PDLength is the outcome of one prompt length.
type PDLength struct {
	PromptLen int
	Requests  int
	// TTFT in milliseconds, from submission (both halves at once for PD)
	// to the first token event of the (decode) stream.
	ColP50, ColP99 float64
	PDP50, PDP99   float64
	// KVBytes is the KV one request moved, all ranks together (the
	// decode's transfer counter is rank 0's share, times TP).
	KVBytes uint64
	// KVRate is KVBytes over the PD time to first token, in MB/s: a
	// serving figure that includes the prefill's compute, not the wire's
	// speed (see PDTransport for that).
	KVRate float64
}

// Ratio is the PD TTFT p50 over the colocated one.
func (l PDLength) Ratio() float64 {
	return ratio(l.PDP50, l.ColP50)
}

// PDTransport compares the ZeroMQ link carrying real KV_CHUNK messages
// with raw loopback TCP moving the same bytes in the same run, and the
// link with connection authentication (PLAIN, as a cluster secret turns
// on) with the link without, interleaved.
type PDTransport struct {
	ChunkTokens int     // tokens of KV per message
	MsgBytes    int     // KV payload bytes per message (one rank's shard)
	Messages    int     // messages sent and decoded without authentication
	Bytes       uint64  // payload bytes moved, by each transport
	ZMQ         float64 // MB/s, Outbox → Inbox with pdproto encode and decode
	Raw         float64 // MB/s, net.Conn into a reused buffer
	ZMQElapsed  time.Duration
	RawElapsed  time.Duration
	// Plain is the link's MB/s with PLAIN authentication, over
	// PlainMessages in PlainElapsed, its rounds interleaved with the
	// unauthenticated link's.
	Plain         float64
	PlainMessages int
	PlainElapsed  time.Duration
	// AuthRounds is each round's PLAIN rate over the unauthenticated
	// link's: their spread is the noise AuthRatio is read against.
	AuthRounds []float64
}

// Ratio is ZMQ over Raw.
func (t PDTransport) Ratio() float64 {
	return ratio(t.ZMQ, t.Raw)
}

// AuthRatio is the link's rate with authentication over its rate without.
func (t PDTransport) AuthRatio() float64 {
	return ratio(t.Plain, t.ZMQ)
}

// AuthBound is the one-sided 95% upper bound of the rounds' mean
// AuthRatio: authentication costs more than the goal allows only when
// this bound is below PDAuthGoal, not when one run's ratio is (the link's
// rate scatters by about ±10% between half-second rounds here). With
// fewer than two rounds it is AuthRatio.
func (t PDTransport) AuthBound() float64 {
	if len(t.AuthRounds) < 2 {
		return t.AuthRatio()
	}
	return upperBound95(t.AuthRounds)
}

// PDAuthGoal is the share of the KV link's throughput that connection
// authentication must leave (it may cost at most 10%).
const PDAuthGoal = 0.9

// PDRatioGoal is the transport ratio the project aims at.
const PDRatioGoal = 0.8

// PDReport is a whole PD benchmark run.
type PDReport struct {
	Config    PDConfig // with its defaults filled in
	Model     model.Config
	ModelFile string
	Lengths   []PDLength
	Transport PDTransport
	// Compared is the number of requests whose PD greedy tokens were
	// checked against the colocated engine's (all matched, or the run
	// failed).
	Compared int
}

// RunPD builds, in one process, a colocated engine and a prefill+decode
// pair (the prefill's ranks in a bootstrap registry served over loopback
// HTTP, KV over ZeroMQ on loopback) over the same built-in model and
// configuration. For each prompt length it runs the same greedy requests
// one at a time on both, alternating, and measures the time to first
// token; PD tokens must equal the colocated ones. Then it measures the
// KV transport alone against raw loopback TCP.
func RunPD(ctx context.Context, cfg PDConfig, progress io.Writer) (rep PDReport, err error) {
	cfg.setDefaults()
	if cfg.Requests < 1 || cfg.MaxTokens < 1 {
		return rep, errors.New("bench: requests and max tokens must be positive")
	}
	mc, err := builtin.Shape(cfg.Arch, cfg.Size)
	if err != nil {
		return rep, err
	}
	for _, n := range cfg.Prompts {
		if n < 1 {
			return rep, fmt.Errorf("bench: prompt length %d must be ≥ 1", n)
		}
		if n+cfg.MaxTokens > mc.ContextLen {
			return rep, fmt.Errorf("bench: prompt of %d tokens plus %d to generate exceeds the context length %d", n, cfg.MaxTokens, mc.ContextLen)
		}
	}
	m, path, err := openBuiltin(cfg.Home, builtin.Spec{Arch: cfg.Arch, Size: cfg.Size, Seed: builtin.DefaultSeed, Type: cfg.Type})
	if err != nil {
		return rep, err
	}
	defer m.Close()
	rep = PDReport{Config: cfg, Model: m.Config, ModelFile: path}

	const maxRunning = 4
	longest := slices.Max(cfg.Prompts)
	ecfg := serve.Config{TP: cfg.TP, Backend: cpuBackends(cfg.Threads), PageSize: pageSize, MaxRunning: maxRunning, KVTokens: kvTokens(maxRunning, longest+cfg.MaxTokens), KVType: cfg.KVType}

	var engines []*serve.Engine
	defer func() {
		for _, e := range slices.Backward(engines) {
			if cerr := e.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}
	}()
	newEngine := func(role string) (*serve.Engine, error) {
		c := ecfg
		c.Role = role
		c.Name = "bench-" + role
		e, err := serve.New(m, c)
		if err != nil {
			return nil, fmt.Errorf("bench: %s engine: %w", role, err)
		}
		engines = append(engines, e)
		return e, nil
	}
	col, err := newEngine(pdproto.RoleColocated)
	if err != nil {
		return rep, err
	}
	pre, err := newEngine(pdproto.RolePrefill)
	if err != nil {
		return rep, err
	}
	dec, err := newEngine(pdproto.RoleDecode)
	if err != nil {
		return rep, err
	}
	url, stop, err := serveRegistry(pre, cfg.TP, progress)
	if err != nil {
		return rep, err
	}
	defer stop()
	if err := dec.AllowPrefillBootstrap(url); err != nil {
		return rep, err
	}
	pd := &pdSetup{prefill: pre, decode: dec, url: url, room: uint64(time.Now().UnixNano()) & (1<<48 - 1)}

	fmt.Fprintf(progress, "PD bench: %s %s (%v), TP %d, %d thread(s) per rank; registry %s\n", cfg.Arch, cfg.Size, cfg.Type, cfg.TP, cfg.Threads, url)
	warm := promptSource{seed: cfg.Seed, n: min(32, longest), vocab: m.Config.VocabSize}.at(1<<20, 0)
	if _, err := runOne(ctx, cfg, col, nil, toI32(warm)); err != nil {
		return rep, fmt.Errorf("bench: colocated warm-up: %w", err)
	}
	if _, err := runOne(ctx, cfg, dec, pd, toI32(warm)); err != nil {
		return rep, fmt.Errorf("bench: PD warm-up: %w", err)
	}

	perTok := 0 // KV bytes per prompt token on one rank, as measured
	for li, n := range cfg.Prompts {
		ps := promptSource{seed: cfg.Seed, n: n, vocab: m.Config.VocabSize}
		var colT, pdT []float64
		var kv uint64
		var pdTotal time.Duration
		for i := range cfg.Requests {
			prompt := toI32(ps.at(li, i))
			c, err := runOne(ctx, cfg, col, nil, prompt)
			if err != nil {
				return rep, fmt.Errorf("bench: colocated, %d-token prompt %d: %w", n, i, err)
			}
			before := dec.PD().TransferBytes()
			p, err := runOne(ctx, cfg, dec, pd, prompt)
			if err != nil {
				return rep, fmt.Errorf("bench: PD, %d-token prompt %d: %w", n, i, err)
			}
			moved := dec.PD().TransferBytes() - before
			if !slices.Equal(p.tokens, c.tokens) {
				return rep, fmt.Errorf("bench: %d-token prompt %d: PD greedy tokens %v differ from colocated %v", n, i, p.tokens, c.tokens)
			}
			if moved == 0 {
				return rep, fmt.Errorf("bench: %d-token prompt %d: the decode received no KV", n, i)
			}
			rep.Compared++
			colT = append(colT, ms(c.ttft))
			pdT = append(pdT, ms(p.ttft))
			kv += moved * uint64(cfg.TP)
			pdTotal += p.ttft
			if n == longest && perTok == 0 {
				perTok = int(moved) / n
			}
		}
		slices.Sort(colT)
		slices.Sort(pdT)
		l := PDLength{PromptLen: n, Requests: cfg.Requests,
			ColP50: percentile(colT, 50), ColP99: percentile(colT, 99),
			PDP50: percentile(pdT, 50), PDP99: percentile(pdT, 99),
			KVBytes: kv / uint64(cfg.Requests)}
		if pdTotal > 0 {
			l.KVRate = float64(kv) / pdTotal.Seconds() / 1e6
		}
		rep.Lengths = append(rep.Lengths, l)
		fmt.Fprintf(progress, "%d-token prompts: TTFT p50 colocated %.1f ms, PD %.1f ms (%.2fx); %d KV bytes per request\n",
			n, l.ColP50, l.PDP50, l.Ratio(), l.KVBytes)
	}

	msg := chunkShape(&m.Config, cfg.TP, perTok, cfg.TransportTokens, cfg.KVType)
	rep.Transport, err = measureTransport(ctx, msg, cfg.TransportTime)
	if err != nil {
		return rep, err
	}
	rep.Transport.ChunkTokens = cfg.TransportTokens
	fmt.Fprintf(progress, "transport: ZeroMQ %.0f MB/s, with PLAIN %.0f MB/s (%.2f), raw TCP %.0f MB/s (%.2f)\n",
		rep.Transport.ZMQ, rep.Transport.Plain, rep.Transport.AuthRatio(), rep.Transport.Raw, rep.Transport.Ratio())
	return rep, nil
}

// serveRegistry serves a bootstrap registry holding e's ranks on a
// loopback port, as a prefill server does.
func serveRegistry(e *serve.Engine, tp int, progress io.Writer) (string, func(), error) {
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: tp})
	for _, info := range e.PD().RankInfos() {
		if _, err := reg.Register(info); err != nil {
			return "", nil, err
		}
	}
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	log := warnLog(progress)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	done := make(chan struct{})
	go func() { srv.Serve(ln); close(done) }()
	return "http://" + ln.Addr().String(), func() { srv.Close(); <-done }, nil
}

// pdSetup is a prefill and a decode engine and the prefill's registry.
type pdSetup struct {
	prefill, decode *serve.Engine
	url             string
	room            uint64
}

// run is what one request measured.
type run struct {
	ttft   time.Duration
	tokens []int32
}

func toI32(ids []int) []int32 {
	out := make([]int32, len(ids))
	for i, v := range ids {
		out[i] = int32(v)
	}
	return out
}

// runOne runs one greedy request on e (colocated) or, with pd set, on the
// pair (both halves submitted at once under a fresh room, as a router
// does; e is the decode), and reads it to its end.
func runOne(ctx context.Context, cfg PDConfig, e *serve.Engine, pd *pdSetup, prompt []int32) (run, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.RequestTimeout)
	defer cancel()
	q := serve.Request{Prompt: prompt, MaxTokens: cfg.MaxTokens, IgnoreEOS: true}
	start := time.Now()
	var pre *serve.Stream
	if pd != nil {
		pd.room++
		pq, dq := q, q
		pq.PD = &serve.PDRequest{Room: pd.room}
		dq.PD = &serve.PDRequest{Room: pd.room, BootstrapURL: pd.url}
		var err error
		if pre, err = pd.prefill.Submit(ctx, pq); err != nil {
			return run{}, fmt.Errorf("prefill: %w", err)
		}
		q = dq
	}
	s, err := e.Submit(ctx, q)
	if err != nil {
		if pre != nil {
			pre.Abort()
			drain(pre)
		}
		return run{}, err
	}
	var pfin *serve.Finish
	var wg sync.WaitGroup
	if pre != nil {
		wg.Go(func() { pfin = drain(pre) })
	}
	var r run
	var fin *serve.Finish
	for ev := range s.Events {
		if ev.Finish != nil {
			fin = ev.Finish
			continue
		}
		if r.tokens == nil {
			r.ttft = time.Since(start)
		}
		r.tokens = append(r.tokens, ev.Token)
	}
	wg.Wait()
	switch {
	case fin == nil:
		return r, errors.New("stream closed without a finish")
	case fin.Reason != serve.ReasonLength:
		return r, fmt.Errorf("finished %q, want %q", fin.Reason, serve.ReasonLength)
	case len(r.tokens) != cfg.MaxTokens:
		return r, fmt.Errorf("%d tokens, want %d", len(r.tokens), cfg.MaxTokens)
	case pre != nil && (pfin == nil || pfin.Reason != serve.ReasonLength):
		return r, fmt.Errorf("prefill finished %+v", pfin)
	}
	return r, nil
}

// drain reads a stream to its end and returns its finish.
func drain(s *serve.Stream) *serve.Finish {
	var fin *serve.Finish
	for ev := range s.Events {
		if ev.Finish != nil {
			fin = ev.Finish
		}
	}
	return fin
}

// chunkShape is a KV_CHUNK of tokens tokens of one rank's shard of every
// layer. perTok is one rank's KV bytes per token as the PD run measured
// them (0: computed from the model's shape, K and V of kvType, or the
// latent row alone of a latent-attention model); what exceeds K and V
// (index-K and its scales) goes in the index-K frame.
func chunkShape(c *model.Config, tp, perTok, tokens int, kvType kernels.DType) *pdproto.KVChunk {
	row := c.RankKVDim(tp) * kernels.KVElemBytes(kvType) // K (or latent) of one token, one layer
	vRow := row
	if c.MLA != nil {
		vRow = 0
	}
	kv := row + vRow
	layer := kv
	if perTok > 0 && c.Layers > 0 {
		layer = perTok / c.Layers
	}
	kv = min(kv, layer)
	buf := make([]byte, layer*tokens*c.Layers)
	for i := range buf {
		buf[i] = byte(i * 131)
	}
	ch := &pdproto.KVChunk{Room: 1, End: uint32(tokens), Final: &pdproto.ChunkFinal{PromptTokens: uint32(tokens)}}
	for l := range c.Layers {
		b := buf[l*layer*tokens : (l+1)*layer*tokens]
		k := kv * row / (row + vRow) * tokens
		v, ik := kv*tokens-k, (layer-kv)*tokens
		ch.Layers = append(ch.Layers, pdproto.LayerKV{K: b[:k], V: b[k : k+v], IndexK: b[k+v : k+v+ik]})
	}
	return ch
}

// transportWindow is how many KV chunks the transport loop keeps in flight.
const transportWindow = 16

// transportRounds is how many rounds measureTransport runs each link; the
// order alternates from round to round.
const transportRounds = 4

// measureTransport sends msg over two zmqlink links (Outbox → Inbox,
// encoded and decoded with pdproto, as the engines do), one without
// authentication and one with PLAIN, for about d each in interleaved
// rounds; then moves the unauthenticated link's bytes in messages of the
// same size over a raw loopback TCP connection read into one reused
// buffer.
func measureTransport(ctx context.Context, msg *pdproto.KVChunk, d time.Duration) (PDTransport, error) {
	t := PDTransport{MsgBytes: msg.PayloadBytes()}
	if t.MsgBytes == 0 {
		return t, errors.New("bench: empty KV chunk")
	}
	none, err := openKVLink(ctx, nil)
	if err != nil {
		return t, err
	}
	defer none.close()
	secret, _ := clusterauth.Generate()
	plain, err := openKVLink(ctx, serve.KVAuth(secret)) // the KV sockets' rotating PLAIN credential
	if err != nil {
		return t, err
	}
	defer plain.close()
	var plainBytes uint64
	for r := range transportRounds {
		sides := []*kvLink{none, plain}
		if r%2 == 1 {
			sides = []*kvLink{plain, none}
		}
		var rates [2]float64
		for _, l := range sides {
			runtime.GC()
			rate, err := l.run(msg, d/transportRounds)
			if err != nil {
				return t, err
			}
			rates[btoi(l == plain)] = rate
		}
		t.AuthRounds = append(t.AuthRounds, ratio(rates[1], rates[0]))
	}
	t.Messages, t.Bytes, t.ZMQElapsed = none.messages, none.bytes, none.elapsed
	t.PlainMessages, plainBytes, t.PlainElapsed = plain.messages, plain.bytes, plain.elapsed
	for _, l := range []*kvLink{none, plain} {
		if want := uint64(l.messages) * uint64(t.MsgBytes); l.bytes != want {
			return t, fmt.Errorf("bench: %d KV bytes arrived, want %d", l.bytes, want)
		}
	}

	runtime.GC()
	if t.RawElapsed, err = rawTCP(t.MsgBytes, t.Messages); err != nil {
		return t, err
	}
	t.ZMQ = float64(t.Bytes) / t.ZMQElapsed.Seconds() / 1e6
	t.Plain = float64(plainBytes) / t.PlainElapsed.Seconds() / 1e6
	t.Raw = float64(t.Bytes) / t.RawElapsed.Seconds() / 1e6
	return t, nil
}

// kvLink is a KV path as the engines build it, a prefill rank's Outbox
// connected to a decode rank's Inbox (the zero-copy shim on both), with
// what its timed runs moved.
type kvLink struct {
	in  *zmqlink.Inbox
	out *zmqlink.Outbox
	ctx context.Context

	got, bad atomic.Int64
	gotBytes atomic.Uint64
	last     atomic.Int64 // unix nanoseconds of the last chunk received

	messages int
	bytes    uint64
	elapsed  time.Duration
}

// openKVLink listens, connects and waits for the connection (and its
// handshake, with auth) by sending one chunk, so that no run times it.
func openKVLink(ctx context.Context, auth *zmqlink.RotatingAuth) (*kvLink, error) {
	l := &kvLink{ctx: ctx}
	so := zmqlink.SocketOptions{ZeroCopy: true, Rotating: auth}
	var err error
	l.in, err = zmqlink.Listen("tcp://127.0.0.1:0", func(frames [][]byte) error {
		m, err := pdproto.Decode(frames)
		if err != nil {
			l.bad.Add(1)
			return err
		}
		ch, ok := m.(*pdproto.KVChunk)
		if !ok {
			l.bad.Add(1)
			return fmt.Errorf("got %s", m.Type())
		}
		l.gotBytes.Add(uint64(ch.PayloadBytes()))
		l.last.Store(time.Now().UnixNano())
		l.got.Add(1)
		return nil
	}, &zmqlink.InboxOptions{SocketOptions: so})
	if err != nil {
		return nil, err
	}
	if l.out, err = zmqlink.NewOutbox(&zmqlink.OutboxOptions{SocketOptions: so}); err != nil {
		l.in.Close()
		return nil, err
	}
	if err := l.send(&pdproto.KVChunk{Room: 1}); err != nil {
		l.close()
		return nil, err
	}
	if err := l.wait(1, 10*time.Second); err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

func (l *kvLink) close() {
	l.out.Close()
	l.in.Close()
}

func (l *kvLink) send(m *pdproto.KVChunk) error {
	frames, err := pdproto.Encode(m)
	if err != nil {
		return err
	}
	return l.out.Send(l.ctx, l.in.Endpoint(), frames)
}

// wait polls until n chunks have arrived since the counters were reset.
func (l *kvLink) wait(n int64, within time.Duration) error {
	deadline := time.Now().Add(within)
	for l.got.Load() < n {
		if b := l.bad.Load(); b > 0 {
			return fmt.Errorf("bench: %d KV chunks failed to decode", b)
		}
		if time.Now().After(deadline) {
			st := l.out.Stats()
			return fmt.Errorf("bench: %d of %d KV chunks arrived (outbox: %d sent, %d dropped, %d send errors)", l.got.Load(), n, st.Sent, st.Dropped, st.SendErrors)
		}
		if err := l.ctx.Err(); err != nil {
			return err
		}
		time.Sleep(200 * time.Microsecond)
	}
	return nil
}

// run sends copies of msg for about d and adds what arrived, and the time
// from the first send to the last chunk's arrival, to the link's totals;
// it returns the run's rate in MB/s.
func (l *kvLink) run(msg *pdproto.KVChunk, d time.Duration) (float64, error) {
	l.got.Store(0)
	l.gotBytes.Store(0)
	start := time.Now()
	n := 0
	for n == 0 || time.Since(start) < d {
		// Keep a bounded window in flight, so that the loop measures the
		// steady rate and ends about d after it started, not after a
		// backlog of the Outbox's whole pending allowance drains.
		for int64(n)-l.got.Load() >= transportWindow {
			time.Sleep(50 * time.Microsecond)
		}
		m := *msg
		m.Chunk = uint32(n)
		if err := l.send(&m); err != nil {
			return 0, err
		}
		n++
	}
	if err := l.wait(int64(n), 30*time.Second); err != nil {
		return 0, err
	}
	bytes, elapsed := l.gotBytes.Load(), time.Unix(0, l.last.Load()).Sub(start)
	l.messages += n
	l.bytes += bytes
	l.elapsed += elapsed
	return float64(bytes) / elapsed.Seconds() / 1e6, nil
}

// rawTCP writes n messages of size bytes over a loopback TCP connection,
// read into one reused buffer, and returns the time from the first write
// to the last byte read.
func rawTCP(size, n int) (time.Duration, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	type result struct {
		end time.Time
		err error
	}
	done := make(chan result, 1)
	go func() {
		conn, err := l.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer conn.Close()
		buf := make([]byte, size)
		for range n {
			if _, err := io.ReadFull(conn, buf); err != nil {
				done <- result{err: err}
				return
			}
		}
		done <- result{end: time.Now()}
	}()
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = byte(i * 131)
	}
	start := time.Now()
	for range n {
		if _, err := conn.Write(payload); err != nil {
			return 0, err
		}
	}
	r := <-done
	if r.err != nil {
		return 0, r.err
	}
	return r.end.Sub(start), nil
}

// Print writes the report as a table.
func (r *PDReport) Print(w io.Writer) {
	c, mc := r.Config, r.Model
	fmt.Fprintf(w, "\nPD vs colocated: built-in %s %s model, %v (dim %d, %d layers, %d KV heads × %d), TP %d, %d thread(s) per rank; %d requests per length, one at a time, %d greedy tokens each (ignore_eos); KV (%s) over ZeroMQ on loopback\n\n",
		c.Arch, c.Size, c.Type, mc.Dim, mc.Layers, mc.KVHeads, mc.HeadDim, c.TP, c.Threads, c.Requests, c.MaxTokens, kernels.KVName(c.KVType))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "prompt\trequests\tcolocated TTFT p50 ms\tp99 ms\tPD TTFT p50 ms\tp99 ms\tPD/colocated p50\tPD added p50 ms\tKV bytes/req\tKV MB/s over PD TTFT\t\n")
	for _, l := range r.Lengths {
		fmt.Fprintf(tw, "%d\t%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.2fx\t%.1f\t%d\t%.0f\t\n",
			l.PromptLen, l.Requests, l.ColP50, l.ColP99, l.PDP50, l.PDP99, l.Ratio(), l.PDP50-l.ColP50, l.KVBytes, l.KVRate)
	}
	tw.Flush()
	fmt.Fprintf(w, "PD greedy tokens equal colocated for all %d requests\n", r.Compared)
	fmt.Fprintln(w, "TTFT: submission (prefill and decode halves at once, as a router does) to the first token event of the decode stream; KV MB/s over PD TTFT includes the prefill's compute")

	t := r.Transport
	fmt.Fprintf(w, "\nKV transport alone: %d-token KV_CHUNK messages of one rank's shard (%d KiB payload, pdproto encode + decode, zmqlink Outbox → Inbox), without and with PLAIN authentication in %d interleaved rounds, vs raw loopback TCP into a reused buffer moving the unauthenticated link's %d messages (%.1f MiB), in the same run\n\n",
		t.ChunkTokens, t.MsgBytes>>10, transportRounds, t.Messages, float64(t.Bytes)/(1<<20))
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "transport\tmessages\tMB/s\tseconds\t\n")
	fmt.Fprintf(tw, "ZeroMQ KV_CHUNK\t%d\t%.0f\t%.2f\t\n", t.Messages, t.ZMQ, t.ZMQElapsed.Seconds())
	fmt.Fprintf(tw, "ZeroMQ KV_CHUNK, PLAIN\t%d\t%.0f\t%.2f\t\n", t.PlainMessages, t.Plain, t.PlainElapsed.Seconds())
	fmt.Fprintf(tw, "raw TCP\t%d\t%.0f\t%.2f\t\n", t.Messages, t.Raw, t.RawElapsed.Seconds())
	tw.Flush()
	meets := func(ok bool) string {
		if ok {
			return "meets"
		}
		return "misses"
	}
	fmt.Fprintf(w, "ratio ZeroMQ / raw TCP: %.2f (goal ≥ %.1f: %s)\n", t.Ratio(), PDRatioGoal, meets(t.Ratio() >= PDRatioGoal))
	var lo, hi float64
	if len(t.AuthRounds) > 0 {
		lo, hi = slices.Min(t.AuthRounds), slices.Max(t.AuthRounds)
	}
	fmt.Fprintf(w, "ratio PLAIN / no authentication: %.2f, per round %.2f to %.2f, 95%% bound %.2f (goal: authentication costs at most 10%%, the bound ≥ %.1f: %s)\n",
		t.AuthRatio(), lo, hi, t.AuthBound(), PDAuthGoal, meets(t.AuthBound() >= PDAuthGoal))
	fmt.Fprintln(w, "transport (engine/pd/zmqlink/doc.go): the KV path (a prefill rank's Outbox, a decode rank's Inbox) uses zmqlink's zero-copy cgo shim over libzmq; control messages use pebbe/zmq4, whose copies on send and receive would hold KV to about half of raw TCP")
}

// btoi is 1 for true, 0 for false.
func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
