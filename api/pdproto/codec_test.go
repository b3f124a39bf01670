package pdproto

import (
	"bytes"
	"errors"
	"reflect"
	"slices"
	"strconv"
	"testing"
)

func filled(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

// samples holds at least one message of every type, with empty lists and
// strings, extreme values and a large payload among them.
func samples() []Message {
	return []Message{
		&TransferInfo{},
		&TransferInfo{
			Room: 0x7fff_ffff_ffff_fff1, Endpoint: "tcp://127.0.0.1:41003", Rank: 1,
			Pages: []uint32{7, 8, 9, 0xffff_ffff}, Tokens: 200, IndexKDType: "fp8", RequestID: "cmpl-42",
			Prompt: PromptFingerprint([]int32{1, 2, 3}),
		},
		&TransferInfo{Room: 1, Pages: make([]uint32, 100_000), IndexKDType: "bf16", RequestID: "é\x00\xff"},
		&KVChunk{},
		&KVChunk{Room: 3, Chunk: 0, Start: 0, End: 64, Layers: []LayerKV{
			{K: filled(64, 1), V: filled(64, 2), IndexK: filled(16, 3), IndexKScales: filled(4, 4)},
			{K: filled(64, 5), V: filled(64, 6)},
		}},
		&KVChunk{Room: 3, Chunk: 1, Start: 64, End: 100, Prompt: Fingerprint{0: 1, 15: 0xff}, Layers: []LayerKV{{}, {K: []byte{1}}},
			Final: &ChunkFinal{FirstToken: -1, PromptTokens: 100, CachedTokens: 32}},
		&KVChunk{Room: 4, Chunk: 9, Start: 5, End: 5, Final: &ChunkFinal{}},
		bigChunk(4, 1<<20),
		&Status{},
		&Status{Room: 5, Rank: 3, State: Success},
		&Status{Room: 5, Rank: 0, State: Failed, Error: "prefill aborted: client disconnected"},
		&Status{Room: 5, Rank: 1, State: Failed, Error: "aborted on the prefill: aborted by an operator", Asked: true},
		&Abort{},
		&Abort{Room: 6, Endpoint: "tcp://10.0.0.2:5555", Rank: 1, Reason: "timeout in Transferring after 5s"},
		&Abort{Room: 7, Endpoint: "tcp://10.0.0.2:5555", Rank: 0, Reason: "aborted by the client", Asked: true},
		&AbortAck{},
		&AbortAck{Room: 6, Rank: 1, InFlight: true},
		&AbortAck{Room: 1<<64 - 1, Rank: 2, Known: true},
		&AbortAck{Room: 6, Rank: 1, InFlight: true, Known: true},
		&Heartbeat{},
		&Heartbeat{Sender: "tcp://10.0.0.2:5555", Boot: 0xdead_beef, Seq: 1 << 63, UnixNano: -5, Reply: true},
		&Queued{},
		&Queued{Room: 1 << 62, Endpoint: "tcp://10.0.0.2:5555", Rank: 3, Position: 0xffff_ffff},
	}
}

// bigChunk is a KV_CHUNK of about total payload bytes over layers layers.
func bigChunk(layers, total int) *KVChunk {
	per := total / layers
	c := &KVChunk{Room: 42, Chunk: 2, Start: 128, End: 192, Final: &ChunkFinal{FirstToken: 17, PromptTokens: 192}}
	for i := range layers {
		c.Layers = append(c.Layers, LayerKV{
			K: filled(per*3/8, byte(i)), V: filled(per*3/8, byte(i+1)),
			IndexK: filled(per/4-per/64, byte(i+2)), IndexKScales: filled(per/64, byte(i+3)),
		})
	}
	return c
}

func mustEncode(t testing.TB, m Message) [][]byte {
	t.Helper()
	frames, err := Encode(m)
	if err != nil {
		t.Fatalf("Encode(%T): %v", m, err)
	}
	return frames
}

func cloneFrames(frames [][]byte) [][]byte {
	out := make([][]byte, len(frames))
	for i, f := range frames {
		out[i] = bytes.Clone(f)
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	seen := map[Type]bool{}
	for _, m := range samples() {
		seen[m.Type()] = true
		frames := mustEncode(t, m)
		if string(frames[0]) != "PDKIT\x05" || string(frames[1]) != string(m.Type()) {
			t.Fatalf("%T: frames 0 and 1 are %q %q", m, frames[0], frames[1])
		}
		got, err := Decode(cloneFrames(frames))
		if err != nil {
			t.Fatalf("Decode(Encode(%T)): %v", m, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("round trip of %T:\n got %+v\nwant %+v", m, got, m)
		}
		again := mustEncode(t, got)
		if !framesEqual(again, frames) {
			t.Fatalf("%T re-encodes differently", m)
		}
	}
	for _, ty := range Types {
		if !seen[ty] {
			t.Errorf("no sample of %s", ty)
		}
	}
}

func framesEqual(a, b [][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

func TestFrameCountsAndPayloadFrames(t *testing.T) {
	c := bigChunk(3, 3000)
	frames := mustEncode(t, c)
	if len(frames) != 3+4*3 {
		t.Fatalf("%d frames, want 15", len(frames))
	}
	for i, l := range c.Layers {
		for j, p := range [][]byte{l.K, l.V, l.IndexK, l.IndexKScales} {
			if f := frames[3+4*i+j]; &f[0] != &p[0] {
				t.Errorf("layer %d part %d was copied into its frame", i, j)
			}
		}
	}
	got, err := Decode(frames)
	if err != nil {
		t.Fatal(err)
	}
	if &got.(*KVChunk).Layers[1].V[0] != &frames[3+4+1][0] {
		t.Error("Decode copied a payload frame")
	}
	// Appending to a small frame must not overwrite its neighbour.
	s := mustEncode(t, &Status{Room: 1, State: Success, Error: "x"})
	_ = append(s[0], 'X')
	_ = append(s[1], 'Y')
	if _, err := Decode(s); err != nil {
		t.Fatalf("frames share capacity: %v", err)
	}
}

// TestTruncations cuts every encoded sample in every way: dropping trailing
// frames, and cutting any frame short by any number of bytes. Each must fail
// with ErrMalformed and a *DecodeError, never panic. Frames over 8 KiB (the
// large samples) are cut at every length near either end and at a stride in
// between; the small samples of the same shapes are cut everywhere.
func TestTruncations(t *testing.T) {
	for _, m := range samples() {
		frames := mustEncode(t, m)
		for n := range len(frames) {
			expectMalformed(t, m, "frames[:"+itoa(n)+"]", frames[:n])
		}
		for i, f := range frames {
			for cut := range len(f) {
				if len(f) > 8<<10 && cut > 4<<10 && len(f)-cut > 4<<10 && cut%4093 != 0 {
					continue
				}
				g := slices.Clone(frames)
				g[i] = f[:cut]
				expectMalformed(t, m, "frame "+itoa(i)+" cut to "+itoa(cut), g)
			}
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

func expectMalformed(t *testing.T, m Message, what string, frames [][]byte) {
	t.Helper()
	got, err := decodeNoPanic(t, frames)
	if err == nil {
		t.Fatalf("%T %s: decoded to %+v", m, what, got)
	}
	if !errors.Is(err, ErrMalformed) {
		t.Fatalf("%T %s: %v does not match ErrMalformed", m, what, err)
	}
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("%T %s: %T is not a *DecodeError", m, what, err)
	}
	if got != nil {
		t.Fatalf("%T %s: a message came with the error", m, what)
	}
}

func decodeNoPanic(t *testing.T, frames [][]byte) (m Message, err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("Decode panicked: %v", r)
		}
	}()
	return Decode(frames)
}

func TestExtraFramesAndTrailingBytes(t *testing.T) {
	for _, m := range samples() {
		frames := mustEncode(t, m)
		expectMalformed(t, m, "extra frame", append(cloneFrames(frames), []byte("x")))
		expectMalformed(t, m, "extra empty frame", append(cloneFrames(frames), nil))
		for i := range frames {
			g := cloneFrames(frames)
			g[i] = append(g[i], 0)
			expectMalformed(t, m, "frame "+itoa(i)+" with a trailing byte", g)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	status := mustEncode(t, &Status{Room: 1, State: Success})
	ack := mustEncode(t, &AbortAck{Room: 1})
	hb := mustEncode(t, &Heartbeat{})
	chunk := mustEncode(t, &KVChunk{Room: 1, Start: 1, End: 2, Layers: []LayerKV{{K: []byte("kk")}}})
	with := func(frames [][]byte, i int, f func([]byte) []byte) [][]byte {
		g := cloneFrames(frames)
		g[i] = f(g[i])
		return g
	}
	set := func(off int, v byte) func([]byte) []byte {
		return func(b []byte) []byte { b[off] = v; return b }
	}
	tests := []struct {
		name   string
		frames [][]byte
		kind   error
		field  string
	}{
		{"no frames", nil, ErrMalformed, ""},
		{"foreign guard", [][]byte{[]byte("NixlMsgGuard"), []byte("ABORT")}, ErrVersion, "guard"},
		{"sglang-style ABORT without guard", [][]byte{[]byte("ABORT"), []byte("123")}, ErrVersion, "guard"},
		{"empty guard", [][]byte{{}}, ErrVersion, "guard"},
		{"next version", with(status, 0, set(5, Version+1)), ErrVersion, "version"},
		{"guard only", status[:1], ErrMalformed, ""},
		{"unknown type", with(status, 1, func([]byte) []byte { return []byte("STATUS2") }), ErrUnknownType, "type"},
		{"lowercase type", with(status, 1, func([]byte) []byte { return []byte("status") }), ErrUnknownType, "type"},
		{"state out of range", with(status, 2, set(12, 5)), ErrMalformed, "state"},
		{"in_flight not a bool", with(ack, 2, set(12, 2)), ErrMalformed, "in_flight"},
		{"known not a bool", with(ack, 2, set(13, 2)), ErrMalformed, "known"},
		{"ABORT_ACK without known (version 2's layout)", with(ack, 2, func(b []byte) []byte { return b[:13] }), ErrMalformed, "known"},
		{"unknown heartbeat flag", with(hb, 2, set(24, 2)), ErrMalformed, "flags"},
		{"unknown chunk flag", with(chunk, 2, set(36, 0x80)), ErrMalformed, "flags"},
		{"chunk cut in its fingerprint", with(chunk, 2, func(b []byte) []byte { return b[:30] }), ErrMalformed, "prompt"},
		{"reversed range", with(chunk, 2, set(12, 9)), ErrMalformed, "end"},
		{"payload longer than announced", with(chunk, 3, func(b []byte) []byte { return append(b, 'k') }), ErrMalformed, "layer[0].k"},
		{"huge page count", mustEncodeWith(t, &TransferInfo{}, func(h []byte) { h[len(h)-1] = 0xff }), ErrMalformed, "pages"},
		{"huge string", mustEncodeWith(t, &Abort{}, func(h []byte) { h[15] = 0xff }), ErrMalformed, "endpoint"},
		{"huge layer count", with(chunk, 2, set(40, 0xff)), ErrMalformed, "layers"},
		{"transfer info cut in its fingerprint", with(mustEncode(t, &TransferInfo{}), 2, func(b []byte) []byte { return b[:20] }), ErrMalformed, "prompt"},
	}
	for _, tt := range tests {
		m, err := decodeNoPanic(t, tt.frames)
		if err == nil {
			t.Errorf("%s: decoded to %+v", tt.name, m)
			continue
		}
		var de *DecodeError
		if !errors.As(err, &de) || !errors.Is(err, tt.kind) || !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want a *DecodeError of kind %v", tt.name, err, tt.kind)
			continue
		}
		if de.Field != tt.field {
			t.Errorf("%s: field %q, want %q (%v)", tt.name, de.Field, tt.field, err)
		}
	}
}

func mustEncodeWith(t *testing.T, m Message, edit func(header []byte)) [][]byte {
	g := cloneFrames(mustEncode(t, m))
	edit(g[2])
	return g
}

func TestDecodeErrorText(t *testing.T) {
	frames := mustEncode(t, &KVChunk{Layers: []LayerKV{{}, {V: []byte("v")}}})
	frames[3+4+1] = nil
	_, err := Decode(frames)
	want := "pdproto: malformed message: KV_CHUNK frame 8 (layer[1].v): 0 bytes, header says 1"
	if err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}
}

func TestEncodeErrors(t *testing.T) {
	for _, m := range []Message{
		nil,
		(*TransferInfo)(nil), (*KVChunk)(nil), (*Status)(nil), (*Abort)(nil), (*AbortAck)(nil), (*Heartbeat)(nil),
		&Status{State: 5},
		&KVChunk{Start: 2, End: 1},
	} {
		if frames, err := Encode(m); err == nil {
			t.Errorf("Encode(%#v) = %q, want an error", m, frames)
		}
	}
}

func TestRoomOf(t *testing.T) {
	for _, m := range samples() {
		room, ok := RoomOf(m)
		if _, hb := m.(*Heartbeat); ok == hb {
			t.Errorf("RoomOf(%T) ok = %v", m, ok)
		}
		if v := reflect.ValueOf(m).Elem().FieldByName("Room"); ok && v.Uint() != room {
			t.Errorf("RoomOf(%T) = %d, want %d", m, room, v.Uint())
		}
	}
}

// TestAbortAckLayout pins ABORT_ACK's header to docs/protocol.md: room u64
// at 0, rank u32 at 8, in_flight bool at 12, known bool at 13, 14 bytes.
func TestAbortAckLayout(t *testing.T) {
	frames := mustEncode(t, &AbortAck{Room: 0x0102030405060708, Rank: 9, InFlight: false, Known: true})
	want := []byte{8, 7, 6, 5, 4, 3, 2, 1, 9, 0, 0, 0, 0, 1}
	if string(frames[frameHeader]) != string(want) {
		t.Fatalf("ABORT_ACK header % x, want % x", frames[frameHeader], want)
	}
	m, err := Decode(frames)
	if ack, ok := m.(*AbortAck); err != nil || !ok || !ack.Known || ack.InFlight || ack.Room != 0x0102030405060708 || ack.Rank != 9 {
		t.Fatalf("decoded %+v, %v", m, err)
	}
}

func TestGuard(t *testing.T) {
	if g := Guard(); string(g) != "PDKIT\x05" {
		t.Fatalf("Guard() = %q", g)
	}
}

// TestFingerprintLayout pins where the prompt fingerprint sits, as
// docs/protocol.md says: TRANSFER_INFO bytes 16–31, after tokens; KV_CHUNK
// bytes 20–35, after end.
func TestFingerprintLayout(t *testing.T) {
	f := PromptFingerprint([]int32{5, 6, 7})
	info := mustEncode(t, &TransferInfo{Room: 1, Tokens: 3, Prompt: f})
	if got := info[frameHeader][16:32]; !bytes.Equal(got, f[:]) {
		t.Errorf("TRANSFER_INFO bytes 16-31 % x, want the fingerprint % x", got, f[:])
	}
	chunk := mustEncode(t, &KVChunk{Room: 1, Start: 0, End: 3, Prompt: f})
	if got := chunk[frameHeader][20:36]; !bytes.Equal(got, f[:]) {
		t.Errorf("KV_CHUNK bytes 20-35 % x, want the fingerprint % x", got, f[:])
	}
	if len(chunk[frameHeader]) != 41 {
		t.Errorf("KV_CHUNK header of no layers: %d bytes, want 41", len(chunk[frameHeader]))
	}
}

// A prompt's fingerprint changes with any token, its order and its length.
func TestPromptFingerprint(t *testing.T) {
	base := []int32{1, 2, 3, 4}
	long := make([]int32, 1000) // across the hashing buffer
	seen := map[Fingerprint][]int32{}
	for _, p := range [][]int32{base, {1, 2, 3, 5}, {2, 1, 3, 4}, {1, 2, 3}, {1, 2, 3, 4, 0}, {}, long, append(slices.Clone(long), 0)} {
		f := PromptFingerprint(p)
		if q, dup := seen[f]; dup {
			t.Errorf("prompts %v and %v share fingerprint %v", p, q, f)
		}
		seen[f] = p
	}
	if PromptFingerprint(base) != PromptFingerprint(slices.Clone(base)) {
		t.Error("one prompt, two fingerprints")
	}
}
