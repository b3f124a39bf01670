package tokenizer

import (
	"slices"
	"sync"
	"testing"
)

// roundTripStrings cover ASCII, punctuation, numbers, byte-fallback
// characters and every kind of whitespace layout.
var roundTripStrings = []string{
	"",
	"a",
	"hello",
	"Hello, world!",
	"The quick brown fox jumps over the lazy dog.",
	"It's a dog's life; isn't it? They'll say: \"we'd've known\".",
	"3.14159 + 2,718 = 5.85959 (approx.) #42 @home $100 50% a_b c-d e/f",
	" leading space",
	"  two leading spaces",
	"trailing space ",
	"trailing spaces   ",
	"multiple   inner    spaces",
	" ",
	"   ",
	"\n",
	"line one\nline two\n\nline four\r\nwindows line",
	"\ttab\tseparated\tvalues\t",
	"mixed \t \n whitespace \n\t ",
	"emoji 😀🎉👍🏽 and flags 🇫🇷",
	"CJK: 世界你好, こんにちは, 안녕하세요",
	"accents: café naïve résumé Ærøskøbing",
	"Ελληνικά и кириллица",
	"zero\x00byte and control \x01\x1f chars",
	"func main() {\n\tfmt.Println(\"hi\")\n}\n",
	"<s> </s> <unk> <0x41> look like special tokens but are text",
	"MiXeD CaSe AND ALL CAPS",
	"a\u00a0b\u3000c\u2028d",
}

var builtinCache struct {
	sync.Mutex
	m map[int]*SPMTokenizer
}

// builtinTokenizer returns the tokenizer for BuiltinVocab(size), built once.
func builtinTokenizer(t testing.TB, size int) *SPMTokenizer {
	t.Helper()
	builtinCache.Lock()
	defer builtinCache.Unlock()
	if tk, ok := builtinCache.m[size]; ok {
		return tk
	}
	v, err := BuiltinVocab(size)
	if err != nil {
		t.Fatal(err)
	}
	tk, err := New(v)
	if err != nil {
		t.Fatal(err)
	}
	if builtinCache.m == nil {
		builtinCache.m = make(map[int]*SPMTokenizer)
	}
	builtinCache.m[size] = tk.(*SPMTokenizer)
	return tk.(*SPMTokenizer)
}

func mustNew(t testing.TB, v Vocab) Tokenizer {
	t.Helper()
	tk, err := New(v)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return tk
}

func mustEncode(t testing.TB, tk Tokenizer, s string, addSpecial bool) []int32 {
	t.Helper()
	ids, err := tk.Encode(s, addSpecial)
	if err != nil {
		t.Fatalf("Encode(%q): %v", s, err)
	}
	return ids
}

func mustDecode(t testing.TB, tk Tokenizer, ids []int32) string {
	t.Helper()
	s, err := tk.Decode(ids)
	if err != nil {
		t.Fatalf("Decode(%v): %v", ids, err)
	}
	return s
}

// pieces spells ids with their vocabulary strings, for readable failures.
func pieces(tk interface{ TokenText(int32) string }, ids []int32) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = tk.TokenText(id)
	}
	return out
}

func equalIDs(a, b []int32) bool { return slices.Equal(a, b) }
