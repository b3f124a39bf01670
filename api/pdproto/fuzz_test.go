package pdproto

import (
	"encoding/binary"
	"errors"
	"testing"
)

// joinFrames packs frames into one fuzz input: each frame is a little-endian
// u16 length and its bytes.
func joinFrames(frames [][]byte) []byte {
	var b []byte
	for _, f := range frames {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(f)))
		b = append(b, f...)
	}
	return b
}

// splitFrames is joinFrames' inverse for any input: a length longer than
// what is left takes what is left, and a lone last byte is a frame of its
// own.
func splitFrames(b []byte) [][]byte {
	var frames [][]byte
	for len(b) > 0 {
		if len(b) < 2 {
			frames = append(frames, b)
			break
		}
		n := min(int(binary.LittleEndian.Uint16(b)), len(b)-2)
		frames = append(frames, b[2:2+n])
		b = b[2+n:]
	}
	return frames
}

func FuzzDecode(f *testing.F) {
	for _, m := range samples() {
		frames, err := Encode(m)
		if err != nil {
			f.Fatal(err)
		}
		if fits(frames) {
			f.Add(joinFrames(frames))
		}
	}
	f.Add(joinFrames(mustEncode(f, bigChunk(2, 4096))))
	f.Add([]byte{})
	f.Add(joinFrames([][]byte{[]byte("ABORT"), []byte("123"), []byte("10.0.0.1"), []byte("5555")}))
	f.Fuzz(func(t *testing.T, in []byte) {
		frames := splitFrames(in)
		m, err := Decode(frames)
		if err != nil {
			var de *DecodeError
			if m != nil || !errors.As(err, &de) || !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode error %v (%T) with message %v", err, err, m)
			}
			return
		}
		again, err := Encode(m)
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", m, err)
		}
		if !framesEqual(again, frames) {
			t.Fatalf("%s re-encodes to different frames:\n got %q\nwant %q", m.Type(), again, frames)
		}
	})
}

func fits(frames [][]byte) bool {
	for _, f := range frames {
		if len(f) > 0xffff {
			return false
		}
	}
	return true
}

func TestSplitFrames(t *testing.T) {
	for _, m := range samples() {
		frames := mustEncode(t, m)
		if fits(frames) && !framesEqual(splitFrames(joinFrames(frames)), frames) {
			t.Errorf("%T: split(join(frames)) differs", m)
		}
	}
}
