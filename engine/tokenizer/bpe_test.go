package tokenizer

import (
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

const trainingCorpus = `The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.
It's the thing they'll say: we're here, you've seen it, I'm sure, he'd know.
Numbers like 12345 and 3.14159 appear in text, as do dates such as 2024-01-31.
func main() { fmt.Println("hello, world") }  // code has    runs of spaces
Café, naïve, 世界, 😀 — unicode shows up too. The end of the the the text.`

// trainBPE learns byte-level merges from corpus the way GPT-2's vocabulary
// was made: count adjacent symbol pairs inside pre-tokens, merge the most
// frequent (ties by text, for determinism), repeat.
func trainBPE(t testing.TB, corpus, pre string, nMerges int) Vocab {
	t.Helper()
	split, _, ok := preTokenizer(pre)
	if !ok {
		t.Fatalf("unknown pre %q", pre)
	}
	v := Vocab{Model: "gpt2", Pre: pre, BOS: -1, EOS: -1, UNK: -1, PAD: -1}
	for c := range 256 {
		v.Tokens = append(v.Tokens, byteRuneText[c])
		v.Types = append(v.Types, TypeNormal)
	}
	freq := map[string]int{}
	for i := 0; i < len(corpus); {
		j := split(corpus, i)
		freq[corpus[i:j]]++
		i = j
	}
	type word struct {
		syms []string
		n    int
	}
	var words []word
	for _, w := range slices.Sorted(func(yield func(string) bool) {
		for k := range freq {
			if !yield(k) {
				return
			}
		}
	}) {
		var syms []string
		for i := 0; i < len(w); i++ {
			syms = append(syms, byteRuneText[w[i]])
		}
		words = append(words, word{syms, freq[w]})
	}
	have := map[string]bool{}
	for _, s := range v.Tokens {
		have[s] = true
	}
	for range nMerges {
		counts := map[[2]string]int{}
		for _, w := range words {
			for k := 0; k+1 < len(w.syms); k++ {
				counts[[2]string{w.syms[k], w.syms[k+1]}] += w.n
			}
		}
		var best [2]string
		bestN := 0
		for p, n := range counts {
			if n > bestN || (n == bestN && (p[0] < best[0] || (p[0] == best[0] && p[1] < best[1]))) {
				best, bestN = p, n
			}
		}
		if bestN == 0 {
			break // every pre-token is a single symbol
		}
		v.Merges = append(v.Merges, best[0]+" "+best[1])
		if m := best[0] + best[1]; !have[m] {
			have[m] = true
			v.Tokens = append(v.Tokens, m)
			v.Types = append(v.Types, TypeNormal)
		}
		for i := range words {
			s := words[i].syms
			out := s[:0:0]
			for k := 0; k < len(s); k++ {
				if k+1 < len(s) && s[k] == best[0] && s[k+1] == best[1] {
					out = append(out, best[0]+best[1])
					k++
				} else {
					out = append(out, s[k])
				}
			}
			words[i].syms = out
		}
	}
	add := func(s string, typ int32) int32 {
		v.Tokens = append(v.Tokens, s)
		v.Types = append(v.Types, typ)
		return int32(len(v.Tokens) - 1)
	}
	v.EOS = add("<|endoftext|>", TypeControl)
	v.BOS = v.EOS
	add("<|im_start|>", TypeControl)
	add("<|im_end|>", TypeControl)
	add("<tool call>", TypeUserDefined)
	return v
}

func TestByteLevelTables(t *testing.T) {
	if byteRunes[' '] != 'Ġ' || byteRunes['\n'] != 'Ċ' || byteRunes[0] != 'Ā' || byteRunes['a'] != 'a' || byteRunes[0xFF] != 'ÿ' {
		t.Errorf("byte mapping differs from GPT-2's: ' '→%q '\\n'→%q 0→%q", byteRunes[' '], byteRunes['\n'], byteRunes[0])
	}
	seen := map[rune]bool{}
	for c, r := range byteRunes {
		if seen[r] {
			t.Fatalf("rune %q used twice", r)
		}
		seen[r] = true
		if b, ok := byteOf(r); !ok || int(b) != c {
			t.Fatalf("byteOf(%q) = %d, %v; want %d", r, b, ok, c)
		}
	}
}

func TestBPEExact(t *testing.T) {
	v := Vocab{Model: "gpt2", BOS: -1, EOS: -1, UNK: -1, PAD: -1}
	for c := range 256 {
		v.Tokens = append(v.Tokens, byteRuneText[c])
	}
	v.Tokens = append(v.Tokens, "Ġt", "he", "Ġthe", "in", "Ġin", "aa")
	v.Merges = []string{"Ġ t", "h e", "Ġt he", "i n", "Ġ in", "a a"}
	tk := mustNew(t, v).(*BPETokenizer)
	cases := []struct {
		text string
		want []string
	}{
		// "the": h+e, then "t he" is no merge.
		{"the", []string{"t", "he"}},
		{" in", []string{"Ġin"}},
		// " thein" is one pre-token: Ġ+t, h+e, Ġt+he, i+n; "Ġthe in" is no merge.
		{"the in thein", []string{"t", "he", "Ġin", "Ġthe", "in"}},
		// Equal ranks merge leftmost first.
		{"aaa", []string{"aa", "a"}},
		{"aaaa", []string{"aa", "aa"}},
		{"a\n", []string{"a", "Ċ"}},
	}
	for _, c := range cases {
		got := mustEncode(t, tk, c.text, false)
		if want := ids(tk, t, c.want...); !equalIDs(got, want) {
			t.Errorf("Encode(%q) = %v, want %v", c.text, pieces(tk, got), c.want)
		}
		if s := mustDecode(t, tk, got); s != c.text {
			t.Errorf("Decode = %q, want %q", s, c.text)
		}
	}
}

func TestBPEIgnoreMerges(t *testing.T) {
	// Llama 3 uses a pre-token that is itself a token as is, even when the
	// merges could not build it.
	v := Vocab{Model: "gpt2", Pre: "llama-bpe", BOS: -1, EOS: -1, UNK: -1, PAD: -1}
	for c := range 256 {
		v.Tokens = append(v.Tokens, byteRuneText[c])
	}
	v.Tokens = append(v.Tokens, "Ġhello")
	tk := mustNew(t, v).(*BPETokenizer)
	if got, want := mustEncode(t, tk, " hello", false), ids(tk, t, "Ġhello"); !equalIDs(got, want) {
		t.Errorf("llama-bpe: %v", pieces(tk, got))
	}
	v.Pre = "gpt2"
	tk = mustNew(t, v).(*BPETokenizer)
	if got := mustEncode(t, tk, " hello", false); len(got) != 6 {
		t.Errorf("gpt2 without merges should give 6 byte tokens, got %v", pieces(tk, got))
	}
}

func TestBPERoundTrip(t *testing.T) {
	for _, pre := range []string{"default", "llama-bpe", "qwen2"} {
		v := trainBPE(t, trainingCorpus, pre, 300)
		tk := mustNew(t, v).(*BPETokenizer)
		if len(v.Merges) < 100 {
			t.Fatalf("trainer learned only %d merges", len(v.Merges))
		}
		total := 0
		for _, s := range append(roundTripStrings, trainingCorpus) {
			for range 2 { // the second pass goes through the cache
				got := mustEncode(t, tk, s, false)
				if d := mustDecode(t, tk, got); d != s {
					t.Errorf("%s: Decode(Encode(%q)) = %q via %q", pre, s, d, pieces(tk, got))
				}
				total += len(got)
			}
		}
		// The merges must actually compress the text they were learnt from.
		if n := len(mustEncode(t, tk, trainingCorpus, false)); n > len(trainingCorpus)/2 {
			t.Errorf("%s: %d tokens for %d bytes of training text", pre, n, len(trainingCorpus))
		}
	}
}

func TestBPESpecials(t *testing.T) {
	v := trainBPE(t, trainingCorpus, "default", 100)
	tk := mustNew(t, v).(*BPETokenizer)
	imStart, _ := tk.TokenID("<|im_start|>")
	imEnd, _ := tk.TokenID("<|im_end|>")
	tool, _ := tk.TokenID("<tool call>")

	text := "<|im_start|>user\nhi <tool call> x<|im_end|><|endoftext|>"
	plain := mustEncode(t, tk, text, true) // AddBOS is false: no BOS
	if slices.Contains(plain, imStart) || slices.Contains(plain, tk.EOS()) {
		t.Errorf("Encode parsed control tokens: %q", pieces(tk, plain))
	}
	if !slices.Contains(plain, tool) {
		t.Errorf("Encode did not match the user-defined token: %q", pieces(tk, plain))
	}
	if s := mustDecode(t, tk, plain); s != text {
		t.Errorf("Decode(Encode) = %q", s)
	}
	got, err := tk.EncodeWithSpecials(text)
	if err != nil {
		t.Fatal(err)
	}
	if got[0] != imStart || got[len(got)-2] != imEnd || got[len(got)-1] != tk.EOS() {
		t.Errorf("EncodeWithSpecials = %q", pieces(tk, got))
	}
	if s := mustDecode(t, tk, got); s != "user\nhi <tool call> x" {
		t.Errorf("Decode skips control tokens only: %q", s)
	}
	if !tk.IsEOG(imEnd) || !tk.IsEOG(tk.EOS()) || tk.IsEOG(imStart) {
		t.Error("IsEOG wrong")
	}
}

func TestBPEAddBOS(t *testing.T) {
	v := trainBPE(t, trainingCorpus, "llama-bpe", 50)
	v.AddBOS = true
	tk := mustNew(t, v)
	got := mustEncode(t, tk, "hi", true)
	if got[0] != tk.BOS() {
		t.Errorf("no BOS: %v", got)
	}
	if s := mustDecode(t, tk, got); s != "hi" {
		t.Errorf("Decode = %q", s)
	}
}

func TestBPEMissingBytes(t *testing.T) {
	// A vocab without a token for some bytes uses UNK, or fails clearly.
	v := Vocab{Model: "gpt2", Tokens: []string{"<unk>", "a", "b"}, Types: []int32{TypeUnknown, 1, 1}, BOS: -1, EOS: -1, UNK: 0, PAD: -1}
	tk := mustNew(t, v)
	if got := mustEncode(t, tk, "abc", false); !equalIDs(got, []int32{1, 2, 0}) {
		t.Errorf("Encode = %v", got)
	}
	v.UNK = -1
	tk = mustNew(t, v)
	if _, err := tk.Encode("abc", false); err == nil || !strings.Contains(err.Error(), "0x63") {
		t.Errorf("Encode without UNK: err = %v", err)
	}
}

func TestBPEDecodeVerbatimRunes(t *testing.T) {
	// Characters outside the byte-level alphabet are kept, not dropped.
	v := Vocab{Model: "gpt2", Tokens: []string{"Ġx", "€"}, BOS: -1, EOS: -1, UNK: -1, PAD: -1}
	tk := mustNew(t, v)
	if s := mustDecode(t, tk, []int32{0, 1}); s != " x€" || !utf8.ValidString(s) {
		t.Errorf("Decode = %q", s)
	}
}

func TestBPECacheBounded(t *testing.T) {
	v := trainBPE(t, trainingCorpus, "default", 50)
	tk := mustNew(t, v).(*BPETokenizer)
	words := make([]string, 0, maxCacheEntries+10)
	for i := range maxCacheEntries + 10 {
		words = append(words, "w"+strings.Repeat("x", i%7)+string(rune('a'+i%26))+strconv.Itoa(i))
	}
	text := strings.Join(words, " ")
	got := mustEncode(t, tk, text, false)
	if s := mustDecode(t, tk, got); s != text {
		t.Fatal("round trip failed")
	}
	tk.mu.RLock()
	n := len(tk.cache)
	tk.mu.RUnlock()
	if n > maxCacheEntries {
		t.Errorf("cache holds %d entries", n)
	}
}
