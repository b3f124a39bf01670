package pdproto

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// Version is the protocol version carried in the guard frame. A change to
// any message's layout bumps it; a receiver drops messages of any other
// version (ErrVersion). docs/protocol.md lists what each version changed.
const Version byte = 5

// guardMagic starts frame 0; Version follows it.
const guardMagic = "PDKIT"

// Guard returns frame 0 as this package writes it: "PDKIT" and Version.
func Guard() []byte { return append([]byte(guardMagic), Version) }

// Frame positions common to every message.
const (
	frameGuard   = 0
	frameType    = 1
	frameHeader  = 2
	firstPayload = 3
	// layerFrames is the number of payload frames per layer of a KV_CHUNK:
	// K, V, index-K, index-K scales.
	layerFrames = 4
)

// KV_CHUNK flag bits (header byte "flags").
const flagLast = 1 << 0

// HEARTBEAT flag bits.
const flagReply = 1 << 0

// ErrMalformed is matched (errors.Is) by every error Decode returns.
var ErrMalformed = errors.New("pdproto: malformed message")

// ErrVersion is matched by a decode error for a missing or wrong guard frame:
// foreign traffic or another protocol version.
var ErrVersion = errors.New("pdproto: wrong guard or protocol version")

// ErrUnknownType is matched by a decode error for a type frame that names
// no message type.
var ErrUnknownType = errors.New("pdproto: unknown message type")

// DecodeError is a decode failure. It matches ErrMalformed, and Kind
// (ErrMalformed, ErrVersion or ErrUnknownType) under errors.Is.
type DecodeError struct {
	Kind  error  // ErrMalformed, ErrVersion or ErrUnknownType
	Type  Type   // the message type, when frame 1 was read
	Frame int    // index of the frame at fault; -1 for the frame count
	Field string // the field at fault, e.g. "pages" or "layer[3].v"
	Msg   string // what is wrong
}

func (e *DecodeError) Error() string {
	where := "frames"
	if e.Frame >= 0 {
		where = fmt.Sprintf("frame %d", e.Frame)
	}
	if e.Field != "" {
		where += " (" + e.Field + ")"
	}
	if e.Type != "" {
		where = string(e.Type) + " " + where
	}
	return fmt.Sprintf("%v: %s: %s", e.Kind, where, e.Msg)
}

// Unwrap returns Kind.
func (e *DecodeError) Unwrap() error { return e.Kind }

// Is reports that every DecodeError is an ErrMalformed.
func (e *DecodeError) Is(target error) bool { return target == ErrMalformed }

// Encode returns the frames of m. Frames 0–2 share one small allocation;
// the payload frames of a KV_CHUNK are the caller's slices themselves, so
// the caller must not modify them until the transport has sent them. It
// fails for a nil message and for fields the wire cannot carry (an invalid
// KVPoll, Start > End, a length over 4 GiB).
func Encode(m Message) ([][]byte, error) {
	switch m := m.(type) {
	case *TransferInfo:
		if m != nil {
			return encodeTransferInfo(m)
		}
	case *KVChunk:
		if m != nil {
			return encodeKVChunk(m)
		}
	case *Status:
		if m != nil {
			return encodeStatus(m)
		}
	case *Abort:
		if m != nil {
			return encodeAbort(m)
		}
	case *AbortAck:
		if m != nil {
			return encodeAbortAck(m)
		}
	case *Heartbeat:
		if m != nil {
			return encodeHeartbeat(m)
		}
	case *Queued:
		if m != nil {
			return encodeQueued(m)
		}
	}
	return nil, fmt.Errorf("pdproto: cannot encode %T(nil)", m)
}

// start allocates the guard, type and header frames in one buffer and
// returns the buffer with the guard and type written and the frame list.
func start(t Type, headerLen, payloadFrames int) (buf []byte, frames [][]byte) {
	buf = make([]byte, 0, len(guardMagic)+1+len(t)+headerLen)
	buf = append(buf, guardMagic...)
	buf = append(buf, Version)
	buf = append(buf, t...)
	frames = make([][]byte, firstPayload, firstPayload+payloadFrames)
	return buf, frames
}

// finish cuts buf into frames 0, 1 and 2, each with its capacity limited to
// its length so that appending to one never overwrites the next.
func finish(t Type, buf []byte, frames [][]byte) [][]byte {
	g := len(guardMagic) + 1
	h := g + len(t)
	frames[frameGuard] = buf[:g:g]
	frames[frameType] = buf[g:h:h]
	frames[frameHeader] = buf[h:len(buf):len(buf)]
	return frames
}

func checkLen(field string, n int) error {
	if uint64(n) > math.MaxUint32 {
		return fmt.Errorf("pdproto: %s is %d bytes, over the wire's 4 GiB limit", field, n)
	}
	return nil
}

func appendU32(b []byte, v uint32) []byte { return binary.LittleEndian.AppendUint32(b, v) }
func appendU64(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }
func appendStr(b []byte, s string) []byte { return append(appendU32(b, uint32(len(s))), s...) }

func boolByte(v bool) byte {
	if v {
		return 1
	}
	return 0
}

func encodeTransferInfo(m *TransferInfo) ([][]byte, error) {
	for _, f := range []struct {
		name string
		n    int
	}{{"endpoint", len(m.Endpoint)}, {"index_k_dtype", len(m.IndexKDType)}, {"request_id", len(m.RequestID)}, {"pages", len(m.Pages)}} {
		if err := checkLen(f.name, f.n); err != nil {
			return nil, err
		}
	}
	n := 8 + 4 + 4 + len(m.Prompt) + 4 + len(m.Endpoint) + 4 + len(m.IndexKDType) + 4 + len(m.RequestID) + 4 + 4*len(m.Pages)
	buf, frames := start(TypeTransferInfo, n, 0)
	buf = appendU64(buf, m.Room)
	buf = appendU32(buf, m.Rank)
	buf = appendU32(buf, m.Tokens)
	buf = append(buf, m.Prompt[:]...)
	buf = appendStr(buf, m.Endpoint)
	buf = appendStr(buf, m.IndexKDType)
	buf = appendStr(buf, m.RequestID)
	buf = appendU32(buf, uint32(len(m.Pages)))
	for _, p := range m.Pages {
		buf = appendU32(buf, p)
	}
	return finish(TypeTransferInfo, buf, frames), nil
}

func encodeKVChunk(m *KVChunk) ([][]byte, error) {
	if m.Start > m.End {
		return nil, fmt.Errorf("pdproto: KV_CHUNK token range [%d, %d) is reversed", m.Start, m.End)
	}
	if err := checkLen("layers", len(m.Layers)); err != nil {
		return nil, err
	}
	n := 8 + 4 + 4 + 4 + len(m.Prompt) + 1 + 4 + 16*len(m.Layers)
	if m.Final != nil {
		n += 12
	}
	buf, frames := start(TypeKVChunk, n, layerFrames*len(m.Layers))
	buf = appendU64(buf, m.Room)
	buf = appendU32(buf, m.Chunk)
	buf = appendU32(buf, m.Start)
	buf = appendU32(buf, m.End)
	buf = append(buf, m.Prompt[:]...)
	var flags byte
	if m.Final != nil {
		flags |= flagLast
	}
	buf = append(buf, flags)
	buf = appendU32(buf, uint32(len(m.Layers)))
	for i, l := range m.Layers {
		for j, p := range [layerFrames][]byte{l.K, l.V, l.IndexK, l.IndexKScales} {
			if uint64(len(p)) > math.MaxUint32 {
				return nil, checkLen(layerField(i, j), len(p))
			}
			buf = appendU32(buf, uint32(len(p)))
			frames = append(frames, p)
		}
	}
	if f := m.Final; f != nil {
		buf = appendU32(buf, uint32(f.FirstToken))
		buf = appendU32(buf, f.PromptTokens)
		buf = appendU32(buf, f.CachedTokens)
	}
	return finish(TypeKVChunk, buf, frames), nil
}

var layerParts = [layerFrames]string{"k", "v", "index_k", "index_k_scales"}

func layerField(layer, part int) string { return fmt.Sprintf("layer[%d].%s", layer, layerParts[part]) }

func encodeStatus(m *Status) ([][]byte, error) {
	if !m.State.Valid() {
		return nil, fmt.Errorf("pdproto: STATUS state %v is not a KVPoll state", m.State)
	}
	if err := checkLen("error", len(m.Error)); err != nil {
		return nil, err
	}
	buf, frames := start(TypeStatus, 8+4+1+4+len(m.Error)+1, 0)
	buf = appendU64(buf, m.Room)
	buf = appendU32(buf, m.Rank)
	buf = append(buf, byte(m.State))
	buf = appendStr(buf, m.Error)
	buf = append(buf, boolByte(m.Asked))
	return finish(TypeStatus, buf, frames), nil
}

func encodeAbort(m *Abort) ([][]byte, error) {
	if err := checkLen("endpoint", len(m.Endpoint)); err != nil {
		return nil, err
	}
	if err := checkLen("reason", len(m.Reason)); err != nil {
		return nil, err
	}
	buf, frames := start(TypeAbort, 8+4+4+len(m.Endpoint)+4+len(m.Reason)+1, 0)
	buf = appendU64(buf, m.Room)
	buf = appendU32(buf, m.Rank)
	buf = appendStr(buf, m.Endpoint)
	buf = appendStr(buf, m.Reason)
	buf = append(buf, boolByte(m.Asked))
	return finish(TypeAbort, buf, frames), nil
}

func encodeAbortAck(m *AbortAck) ([][]byte, error) {
	buf, frames := start(TypeAbortAck, 8+4+1+1, 0)
	buf = appendU64(buf, m.Room)
	buf = appendU32(buf, m.Rank)
	buf = append(buf, boolByte(m.InFlight), boolByte(m.Known))
	return finish(TypeAbortAck, buf, frames), nil
}

func encodeHeartbeat(m *Heartbeat) ([][]byte, error) {
	if err := checkLen("sender", len(m.Sender)); err != nil {
		return nil, err
	}
	buf, frames := start(TypeHeartbeat, 8+8+8+1+4+len(m.Sender), 0)
	buf = appendU64(buf, m.Boot)
	buf = appendU64(buf, m.Seq)
	buf = appendU64(buf, uint64(m.UnixNano))
	var flags byte
	if m.Reply {
		flags |= flagReply
	}
	buf = append(buf, flags)
	buf = appendStr(buf, m.Sender)
	return finish(TypeHeartbeat, buf, frames), nil
}

func encodeQueued(m *Queued) ([][]byte, error) {
	if err := checkLen("endpoint", len(m.Endpoint)); err != nil {
		return nil, err
	}
	buf, frames := start(TypeQueued, 8+4+len(m.Endpoint)+4+4, 0)
	buf = appendU64(buf, m.Room)
	buf = appendStr(buf, m.Endpoint)
	buf = appendU32(buf, m.Rank)
	buf = appendU32(buf, m.Position)
	return finish(TypeQueued, buf, frames), nil
}

// Decode parses the frames of one multipart message. Byte payloads of a
// KV_CHUNK alias frames (nothing is copied); strings and page ids are
// copied. On failure it returns a *DecodeError and a nil Message.
func Decode(frames [][]byte) (Message, error) {
	if len(frames) == 0 {
		return nil, &DecodeError{Kind: ErrMalformed, Frame: -1, Msg: "no frames"}
	}
	if g := frames[frameGuard]; len(g) != len(guardMagic)+1 || string(g[:len(guardMagic)]) != guardMagic {
		return nil, &DecodeError{Kind: ErrVersion, Frame: frameGuard, Field: "guard", Msg: fmt.Sprintf("got %s, want %q and a version byte", quote(g), guardMagic)}
	} else if g[len(guardMagic)] != Version {
		return nil, &DecodeError{Kind: ErrVersion, Frame: frameGuard, Field: "version", Msg: fmt.Sprintf("version %d, this side speaks %d", g[len(guardMagic)], Version)}
	}
	if len(frames) <= frameType {
		return nil, &DecodeError{Kind: ErrMalformed, Frame: -1, Msg: "no type frame"}
	}
	t, ok := knownType(frames[frameType])
	if !ok {
		return nil, &DecodeError{Kind: ErrUnknownType, Frame: frameType, Field: "type", Msg: fmt.Sprintf("%s is no message type", quote(frames[frameType]))}
	}
	if len(frames) <= frameHeader {
		return nil, &DecodeError{Kind: ErrMalformed, Type: t, Frame: -1, Msg: "no header frame"}
	}
	r := &reader{t: t, b: frames[frameHeader]}
	var m Message
	switch t {
	case TypeTransferInfo:
		m = r.transferInfo()
	case TypeKVChunk:
		m = r.kvChunk(frames)
	case TypeStatus:
		m = r.status()
	case TypeAbort:
		m = r.abort()
	case TypeAbortAck:
		m = r.abortAck()
	case TypeHeartbeat:
		m = r.heartbeat()
	case TypeQueued:
		m = r.queued()
	}
	if r.err == nil && len(r.b) > 0 {
		r.fail(frameHeader, "", fmt.Sprintf("%d trailing bytes", len(r.b)))
	}
	if r.err == nil && t != TypeKVChunk && len(frames) != firstPayload {
		r.fail(firstPayload, "", fmt.Sprintf("%d frames, want %d: %s has no payload frames", len(frames), firstPayload, t))
	}
	if r.err != nil {
		return nil, r.err
	}
	return m, nil
}

func knownType(b []byte) (Type, bool) {
	for _, t := range Types {
		if string(b) == string(t) {
			return t, true
		}
	}
	return "", false
}

// quote shows at most 32 bytes of b.
func quote(b []byte) string {
	if len(b) > 32 {
		return fmt.Sprintf("%q… (%d bytes)", b[:32], len(b))
	}
	return fmt.Sprintf("%q", b)
}

// reader consumes the header frame; after the first failure every read
// returns zero values and err keeps the first failure.
type reader struct {
	t   Type
	b   []byte
	err *DecodeError
}

func (r *reader) fail(frame int, field, msg string) {
	if r.err == nil {
		r.err = &DecodeError{Kind: ErrMalformed, Type: r.t, Frame: frame, Field: field, Msg: msg}
	}
}

func (r *reader) take(field string, n int) []byte {
	if r.err != nil {
		return nil
	}
	if len(r.b) < n {
		r.fail(frameHeader, field, fmt.Sprintf("needs %d bytes, %d left", n, len(r.b)))
		return nil
	}
	p := r.b[:n]
	r.b = r.b[n:]
	return p
}

func (r *reader) u8(field string) byte {
	if p := r.take(field, 1); p != nil {
		return p[0]
	}
	return 0
}

func (r *reader) u32(field string) uint32 {
	if p := r.take(field, 4); p != nil {
		return binary.LittleEndian.Uint32(p)
	}
	return 0
}

func (r *reader) u64(field string) uint64 {
	if p := r.take(field, 8); p != nil {
		return binary.LittleEndian.Uint64(p)
	}
	return 0
}

func (r *reader) fingerprint(field string) (f Fingerprint) {
	copy(f[:], r.take(field, len(f)))
	return f
}

func (r *reader) str(field string) string {
	n := r.u32(field + ".len")
	if r.err == nil && uint64(n) > uint64(len(r.b)) {
		r.fail(frameHeader, field, fmt.Sprintf("length %d, %d bytes left", n, len(r.b)))
	}
	return string(r.take(field, int(n)))
}

// flags reads a flag byte and rejects bits outside allowed.
func (r *reader) flags(field string, allowed byte) byte {
	f := r.u8(field)
	if r.err == nil && f&^allowed != 0 {
		r.fail(frameHeader, field, fmt.Sprintf("unknown bits %#02x", f&^allowed))
	}
	return f
}

func (r *reader) transferInfo() *TransferInfo {
	m := &TransferInfo{}
	m.Room = r.u64("room")
	m.Rank = r.u32("rank")
	m.Tokens = r.u32("tokens")
	m.Prompt = r.fingerprint("prompt")
	m.Endpoint = r.str("endpoint")
	m.IndexKDType = r.str("index_k_dtype")
	m.RequestID = r.str("request_id")
	n := r.u32("pages.len")
	if r.err == nil && uint64(n)*4 > uint64(len(r.b)) {
		r.fail(frameHeader, "pages", fmt.Sprintf("%d pages need %d bytes, %d left", n, uint64(n)*4, len(r.b)))
	}
	if r.err == nil && n > 0 {
		m.Pages = make([]uint32, n)
		for i := range m.Pages {
			m.Pages[i] = r.u32("pages")
		}
	}
	return m
}

func (r *reader) kvChunk(frames [][]byte) *KVChunk {
	m := &KVChunk{}
	m.Room = r.u64("room")
	m.Chunk = r.u32("chunk")
	m.Start = r.u32("start")
	m.End = r.u32("end")
	if r.err == nil && m.Start > m.End {
		r.fail(frameHeader, "end", fmt.Sprintf("token range [%d, %d) is reversed", m.Start, m.End))
	}
	m.Prompt = r.fingerprint("prompt")
	flags := r.flags("flags", flagLast)
	n := r.u32("layers")
	if r.err != nil {
		return nil
	}
	if uint64(n)*16 > uint64(len(r.b)) {
		r.fail(frameHeader, "layers", fmt.Sprintf("%d layers need %d bytes of lengths, %d left", n, uint64(n)*16, len(r.b)))
		return nil
	}
	if want := uint64(firstPayload) + layerFrames*uint64(n); uint64(len(frames)) != want {
		r.fail(-1, "layers", fmt.Sprintf("%d frames, want %d for %d layers", len(frames), want, n))
		return nil
	}
	if n > 0 {
		m.Layers = make([]LayerKV, n)
	}
	for i := range m.Layers {
		l := &m.Layers[i]
		for j, dst := range [layerFrames]*[]byte{&l.K, &l.V, &l.IndexK, &l.IndexKScales} {
			want := r.u32("layer lengths")
			f := firstPayload + layerFrames*i + j
			if r.err != nil {
				return nil
			}
			if uint64(len(frames[f])) != uint64(want) {
				r.fail(f, layerField(i, j), fmt.Sprintf("%d bytes, header says %d", len(frames[f]), want))
				return nil
			}
			if want > 0 {
				*dst = frames[f]
			}
		}
	}
	if flags&flagLast != 0 {
		m.Final = &ChunkFinal{
			FirstToken:   int32(r.u32("first_token")),
			PromptTokens: r.u32("prompt_tokens"),
			CachedTokens: r.u32("cached_tokens"),
		}
	}
	return m
}

func (r *reader) status() *Status {
	m := &Status{}
	m.Room = r.u64("room")
	m.Rank = r.u32("rank")
	m.State = KVPoll(r.u8("state"))
	if r.err == nil && !m.State.Valid() {
		r.fail(frameHeader, "state", fmt.Sprintf("%v is not a KVPoll state", m.State))
	}
	m.Error = r.str("error")
	m.Asked = r.flags("asked", 1) != 0
	return m
}

func (r *reader) abort() *Abort {
	m := &Abort{}
	m.Room = r.u64("room")
	m.Rank = r.u32("rank")
	m.Endpoint = r.str("endpoint")
	m.Reason = r.str("reason")
	m.Asked = r.flags("asked", 1) != 0
	return m
}

func (r *reader) abortAck() *AbortAck {
	m := &AbortAck{}
	m.Room = r.u64("room")
	m.Rank = r.u32("rank")
	m.InFlight = r.flags("in_flight", 1) != 0
	m.Known = r.flags("known", 1) != 0
	return m
}

func (r *reader) queued() *Queued {
	m := &Queued{}
	m.Room = r.u64("room")
	m.Endpoint = r.str("endpoint")
	m.Rank = r.u32("rank")
	m.Position = r.u32("position")
	return m
}

func (r *reader) heartbeat() *Heartbeat {
	m := &Heartbeat{}
	m.Boot = r.u64("boot")
	m.Seq = r.u64("seq")
	m.UnixNano = int64(r.u64("unix_nano"))
	m.Reply = r.flags("flags", flagReply)&flagReply != 0
	m.Sender = r.str("sender")
	return m
}
