package tokenizer

import (
	"unicode/utf8"
)

// pieceDecoder is implemented by this package's tokenizers so that a
// StreamDecoder renders pieces exactly like their Decode does.
type pieceDecoder interface {
	decodePiece(id int32, atStart *bool) string
	stripsLeadingSpace() bool
}

// StreamDecoder turns a stream of token ids into valid UTF-8 text chunks,
// holding back incomplete multi-byte sequences (byte-fallback tokens or
// byte-level BPE split characters) until complete. Bytes that can never
// complete a character are replaced by U+FFFD, one per maximal invalid
// sequence, so every chunk is valid UTF-8.
//
// A StreamDecoder is not safe for concurrent use; use one per sequence.
type StreamDecoder struct {
	tok     Tokenizer
	pd      pieceDecoder // nil for tokenizers from other packages
	atStart bool         // no text emitted yet and the space prefix must go
	pending []byte       // an incomplete UTF-8 sequence, at most 3 bytes
}

// NewStreamDecoder returns a decoder for generated tokens, which continue a
// prompt: every piece is rendered as Piece renders it, so a first generated
// "▁Paris" reads " Paris", as llama.cpp's server streams it. For tokens
// that start a text, use NewStreamDecoderAtStart.
func NewStreamDecoder(t Tokenizer) *StreamDecoder {
	d := &StreamDecoder{tok: t}
	if pd, ok := t.(pieceDecoder); ok {
		d.pd = pd
	}
	return d
}

// NewStreamDecoderAtStart returns a decoder for a sequence that starts a
// text (such as a whole encoded document): like Decode, it drops the space
// that a "llama" vocabulary's space prefix puts in front of the first piece,
// so the chunks add up to Decode's result whenever that is valid UTF-8.
func NewStreamDecoderAtStart(t Tokenizer) *StreamDecoder {
	d := NewStreamDecoder(t)
	if d.pd != nil {
		d.atStart = d.pd.stripsLeadingSpace()
	}
	return d
}

// Add feeds the next token and returns the text that is now complete,
// possibly "". Out-of-range ids render as nothing.
func (d *StreamDecoder) Add(id int32) string {
	var p string
	if d.pd != nil {
		if id < 0 || int(id) >= d.tok.VocabSize() {
			return ""
		}
		p = d.pd.decodePiece(id, &d.atStart)
	} else {
		p = d.tok.Piece(id)
	}
	if len(d.pending) == 0 && utf8.ValidString(p) {
		return p // the common case: whole characters only
	}
	d.pending = append(d.pending, p...)
	out, rest := completeUTF8(d.pending)
	d.pending = append(d.pending[:0], rest...)
	return out
}

// Flush returns whatever is held back, with an incomplete sequence rendered
// as U+FFFD, and empties the decoder's buffer. Call it when the stream ends.
func (d *StreamDecoder) Flush() string {
	if len(d.pending) == 0 {
		return ""
	}
	out, rest := completeUTF8(d.pending)
	if len(rest) > 0 {
		out += "\uFFFD"
	}
	d.pending = d.pending[:0]
	return out
}

// completeUTF8 splits b into the text that is final now and the tail that is
// a valid but unfinished UTF-8 sequence. Invalid sequences in the text part
// become U+FFFD.
func completeUTF8(b []byte) (string, []byte) {
	out := make([]byte, 0, len(b)+3)
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || n > 1 {
			out = append(out, b[i:i+n]...)
			i += n
			continue
		}
		if !utf8.FullRune(b[i:]) {
			return string(out), b[i:] // may still complete
		}
		// Replace the maximal prefix of a valid sequence, at least one byte.
		k := 1
		for k < 3 && i+k < len(b) && !utf8.FullRune(b[i:i+k+1]) {
			k++
		}
		out = append(out, "\uFFFD"...)
		i += k
	}
	return string(out), nil
}
