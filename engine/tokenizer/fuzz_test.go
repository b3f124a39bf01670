package tokenizer

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzRoundTrip checks Decode(Encode(s)) == s on the builtin vocabulary, and
// that streaming agrees with Decode. The committed corpus is only the seeds;
// run `go test -fuzz=FuzzRoundTrip` to explore.
func FuzzRoundTrip(f *testing.F) {
	for _, s := range roundTripStrings {
		f.Add(s)
	}
	f.Add("\xff\xfe invalid \xc3 UTF-8 \xe2\x82")
	f.Add(strings.Repeat("ab ", 100))
	tk := builtinTokenizer(f, 32000)
	f.Fuzz(func(t *testing.T, s string) {
		if strings.Contains(s, "▁") {
			t.Skip("a literal ▁ decodes as a space (SentencePiece normalization)")
		}
		for _, addSpecial := range []bool{false, true} {
			ids, err := tk.Encode(s, addSpecial)
			if err != nil {
				t.Fatalf("Encode(%q): %v", s, err)
			}
			got, err := tk.Decode(ids)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if got != s {
				t.Fatalf("Decode(Encode(%q)) = %q", s, got)
			}
			d := NewStreamDecoderAtStart(tk)
			var sb strings.Builder
			for _, id := range ids {
				chunk := d.Add(id)
				if !utf8.ValidString(chunk) {
					t.Fatalf("stream chunk %q is not valid UTF-8", chunk)
				}
				sb.WriteString(chunk)
			}
			sb.WriteString(d.Flush())
			if want := strings.ToValidUTF8(s, "\uFFFD"); utf8.ValidString(s) && sb.String() != want {
				t.Fatalf("stream(%q) = %q", s, sb.String())
			} else if !utf8.ValidString(sb.String()) {
				t.Fatalf("stream produced invalid UTF-8")
			}
		}
	})
}

// FuzzRoundTripBPE does the same for a byte-level BPE vocabulary.
func FuzzRoundTripBPE(f *testing.F) {
	for _, s := range roundTripStrings {
		f.Add(s)
	}
	f.Add("\xff\xfe invalid \xc3 UTF-8 \xe2\x82")
	tk := mustNew(f, trainBPE(f, trainingCorpus, "llama-bpe", 300))
	f.Fuzz(func(t *testing.T, s string) {
		ids, err := tk.Encode(s, false)
		if err != nil {
			t.Fatalf("Encode(%q): %v", s, err)
		}
		if got, _ := tk.Decode(ids); got != s {
			t.Fatalf("Decode(Encode(%q)) = %q", s, got)
		}
	})
}
