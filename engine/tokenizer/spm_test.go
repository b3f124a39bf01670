package tokenizer

import (
	"slices"
	"strings"
	"testing"
)

// spmVocab builds a small "llama" vocab: <unk>, <s>, </s>, then the given
// normal pieces with the given scores, then optionally all byte tokens.
func spmVocab(pieces []string, scores []float32, withBytes bool) Vocab {
	v := Vocab{
		Model:          "llama",
		Tokens:         []string{"<unk>", "<s>", "</s>"},
		Scores:         []float32{0, 0, 0},
		Types:          []int32{TypeUnknown, TypeControl, TypeControl},
		BOS:            1,
		EOS:            2,
		UNK:            0,
		PAD:            -1,
		AddBOS:         true,
		AddSpacePrefix: true,
	}
	for i, p := range pieces {
		v.Tokens = append(v.Tokens, p)
		v.Scores = append(v.Scores, scores[i])
		v.Types = append(v.Types, TypeNormal)
	}
	if withBytes {
		for c := 0; c < 256; c++ {
			v.Tokens = append(v.Tokens, byteTokenText(byte(c)))
			v.Scores = append(v.Scores, 0)
			v.Types = append(v.Types, TypeByte)
		}
	}
	return v
}

// helloVocab is a vocab whose merges are worked out by hand in TestSPMExact.
func helloVocab(withBytes bool) Vocab {
	p := []string{"▁", "h", "e", "l", "o", "w", "r", "d",
		"ll", "he", "▁he", "llo", "▁hello", "or", "▁w", "▁wor", "ld", "▁world"}
	s := []float32{-20, -20, -20, -20, -20, -20, -20, -20,
		-1, -2, -3, -4, -5, -6, -7, -8, -9, -10}
	return spmVocab(p, s, withBytes)
}

func ids(tk interface{ TokenID(string) (int32, bool) }, t *testing.T, texts ...string) []int32 {
	t.Helper()
	out := make([]int32, len(texts))
	for i, s := range texts {
		id, ok := tk.TokenID(s)
		if !ok {
			t.Fatalf("no token %q", s)
		}
		out[i] = id
	}
	return out
}

func TestSPMExact(t *testing.T) {
	tk := mustNew(t, helloVocab(false)).(*SPMTokenizer)
	cases := []struct {
		text   string
		prefix bool
		want   []string
	}{
		// "▁hello▁world": ll, he, ▁he, llo, ▁hello on the left; or, ▁w,
		// ▁wor, ld, ▁world on the right, by score.
		{"hello world", true, []string{"▁hello", "▁world"}},
		// Without the space prefix "he" cannot join "▁".
		{"hello", false, []string{"he", "llo"}},
		{"hello  world", true, []string{"▁hello", "▁", "▁world"}},
		{"world hello", true, []string{"▁world", "▁hello"}},
		{"low", true, []string{"▁", "l", "o", "w"}},
	}
	for _, c := range cases {
		v := helloVocab(false)
		v.AddSpacePrefix = c.prefix
		tk := mustNew(t, v).(*SPMTokenizer)
		got := mustEncode(t, tk, c.text, false)
		if want := ids(tk, t, c.want...); !equalIDs(got, want) {
			t.Errorf("Encode(%q) = %v, want %v", c.text, pieces(tk, got), c.want)
		}
	}
	got := mustEncode(t, tk, "hello world", true)
	if want := append([]int32{1}, ids(tk, t, "▁hello", "▁world")...); !equalIDs(got, want) {
		t.Errorf("Encode with BOS = %v, want %v", got, want)
	}
	if s := mustDecode(t, tk, got); s != "hello world" {
		t.Errorf("Decode = %q", s)
	}
	if got := mustEncode(t, tk, "", true); !equalIDs(got, []int32{1}) {
		t.Errorf("Encode(\"\", true) = %v, want [BOS]", got)
	}
	if got := mustEncode(t, tk, "", false); len(got) != 0 {
		t.Errorf("Encode(\"\", false) = %v, want []", got)
	}
}

func TestSPMScoreOrderAndTies(t *testing.T) {
	cases := []struct {
		pieces []string
		scores []float32
		text   string
		want   []string
	}{
		{[]string{"a", "b", "c", "ab", "bc"}, []float32{0, 0, 0, -2, -1}, "abc", []string{"a", "bc"}},
		{[]string{"a", "b", "c", "ab", "bc"}, []float32{0, 0, 0, -1, -2}, "abc", []string{"ab", "c"}},
		// Equal scores: the leftmost pair merges first.
		{[]string{"a", "aa"}, []float32{0, -1}, "aaa", []string{"aa", "a"}},
		{[]string{"a", "aa"}, []float32{0, -1}, "aaaaa", []string{"aa", "aa", "a"}},
		// Merging needs every intermediate to be a token: "abcd" exists but
		// "bc" wins and neither "abc" nor "bcd" does.
		{[]string{"a", "b", "c", "d", "ab", "cd", "bc", "abcd"}, []float32{0, 0, 0, 0, -2, -2, -1, -3}, "abcd", []string{"a", "bc", "d"}},
		{[]string{"a", "b", "c", "d", "ab", "cd", "abcd"}, []float32{0, 0, 0, 0, -2, -2, -3}, "abcd", []string{"abcd"}},
	}
	for _, c := range cases {
		v := spmVocab(c.pieces, c.scores, false)
		v.AddSpacePrefix = false
		tk := mustNew(t, v).(*SPMTokenizer)
		got := mustEncode(t, tk, c.text, false)
		if want := ids(tk, t, c.want...); !equalIDs(got, want) {
			t.Errorf("%v: Encode(%q) = %v, want %v", c.pieces, c.text, pieces(tk, got), c.want)
		}
	}
}

func TestSPMByteFallback(t *testing.T) {
	tk := mustNew(t, helloVocab(true)).(*SPMTokenizer)
	got := mustEncode(t, tk, "hé", false)
	want := ids(tk, t, "▁", "h", "<0xC3>", "<0xA9>")
	if !equalIDs(got, want) {
		t.Errorf("Encode(hé) = %v, want %v", pieces(tk, got), pieces(tk, want))
	}
	if s := mustDecode(t, tk, got); s != "hé" {
		t.Errorf("Decode = %q, want hé", s)
	}
	// Invalid UTF-8 survives as bytes.
	if s := mustDecode(t, tk, mustEncode(t, tk, "a\xffb\xc3", false)); s != "a\xffb\xc3" {
		t.Errorf("invalid UTF-8 round trip = %q", s)
	}

	// Without byte tokens, unknown characters become one UNK each.
	tk = mustNew(t, helloVocab(false)).(*SPMTokenizer)
	got = mustEncode(t, tk, "hé😀", false)
	want = []int32{ids(tk, t, "▁")[0], ids(tk, t, "h")[0], 0, 0}
	if !equalIDs(got, want) {
		t.Errorf("Encode without bytes = %v, want %v", pieces(tk, got), pieces(tk, want))
	}
	if s := mustDecode(t, tk, got); s != "h\uFFFD\uFFFD" {
		t.Errorf("Decode with UNK = %q", s)
	}

	// Neither byte tokens nor UNK: an error, not a silent drop.
	v := helloVocab(false)
	v.UNK = -1
	v.Types[0] = TypeControl
	tk = mustNew(t, v).(*SPMTokenizer)
	if _, err := tk.Encode("é", false); err == nil {
		t.Error("Encode(é) without byte tokens or UNK succeeded")
	}
}

func TestSPMDecodeRules(t *testing.T) {
	tk := mustNew(t, helloVocab(true)).(*SPMTokenizer)
	id := func(s string) int32 { return ids(tk, t, s)[0] }
	cases := []struct {
		ids  []int32
		want string
	}{
		{[]int32{1, id("▁hello"), id("▁world"), 2}, "hello world"},
		// Only the first text piece loses its space, once.
		{[]int32{id("▁"), id("▁hello")}, " hello"},
		{[]int32{1, 1, id("▁hello")}, "hello"},
		{[]int32{id("h"), id("▁world")}, "h world"},
		// A byte token first keeps everything: only a prefix space is dropped.
		{[]int32{id("<0x20>"), id("▁hello")}, "  hello"},
		{[]int32{id("<0xE2>"), id("<0x82>"), id("<0xAC>")}, "€"},
		{[]int32{0, id("▁hello")}, "\uFFFD hello"},
		{nil, ""},
	}
	for _, c := range cases {
		if got := mustDecode(t, tk, c.ids); got != c.want {
			t.Errorf("Decode(%v) = %q, want %q", pieces(tk, c.ids), got, c.want)
		}
	}
	// Piece keeps the prefix space: streaming callers decide.
	if p := tk.Piece(id("▁hello")); p != " hello" {
		t.Errorf("Piece(▁hello) = %q", p)
	}
	if p := tk.Piece(1); p != "" {
		t.Errorf("Piece(BOS) = %q", p)
	}
	if p := tk.Piece(id("<0x41>")); p != "A" {
		t.Errorf("Piece(<0x41>) = %q", p)
	}

	// Without AddSpacePrefix nothing is stripped.
	v := helloVocab(true)
	v.AddSpacePrefix = false
	tk2 := mustNew(t, v)
	if got := mustDecode(t, tk2, []int32{id("▁hello")}); got != " hello" {
		t.Errorf("Decode without space prefix = %q", got)
	}
}

func TestSPMNilTypesAndScores(t *testing.T) {
	v := helloVocab(true)
	v.Types = nil
	tk := mustNew(t, v).(*SPMTokenizer)
	got := mustEncode(t, tk, "hello é", true)
	if s := mustDecode(t, tk, got); s != "hello é" {
		t.Errorf("round trip with nil types = %q (%v)", s, pieces(tk, got))
	}
	if tk.Piece(1) != "" || tk.Piece(2) != "" || !tk.IsEOG(2) {
		t.Error("BOS/EOS not treated as control with nil types")
	}
	v.Scores = nil
	tk = mustNew(t, v).(*SPMTokenizer)
	if s := mustDecode(t, tk, mustEncode(t, tk, "hello é", true)); s != "hello é" {
		t.Errorf("round trip with nil scores = %q", s)
	}
}

func TestSpecialTokens(t *testing.T) {
	v := helloVocab(true)
	v.Tokens = append(v.Tokens, "<|im_end|>", "<tag>", "<reserved>")
	v.Scores = append(v.Scores, 0, 0, 0)
	v.Types = append(v.Types, TypeControl, TypeUserDefined, TypeUnused)
	tk := mustNew(t, v).(*SPMTokenizer)
	imEnd, tag := ids(tk, t, "<|im_end|>")[0], ids(tk, t, "<tag>")[0]

	// Encode leaves control tokens as text but matches user-defined ones.
	got := mustEncode(t, tk, "<s>hello<|im_end|>", false)
	if slices.Contains(got, 1) || slices.Contains(got, imEnd) {
		t.Errorf("Encode parsed control tokens: %v", pieces(tk, got))
	}
	if s := mustDecode(t, tk, got); s != "<s>hello<|im_end|>" {
		t.Errorf("Decode(Encode) = %q", s)
	}
	got = mustEncode(t, tk, "hello<tag>", false)
	if !slices.Contains(got, tag) {
		t.Errorf("Encode did not match user-defined token: %v", pieces(tk, got))
	}

	// EncodeWithSpecials matches control tokens; text after a special
	// token gets its own space prefix, as llama.cpp does.
	got, err := tk.EncodeWithSpecials("<s>hello<|im_end|>world</s>")
	if err != nil {
		t.Fatal(err)
	}
	want := []int32{1, ids(tk, t, "▁hello")[0], imEnd, ids(tk, t, "▁world")[0], 2}
	if !equalIDs(got, want) {
		t.Errorf("EncodeWithSpecials = %v, want %v", pieces(tk, got), pieces(tk, want))
	}
	if s := mustDecode(t, tk, got); s != "hello world" {
		t.Errorf("Decode(EncodeWithSpecials) = %q", s)
	}
	// Longest match wins.
	v.Tokens = append(v.Tokens, "<|im_end|>x")
	v.Scores = append(v.Scores, 0)
	v.Types = append(v.Types, TypeControl)
	tk = mustNew(t, v).(*SPMTokenizer)
	got, _ = tk.EncodeWithSpecials("<|im_end|>x<|im_end|>")
	if want := ids(tk, t, "<|im_end|>x", "<|im_end|>"); !equalIDs(got, want) {
		t.Errorf("longest match: %v", pieces(tk, got))
	}

	if !tk.IsEOG(2) || !tk.IsEOG(imEnd) || tk.IsEOG(1) || tk.IsEOG(tag) || tk.IsEOG(-1) || tk.IsEOG(1<<30) {
		t.Error("IsEOG wrong")
	}
	if tk.Piece(ids(tk, t, "<reserved>")[0]) != "" || tk.Piece(tag) != "<tag>" {
		t.Error("Piece of unused / user-defined tokens wrong")
	}
}

func TestRoundTripBuiltin(t *testing.T) {
	for _, size := range []int{MinBuiltinSize, 512, 32000} {
		tk := builtinTokenizer(t, size)
		for _, s := range roundTripStrings {
			for _, special := range []bool{false, true} {
				got := mustEncode(t, tk, s, special)
				if special != (len(got) > 0 && got[0] == tk.BOS()) {
					t.Errorf("size %d: BOS presence wrong for %q (addSpecial=%v)", size, s, special)
				}
				if d := mustDecode(t, tk, got); d != s {
					t.Errorf("size %d: Decode(Encode(%q)) = %q via %v", size, s, d, pieces(tk, got))
				}
			}
		}
	}
}

func TestBuiltinTokenizesSensibly(t *testing.T) {
	tk := builtinTokenizer(t, 32000)
	text := "The people of the world would like to know about the water"
	got := mustEncode(t, tk, text, false)
	if words := len(strings.Fields(text)); len(got) != words {
		t.Errorf("common words should be one token each: %v", pieces(tk, got))
	}
	// A literal "▁" cannot be told from a space (SentencePiece behaviour).
	if s := mustDecode(t, tk, mustEncode(t, tk, "a▁b", false)); s != "a b" {
		t.Errorf("Decode(Encode(a▁b)) = %q", s)
	}
}
