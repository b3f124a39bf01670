package tokenizer

import (
	"math"
	"strings"
	"sync"
	"testing"
)

func TestNewErrors(t *testing.T) {
	good := func() Vocab { return helloVocab(true) }
	cases := []struct {
		name   string
		mutate func(*Vocab)
		want   string
	}{
		{"unknown model", func(v *Vocab) { v.Model = "bert" }, `tokenizer: unsupported tokenizer model "bert"`},
		{"empty model", func(v *Vocab) { v.Model = "" }, `unsupported tokenizer model ""`},
		{"no tokens", func(v *Vocab) { v.Tokens, v.Scores, v.Types = nil, nil, nil }, "no tokens"},
		{"short scores", func(v *Vocab) { v.Scores = v.Scores[:3] }, "3 scores for"},
		{"long types", func(v *Vocab) { v.Types = append(v.Types, 1) }, "token types for"},
		{"bad type", func(v *Vocab) { v.Types[5] = 9 }, "invalid type 9"},
		{"negative type", func(v *Vocab) { v.Types[5] = -1 }, "invalid type -1"},
		{"NaN score", func(v *Vocab) { v.Scores[4] = float32(math.NaN()) }, "NaN score"},
		{"BOS range", func(v *Vocab) { v.BOS = int32(len(v.Tokens)) }, "BOS id"},
		{"EOS range", func(v *Vocab) { v.EOS = -2 }, "EOS id -2 out of range"},
		{"UNK range", func(v *Vocab) { v.UNK = 1 << 20 }, "UNK id"},
		{"PAD range", func(v *Vocab) { v.PAD = -5 }, "PAD id"},
		{"AddBOS without BOS", func(v *Vocab) { v.BOS = -1 }, "no BOS"},
		{"gpt2 pre", func(v *Vocab) { v.Model, v.Pre = "gpt2", "made-up" }, `unsupported gpt2 pre-tokenizer "made-up"`},
		{"gpt2 merge without space", func(v *Vocab) { v.Model, v.Merges = "gpt2", []string{"h e", "he"} }, `merge 1 ("he")`},
		{"gpt2 merge with empty right", func(v *Vocab) { v.Model, v.Merges = "gpt2", []string{"h "} }, "merge 0"},
		{"gpt2 empty merge", func(v *Vocab) { v.Model, v.Merges = "gpt2", []string{""} }, "merge 0"},
	}
	for _, c := range cases {
		v := good()
		c.mutate(&v)
		tk, err := New(v)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: New = %v, %v; want error containing %q", c.name, tk, err, c.want)
		}
		if err != nil && !strings.HasPrefix(err.Error(), "tokenizer: ") {
			t.Errorf("%s: error %q lacks the package prefix", c.name, err)
		}
	}
	// Merges that start with a space-like first part are fine ("Ġ Ġ").
	v := good()
	v.Model, v.Merges = "gpt2", []string{"Ġ Ġ", "  a"}
	if _, err := New(v); err != nil {
		t.Errorf("valid merges rejected: %v", err)
	}
}

func TestNoPanicOnAnyID(t *testing.T) {
	for name, tk := range map[string]Tokenizer{
		"spm":  builtinTokenizer(t, 512),
		"gpt2": mustNew(t, trainBPE(t, trainingCorpus, "default", 50)),
	} {
		n := int32(tk.VocabSize())
		for _, id := range []int32{-1 << 31, -2, -1, 0, 1, 2, n - 1, n, n + 1, 1<<31 - 1} {
			_ = tk.Piece(id)
			_ = tk.IsEOG(id)
			_ = tk.(interface{ TokenText(int32) string }).TokenText(id)
			NewStreamDecoder(tk).Add(id)
			_, err := tk.Decode([]int32{0, id})
			if inRange := id >= 0 && id < n; inRange != (err == nil) {
				t.Errorf("%s: Decode([0 %d]) error = %v", name, id, err)
			}
			if id < 0 || id >= n {
				if tk.Piece(id) != "" {
					t.Errorf("%s: Piece(%d) = %q", name, id, tk.Piece(id))
				}
			}
		}
		// Every id in range decodes.
		all := make([]int32, n)
		for i := range all {
			all[i] = int32(i)
		}
		if _, err := tk.Decode(all); err != nil {
			t.Errorf("%s: Decode(all ids): %v", name, err)
		}
		streamAll(t, NewStreamDecoder(tk), all)
	}
}

func TestTokenLookup(t *testing.T) {
	tk := builtinTokenizer(t, 512)
	for _, s := range []string{"<unk>", "<s>", "</s>", "<0x0A>", "▁the", "e"} {
		id, ok := tk.TokenID(s)
		if !ok || tk.TokenText(id) != s {
			t.Errorf("TokenID(%q) = %d, %v", s, id, ok)
		}
	}
	if _, ok := tk.TokenID("no such token"); ok {
		t.Error("TokenID found a missing token")
	}
	if tk.BOS() != 1 || tk.EOS() != 2 || tk.VocabSize() != 512 {
		t.Error("accessors wrong")
	}
}

// longPrompt is ~100 KB of varied text.
func longPrompt() string {
	var sb strings.Builder
	for sb.Len() < 100_000 {
		for _, s := range roundTripStrings {
			sb.WriteString(s)
			sb.WriteByte(' ')
		}
	}
	return sb.String()
}

// TestLongPromptRoundTrip checks long inputs, including one long run with no
// spaces (the worst case for the merge loops); BenchmarkEncodeLong measures
// their speed.
func TestLongPromptRoundTrip(t *testing.T) {
	for name, tk := range longPromptTokenizers(t) {
		for _, text := range []string{longPrompt(), longNoSpaces()} {
			ids := mustEncode(t, tk, text, true)
			if s := mustDecode(t, tk, ids); s != text {
				t.Errorf("%s: long round trip failed", name)
			}
		}
	}
}

func longNoSpaces() string { return strings.Repeat("abcdefghij", 10_000) }

func longPromptTokenizers(t testing.TB) map[string]Tokenizer {
	return map[string]Tokenizer{
		"spm32000": builtinTokenizer(t, 32000),
		"gpt2":     mustNew(t, trainBPE(t, trainingCorpus, "default", 300)),
	}
}

func BenchmarkEncodeLong(b *testing.B) {
	for name, tk := range longPromptTokenizers(b) {
		for tname, text := range map[string]string{"prose": longPrompt(), "nospaces": longNoSpaces()} {
			b.Run(name+"/"+tname, func(b *testing.B) {
				b.SetBytes(int64(len(text)))
				for b.Loop() {
					if _, err := tk.Encode(text, true); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

func TestConcurrentUse(t *testing.T) {
	toks := []Tokenizer{builtinTokenizer(t, 512), mustNew(t, trainBPE(t, trainingCorpus, "llama-bpe", 100))}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				tk := toks[(g+i)%2]
				s := roundTripStrings[(g*7+i)%len(roundTripStrings)]
				ids, err := tk.Encode(s, false)
				if err != nil {
					t.Error(err)
					return
				}
				if d, _ := tk.Decode(ids); d != s {
					t.Errorf("concurrent round trip of %q = %q", s, d)
				}
			}
		}()
	}
	wg.Wait()
}

func BenchmarkEncode100KB(b *testing.B) {
	prompt := longPrompt()
	for _, c := range []struct {
		name string
		tk   Tokenizer
	}{
		{"spm32000", builtinTokenizer(b, 32000)},
		{"gpt2", mustNew(b, trainBPE(b, trainingCorpus, "default", 300))},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(prompt)))
			for b.Loop() {
				if _, err := c.tk.Encode(prompt, true); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkBuiltinVocab32000(b *testing.B) {
	for b.Loop() {
		if _, err := BuiltinVocab(32000); err != nil {
			b.Fatal(err)
		}
	}
}
