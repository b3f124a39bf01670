package serve

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/kernels"
)

// The two messages rank 0 broadcasts every step. They carry everything the
// ranks must agree on that does not come out of a reduction: the clock, the
// new requests, the aborts, the sampled tokens. Every rank, rank 0 included,
// applies the decoded bytes, so all of them act on exactly the same values.

// stepInput opens an iteration.
type stepInput struct {
	now    time.Duration // since the engine's epoch, rank 0's clock
	stop   bool          // the engine is closing: every loop returns
	adds   []addMsg
	aborts []abortMsg // applied after adds; unknown or finished ids are ignored
	tier   *tierOp    // a HiCache switch, applied before the adds
	// switchIndexK switches every rank's index-K precision to indexK
	// (indexk.go); the ranks hold no request then.
	switchIndexK bool
	indexK       kernels.IndexKDType
	// indexKTier is the host tier's pages per rank in the new layout when
	// it is on (rank 0 sizes it once for all), 0 to leave it off.
	indexKTier int
	// offload is an Offload's prompt (hicache.go), nil when none.
	offload []int32
}

// addMsg is a new request as the ranks need it (the sampler and the stream
// stay on rank 0).
type addMsg struct {
	id        uint64
	maxTokens int
	ignoreEOS bool
	prompt    []int32
	stop      []int32
	pd        bool   // a PD request: room (and, on a decode server, url) are set
	room      uint64 // bootstrap room
	url       string // the prefill's bootstrap registry (decode role)
	n         int    // samples (Request.N, at least 1): ids id..id+n-1
	noCache   bool   // Request.NoCache
	probe     bool   // Request.Probe: its pages go to the cache cold
	tag       string // Request.Tag, for log lines only
}

// seq is the core's state of a request a from its prompt: room for its
// tokens to come, its own copy of the stop tokens.
func (a addMsg) seq() rankcore.Seq {
	return rankcore.Seq{Tokens: append(make([]int32, 0, len(a.prompt)+a.maxTokens), a.prompt...),
		MaxTokens: a.maxTokens, IgnoreEOS: a.ignoreEOS, Stop: slices.Clone(a.stop)}
}

// stepOutput closes a step that ran a forward pass.
type stepOutput struct {
	now  time.Duration
	cuts []abortMsg // requests aborted while the step ran, applied before the tokens
	// toks has one entry per Run item that wants logits and is not cut
	// (before or by this message), in plan order; the first token of a
	// request with more samples is followed by theirs (n-1 entries).
	toks []rankcore.Sampled
}

var errWire = errors.New("serve: corrupt step message")

func (m *stepInput) encode(b []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(m.now))
	b = appendBool(b, m.stop)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(m.adds)))
	for _, a := range m.adds {
		b = binary.LittleEndian.AppendUint64(b, a.id)
		b = binary.LittleEndian.AppendUint32(b, uint32(a.maxTokens))
		b = appendBool(b, a.ignoreEOS)
		b = appendTokens(b, a.prompt)
		b = appendTokens(b, a.stop)
		b = appendBool(b, a.pd)
		b = binary.LittleEndian.AppendUint64(b, a.room)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(a.url)))
		b = append(b, a.url...)
		b = binary.LittleEndian.AppendUint32(b, uint32(a.n))
		b = appendBool(b, a.noCache)
		b = appendBool(b, a.probe)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(a.tag)))
		b = append(b, a.tag...)
	}
	b = appendAborts(b, m.aborts)
	switch {
	case m.tier == nil:
		b = append(b, 0)
	case m.tier.off:
		b = append(b, 2)
	default:
		b = append(b, 1)
		b = binary.LittleEndian.AppendUint64(b, uint64(m.tier.pages))
	}
	b = appendBool(b, m.switchIndexK)
	b = append(b, byte(m.indexK))
	b = binary.LittleEndian.AppendUint32(b, uint32(m.indexKTier))
	return appendTokens(b, m.offload)
}

func (m *stepInput) decode(b []byte) error {
	r := reader{b: b}
	*m = stepInput{now: time.Duration(r.u64()), stop: r.bool()}
	n := r.count(8 + 4 + 1 + 4 + 4 + 1 + 8 + 4 + 4 + 1 + 1 + 4)
	for range n {
		a := addMsg{id: r.u64(), maxTokens: int(r.u32()), ignoreEOS: r.bool()}
		a.prompt = r.tokens()
		a.stop = r.tokens()
		a.pd = r.bool()
		a.room = r.u64()
		a.url = string(r.take(r.count(1)))
		a.n = int(r.u32())
		a.noCache = r.bool()
		a.probe = r.bool()
		a.tag = string(r.take(r.count(1)))
		if r.err == nil && len(a.prompt) == 0 {
			return fmt.Errorf("%w: request %d with an empty prompt", errWire, a.id)
		}
		m.adds = append(m.adds, a)
	}
	m.aborts = r.aborts()
	switch op := r.take(1); {
	case op == nil || op[0] == 0:
	case op[0] == 2:
		m.tier = &tierOp{off: true}
	case op[0] == 1:
		pages := r.u64()
		if pages < 1 || pages > math.MaxInt32 {
			return fmt.Errorf("%w: hicache on with %d pages", errWire, pages)
		}
		m.tier = &tierOp{pages: int(pages)}
	default:
		return fmt.Errorf("%w: hicache switch %d", errWire, op[0])
	}
	m.switchIndexK = r.bool()
	if v := r.take(1); v != nil {
		m.indexK = kernels.IndexKDType(v[0])
		if m.switchIndexK && m.indexK != kernels.IndexFP8 && m.indexK != kernels.IndexBF16 {
			return fmt.Errorf("%w: index-K precision %d", errWire, v[0])
		}
	}
	m.indexKTier = int(r.u32())
	if m.indexKTier > math.MaxInt32 {
		return fmt.Errorf("%w: host tier of %d pages", errWire, m.indexKTier)
	}
	if t := r.tokens(); len(t) > 0 {
		m.offload = t
	}
	return r.done()
}

func (m *stepOutput) encode(b []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(m.now))
	b = appendAborts(b, m.cuts)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(m.toks)))
	for _, s := range m.toks {
		b = binary.LittleEndian.AppendUint32(b, uint32(s.Tok))
		b = appendBool(b, s.Stop)
	}
	return b
}

func (m *stepOutput) decode(b []byte) error {
	r := reader{b: b}
	*m = stepOutput{now: time.Duration(r.u64())}
	m.cuts = r.aborts()
	n := r.count(5)
	m.toks = make([]rankcore.Sampled, 0, n)
	for range n {
		m.toks = append(m.toks, rankcore.Sampled{Tok: int32(r.u32()), Stop: r.bool()})
	}
	return r.done()
}

func appendBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}

func appendTokens(b []byte, ts []int32) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(ts)))
	for _, t := range ts {
		b = binary.LittleEndian.AppendUint32(b, uint32(t))
	}
	return b
}

func appendAborts(b []byte, as []abortMsg) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(as)))
	for _, a := range as {
		b = binary.LittleEndian.AppendUint64(b, a.id)
		b = append(b, byte(a.by))
	}
	return b
}

// reader decodes little-endian fields; the first short read sets err and
// every later read returns zero.
type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil || len(r.b) < n {
		if r.err == nil {
			r.err = fmt.Errorf("%w: %d bytes short", errWire, n-len(r.b))
		}
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u64() uint64 {
	if v := r.take(8); v != nil {
		return binary.LittleEndian.Uint64(v)
	}
	return 0
}

func (r *reader) u32() uint32 {
	if v := r.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (r *reader) bool() bool {
	v := r.take(1)
	if v != nil && v[0] > 1 {
		r.err = fmt.Errorf("%w: boolean byte %d", errWire, v[0])
		return false
	}
	return v != nil && v[0] == 1
}

// count reads an element count and refuses one that the remaining bytes
// cannot hold at minSize bytes per element.
func (r *reader) count(minSize int) int {
	n := int(r.u32())
	if r.err == nil && n*minSize > len(r.b) {
		r.err = fmt.Errorf("%w: %d elements in %d bytes", errWire, n, len(r.b))
	}
	if r.err != nil {
		return 0
	}
	return n
}

func (r *reader) tokens() []int32 {
	n := r.count(4)
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(r.u32())
	}
	return out
}

func (r *reader) aborts() []abortMsg {
	n := r.count(9)
	out := make([]abortMsg, n)
	for i := range out {
		out[i] = abortMsg{id: r.u64(), by: AbortBy(r.byte())}
	}
	return out
}

func (r *reader) byte() byte {
	if v := r.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (r *reader) done() error {
	if r.err == nil && len(r.b) != 0 {
		r.err = fmt.Errorf("%w: %d trailing bytes", errWire, len(r.b))
	}
	return r.err
}
