package tokenizer

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// streamAll feeds ids one at a time, checking that every chunk is valid
// UTF-8, and returns the joined chunks plus Flush.
func streamAll(t *testing.T, d *StreamDecoder, ids []int32) string {
	t.Helper()
	var sb strings.Builder
	for _, id := range ids {
		chunk := d.Add(id)
		if !utf8.ValidString(chunk) {
			t.Fatalf("Add(%d) returned invalid UTF-8 %q", id, chunk)
		}
		sb.WriteString(chunk)
	}
	rest := d.Flush()
	if !utf8.ValidString(rest) {
		t.Fatalf("Flush returned invalid UTF-8 %q", rest)
	}
	return sb.String() + rest
}

func TestStreamMatchesDecode(t *testing.T) {
	toks := map[string]Tokenizer{
		"builtin512":   builtinTokenizer(t, 512),
		"builtin32000": builtinTokenizer(t, 32000),
		"gpt2":         mustNew(t, trainBPE(t, trainingCorpus, "default", 200)),
		"llama-bpe":    mustNew(t, trainBPE(t, trainingCorpus, "llama-bpe", 200)),
	}
	for name, tk := range toks {
		for _, s := range roundTripStrings {
			ids := mustEncode(t, tk, s, true)
			want := mustDecode(t, tk, ids)
			if got := streamAll(t, NewStreamDecoderAtStart(tk), ids); got != want {
				t.Errorf("%s: stream(%q) = %q, Decode = %q", name, s, got, want)
			}
			// The default decoder renders pieces as they are.
			var pieces strings.Builder
			for _, id := range ids {
				pieces.WriteString(tk.Piece(id))
			}
			if got := streamAll(t, NewStreamDecoder(tk), ids); got != pieces.String() {
				t.Errorf("%s: stream(%q) = %q, pieces = %q", name, s, got, pieces.String())
			}
		}
	}
}

func TestStreamHoldsIncompleteCharacters(t *testing.T) {
	tk := builtinTokenizer(t, 512)
	b := func(c byte) int32 { id, _ := tk.TokenID(byteTokenText(c)); return id }
	d := NewStreamDecoder(tk)
	// "€" is E2 82 AC: nothing comes out until the last byte arrives.
	if got := d.Add(b(0xE2)); got != "" {
		t.Errorf("after E2: %q", got)
	}
	if got := d.Add(b(0x82)); got != "" {
		t.Errorf("after 82: %q", got)
	}
	if got := d.Add(b(0xAC)); got != "€" {
		t.Errorf("after AC: %q", got)
	}
	// A sequence broken by another character becomes one U+FFFD.
	a, _ := tk.TokenID("a")
	d.Add(b(0xF0))
	d.Add(b(0x9F))
	if got := d.Add(a); got != "\uFFFDa" {
		t.Errorf("broken sequence: %q", got)
	}
	// Stray continuation bytes and invalid bytes are replaced one by one.
	if got := d.Add(b(0x80)); got != "\uFFFD" {
		t.Errorf("stray continuation byte: %q", got)
	}
	if got := d.Add(b(0xFF)); got != "\uFFFD" {
		t.Errorf("invalid byte: %q", got)
	}
	// Flush renders an unfinished tail.
	if got := d.Add(b(0xE2)); got != "" {
		t.Errorf("after E2: %q", got)
	}
	if got := d.Flush(); got != "\uFFFD" {
		t.Errorf("Flush = %q", got)
	}
	if got := d.Flush(); got != "" {
		t.Errorf("second Flush = %q", got)
	}
}

func TestStreamLeadingSpace(t *testing.T) {
	tk := builtinTokenizer(t, 32000)
	ids := mustEncode(t, tk, "Paris is nice", true)
	if got := streamAll(t, NewStreamDecoderAtStart(tk), ids); got != "Paris is nice" {
		t.Errorf("NewStreamDecoderAtStart = %q", got)
	}
	// Generated tokens continue a prompt: their leading space is real, and
	// prompt + generation reads like Decode of both.
	prompt := mustEncode(t, tk, "The capital of France is", true)
	gen := mustEncode(t, tk, "Paris is nice", false)
	got := streamAll(t, NewStreamDecoder(tk), gen)
	if got != " Paris is nice" {
		t.Errorf("NewStreamDecoder = %q", got)
	}
	if whole := mustDecode(t, tk, append(prompt, gen...)); whole != mustDecode(t, tk, prompt)+got {
		t.Errorf("Decode(prompt+gen) = %q, want prompt + %q", whole, got)
	}
	// Without a space prefix both decoders agree.
	gpt := mustNew(t, trainBPE(t, trainingCorpus, "default", 100))
	ids = mustEncode(t, gpt, " Paris is nice", false)
	a, b := streamAll(t, NewStreamDecoder(gpt), ids), streamAll(t, NewStreamDecoderAtStart(gpt), ids)
	if a != " Paris is nice" || b != a {
		t.Errorf("gpt2 decoders: %q, %q", a, b)
	}
}

// foreign is a Tokenizer from "another package": only the interface.
type foreign struct{ Tokenizer }

func TestStreamForeignTokenizer(t *testing.T) {
	tk := builtinTokenizer(t, 512)
	ids := mustEncode(t, tk, "héllo 😀", false)
	got := streamAll(t, NewStreamDecoderAtStart(foreign{tk}), ids)
	if got != " héllo 😀" { // only Piece is known: the prefix space stays
		t.Errorf("foreign stream = %q", got)
	}
	d := NewStreamDecoder(foreign{tk})
	if d.Add(-1) != "" || d.Add(1<<30) != "" {
		t.Error("out-of-range ids rendered text")
	}
}
