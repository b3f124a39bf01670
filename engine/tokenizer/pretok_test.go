package tokenizer

import (
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"testing"
)

func splitAll(split splitFunc, s string) []string {
	var out []string
	for i := 0; i < len(s); {
		j := split(s, i)
		if j <= i || j > len(s) {
			panic("split made no progress")
		}
		out = append(out, s[i:j])
		i = j
	}
	return out
}

func TestPreTokenizerSplits(t *testing.T) {
	cases := []struct {
		in                  string
		gpt2, llama3, qwen2 []string
	}{
		{"Hello world", []string{"Hello", " world"}, nil, nil},
		{"I'm here, it's", []string{"I", "'m", " here", ",", " it", "'s"}, nil, nil},
		{"don't we'll they've you're he'd", []string{"don", "'t", " we", "'ll", " they", "'ve", " you", "'re", " he", "'d"}, nil, nil},
		{"DON'T", []string{"DON", "'", "T"}, []string{"DON", "'T"}, nil},
		{" 's 'sup", []string{" '", "s", " '", "sup"}, []string{" '", "s", " '", "sup"}, nil},
		{"abc123 4567", []string{"abc", "123", " 4567"},
			[]string{"abc", "123", " ", "456", "7"},
			[]string{"abc", "1", "2", "3", " ", "4", "5", "6", "7"}},
		{"3.14", []string{"3", ".", "14"}, nil, []string{"3", ".", "1", "4"}},
		{"hello  world", []string{"hello", " ", " world"}, nil, nil},
		{"hello   ", []string{"hello", "   "}, nil, nil},
		{"  foo", []string{" ", " foo"}, nil, nil},
		{"a\nb", []string{"a", "\n", "b"}, nil, nil},
		{"a \n\n b", []string{"a", " \n\n", " b"}, nil, nil},
		{"\tfoo", []string{"\t", "foo"}, []string{"\tfoo"}, nil},
		{"(hello) x", []string{"(", "hello", ")", " x"}, []string{"(hello", ")", " x"}, nil},
		{"hi!!\n\nthere", []string{"hi", "!!", "\n", "\n", "there"}, []string{"hi", "!!\n\n", "there"}, nil},
		{"x \n  y", []string{"x", " \n ", " y"}, []string{"x", " \n", " ", " y"}, nil},
		{"a\r\n\r\nb", []string{"a", "\r\n\r", "\n", "b"}, []string{"a", "\r\n\r\n", "b"}, nil},
		{"héllo wörld", []string{"héllo", " wörld"}, nil, nil},
		{"😀😀 ok", []string{"😀😀", " ok"}, nil, nil},
		{"a...b", []string{"a", "...", "b"}, []string{"a", "...", "b"}, nil},
		{" ...\n", []string{" ...", "\n"}, []string{" ...\n"}, nil},
		{"x\u00a0y", []string{"x", "\u00a0", "y"}, []string{"x", "\u00a0y"}, nil},
		{"\xffab", []string{"\xff", "ab"}, []string{"\xffab"}, nil},
		{"", nil, nil, nil},
	}
	for _, c := range cases {
		if c.llama3 == nil {
			c.llama3 = c.gpt2
		}
		if c.qwen2 == nil {
			c.qwen2 = c.llama3
		}
		for _, x := range []struct {
			name  string
			split splitFunc
			want  []string
		}{{"gpt2", splitGPT2, c.gpt2}, {"llama3", splitLlama3, c.llama3}, {"qwen2", splitQwen2, c.qwen2}} {
			if got := splitAll(x.split, c.in); !slices.Equal(got, x.want) {
				t.Errorf("%s(%q) = %q, want %q", x.name, c.in, got, x.want)
			}
		}
	}
}

// The reference splitters below run the expressions with Go's regexp, which
// chooses among alternatives as a backtracking engine would, for every
// alternative except the lookahead ones; those trailing \s+(?!\S)|\s+ are
// applied by hand. Go's \s is ASCII-only, so White_Space is spelled out.
const ws = `\t\n\v\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}`

var (
	refGPT2 = regexp.MustCompile(`^(?:'s|'t|'re|'ve|'m|'ll|'d| ?\pL+| ?\pN+| ?[^` + ws + `\pL\pN]+)`)
	refTik  = func(digits string) *regexp.Regexp {
		return regexp.MustCompile(`^(?:'(?i:s|t|re|ve|m|ll|d)|[^\r\n\pL\pN]?\pL+|\pN` + digits +
			`| ?[^` + ws + `\pL\pN]+[\r\n]*|[` + ws + `]*[\r\n]+)`)
	}
	refLlama3 = refTik("{1,3}")
	refQwen2  = refTik("")
	wsRun     = regexp.MustCompile(`^[` + ws + `]+`)
)

func refSplit(re *regexp.Regexp) splitFunc {
	return func(s string, i int) int {
		if loc := re.FindStringIndex(s[i:]); loc != nil && loc[1] > 0 {
			return i + loc[1]
		}
		run := wsRun.FindString(s[i:])
		if run == "" {
			panic("reference: no alternative matched at " + s[i:])
		}
		if i+len(run) == len(s) {
			return len(s) // \s+(?!\S) at the end
		}
		// \s+(?!\S): give back the last character, unless that empties it.
		runes := []rune(run)
		if len(runes) == 1 {
			return i + len(run) // \s+
		}
		return i + len(run) - len(string(runes[len(runes)-1]))
	}
}

var pretokAlphabet = []string{
	"a", "Z", "é", "中", "ß", "1", "9", "²", "٣", "Ⅻ", " ", " ", " ", "\t", "\n", "\r",
	"'", "s", "t", "re", "VE", "ll", "D", "m", ".", ",", "!", "-", "(", "\u00a0", "\u3000",
	"😀", "\xff", "\xe2\x82", "\u0301", "_", "\"",
}

func randomText(r *rand.Rand, n int) string {
	var sb strings.Builder
	for range n {
		sb.WriteString(pretokAlphabet[r.IntN(len(pretokAlphabet))])
	}
	return sb.String()
}

func TestPreTokenizersMatchReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, x := range []struct {
		name      string
		split     splitFunc
		reference splitFunc
	}{
		{"gpt2", splitGPT2, refSplit(refGPT2)},
		{"llama3", splitLlama3, refSplit(refLlama3)},
		{"qwen2", splitQwen2, refSplit(refQwen2)},
	} {
		for range 3000 {
			s := randomText(r, 1+r.IntN(24))
			got, want := splitAll(x.split, s), splitAll(x.reference, s)
			if !slices.Equal(got, want) {
				t.Fatalf("%s(%q) = %q, reference %q", x.name, s, got, want)
			}
		}
	}
}

func FuzzPreTokenizers(f *testing.F) {
	for _, s := range roundTripStrings {
		f.Add(s)
	}
	f.Add("don't 'S 123456 \n\n  x\r\n")
	f.Fuzz(func(t *testing.T, s string) {
		for _, x := range []struct {
			split, reference splitFunc
		}{
			{splitGPT2, refSplit(refGPT2)},
			{splitLlama3, refSplit(refLlama3)},
			{splitQwen2, refSplit(refQwen2)},
		} {
			got, want := splitAll(x.split, s), splitAll(x.reference, s)
			if !slices.Equal(got, want) {
				t.Fatalf("split(%q) = %q, reference %q", s, got, want)
			}
		}
	})
}
