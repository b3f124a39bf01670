package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// Byte-level BPE vocabularies are trained on text that a regular expression
// first cut into "pre-tokens" (words, numbers, punctuation runs, spaces);
// merges never cross those cuts, so the same cuts must be made here. The
// expressions use a negative lookahead, which Go's regexp lacks, so each
// one is implemented as a hand-written scanner that returns where the
// pre-token starting at byte i ends. The scanners follow the alternation
// order of the expression (first alternative that matches wins) and its
// backtracking, and classify characters as Unicode does: \p{L} letters,
// \p{N} numbers, \s White_Space. An invalid UTF-8 byte counts as a
// character that is none of those.

// splitFunc returns the end of the pre-token of s that starts at i < len(s).
type splitFunc func(s string, i int) int

// preTokenizer resolves a tokenizer.ggml.pre name. ignoreMerges reports
// that a pre-token which is itself a token is used as is, before merging
// (the Llama 3 tokenizer does that).
func preTokenizer(name string) (split splitFunc, ignoreMerges bool, ok bool) {
	switch name {
	case "", "default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion":
		return splitGPT2, false, true
	case "llama-bpe", "llama3", "llama-v3":
		return splitLlama3, true, true
	case "dbrx", "smaug-bpe":
		return splitLlama3, false, true
	case "qwen2", "stablelm2":
		return splitQwen2, false, true
	}
	return nil, false, false
}

type charClass uint8

const (
	classOther charClass = iota // [^\s\p{L}\p{N}]
	classLetter
	classNumber
	classSpace
)

func classify(r rune) charClass {
	switch {
	case r < utf8.RuneSelf:
		c := byte(r)
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
			return classLetter
		case '0' <= c && c <= '9':
			return classNumber
		case c == ' ' || ('\t' <= c && c <= '\r'):
			return classSpace
		}
		return classOther
	case unicode.IsLetter(r):
		return classLetter
	case unicode.IsNumber(r):
		return classNumber
	case unicode.IsSpace(r): // the White_Space property
		return classSpace
	}
	return classOther
}

// charAt decodes the character at s[i]; past the end it reports (-1, 0).
func charAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return -1, 0
	}
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

// classAt is the class of the character at s[i]; past the end it reports
// classSpace with ok false.
func classAt(s string, i int) (charClass, int, bool) {
	r, n := charAt(s, i)
	if n == 0 {
		return classSpace, 0, false
	}
	return classify(r), n, true
}

// skipClass returns the end of the run of class c that starts at i.
func skipClass(s string, i int, c charClass) int {
	for i < len(s) {
		cc, n, _ := classAt(s, i)
		if cc != c {
			break
		}
		i += n
	}
	return i
}

// contraction matches 's 't 're 've 'm 'll 'd at s[i] (which is the
// apostrophe) and returns its end, or 0.
func contraction(s string, i int, foldCase bool) int {
	lower := func(j int) byte {
		if j >= len(s) {
			return 0
		}
		c := s[j]
		if foldCase && 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		return c
	}
	switch lower(i + 1) {
	case 's', 't', 'm', 'd':
		return i + 2
	case 'r', 'v':
		if lower(i+2) == 'e' {
			return i + 3
		}
	case 'l':
		if lower(i+2) == 'l' {
			return i + 3
		}
	}
	return 0
}

// spaceRun handles the trailing alternatives \s+(?!\S)|\s+ for the
// whitespace run starting at i: a run followed by text leaves its last
// character to prefix that text, unless the run is that single character.
func spaceRun(s string, i int) int {
	end, last := i, i
	for end < len(s) {
		c, n, _ := classAt(s, end)
		if c != classSpace {
			break
		}
		last = end
		end += n
	}
	if end == len(s) || last == i {
		return end
	}
	return last
}

// splitGPT2 implements GPT-2's pre-tokenizer:
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
func splitGPT2(s string, i int) int {
	if s[i] == '\'' {
		if j := contraction(s, i, false); j > 0 {
			return j
		}
	}
	c, n, _ := classAt(s, i)
	if s[i] == ' ' {
		// " ?X+" for letters, numbers and other characters.
		if next, m, ok := classAt(s, i+1); ok && next != classSpace {
			return skipClass(s, i+1+m, next)
		}
	}
	if c != classSpace {
		return skipClass(s, i+n, c)
	}
	return spaceRun(s, i)
}

// splitLlama3 implements the Llama 3 (tiktoken cl100k-style) pre-tokenizer:
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
func splitLlama3(s string, i int) int { return splitTiktoken(s, i, 3) }

// splitQwen2 is splitLlama3 with numbers cut into single digits (\p{N}).
func splitQwen2(s string, i int) int { return splitTiktoken(s, i, 1) }

func splitTiktoken(s string, i int, maxDigits int) int {
	if s[i] == '\'' {
		if j := contraction(s, i, true); j > 0 {
			return j
		}
	}
	c, n, _ := classAt(s, i)
	switch c {
	case classLetter:
		return skipClass(s, i+n, classLetter)
	case classNumber:
		j := i + n
		for k := 1; k < maxDigits; k++ {
			cc, m, _ := classAt(s, j)
			if cc != classNumber {
				break
			}
			j += m
		}
		return j
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+ : one non-newline character glued to a word.
	if s[i] != '\r' && s[i] != '\n' {
		if next, m, _ := classAt(s, i+n); next == classLetter {
			return skipClass(s, i+n+m, classLetter)
		}
	}
	// ?[^\s\p{L}\p{N}]+[\r\n]*
	start := -1
	if c == classOther {
		start = i
	} else if s[i] == ' ' {
		if next, _, _ := classAt(s, i+1); next == classOther {
			start = i + 1
		}
	}
	if start >= 0 {
		j := skipClass(s, start, classOther)
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	// c is whitespace here. \s*[\r\n]+ : the run up to its last newline.
	end, lastNL := i, -1
	for end < len(s) {
		cc, m, _ := classAt(s, end)
		if cc != classSpace {
			break
		}
		if s[end] == '\r' || s[end] == '\n' {
			lastNL = end
		}
		end += m
	}
	if lastNL >= 0 {
		return lastNL + 1
	}
	return spaceRun(s, i)
}
