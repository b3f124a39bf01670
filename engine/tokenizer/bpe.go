package tokenizer

import (
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"
)

// GPT-2's byte-level BPE works on text where every byte is replaced by a
// printable character, so that vocabularies and merges can be stored as
// strings: printable bytes stand for themselves and the others (controls,
// space, a few Latin-1 ones) take the characters from U+0100 upwards in
// byte order. A space, for example, becomes "Ġ" (U+0120).
var byteRunes, runeBytes = byteLevelTables()

// byteRuneText holds the UTF-8 form of each byte's character, for building
// mapped strings without per-byte encoding work.
var byteRuneText = func() (t [256]string) {
	for b := range t {
		t[b] = string(byteRunes[b])
	}
	return t
}()

func byteLevelTables() (fwd [256]rune, inv []int16) {
	printable := func(b int) bool {
		return ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b && b <= 0xFF)
	}
	next := rune(256)
	for b := range fwd {
		if printable(b) {
			fwd[b] = rune(b)
		} else {
			fwd[b] = next
			next++
		}
	}
	inv = make([]int16, next)
	for i := range inv {
		inv[i] = -1
	}
	for b, r := range fwd {
		inv[r] = int16(b)
	}
	return fwd, inv
}

// byteOf returns the byte that r stands for in byte-level text.
func byteOf(r rune) (byte, bool) {
	if r >= 0 && int(r) < len(runeBytes) && runeBytes[r] >= 0 {
		return byte(runeBytes[r]), true
	}
	return 0, false
}

// decodeByteLevel turns a byte-level token back into the bytes it stands
// for. Characters outside the mapping (a vocabulary that stores some text
// verbatim) are kept as they are rather than dropped.
func decodeByteLevel(s string) string {
	buf := make([]byte, 0, len(s))
	for _, r := range s {
		if b, ok := byteOf(r); ok {
			buf = append(buf, b)
		} else {
			buf = utf8.AppendRune(buf, r)
		}
	}
	return string(buf)
}

// BPETokenizer implements the "gpt2" tokenizer model: byte-level BPE with a
// regex pre-tokenizer chosen by Vocab.Pre, run the way llama.cpp runs it.
//
// Text is cut into pre-tokens, each pre-token's bytes are mapped to their
// byte-level characters, and adjacent symbols are merged in Merges order
// (lowest rank first, leftmost on ties). Results are cached per pre-token.
type BPETokenizer struct {
	*base
	ranks        map[mergePair]int32
	split        splitFunc
	ignoreMerges bool
	byteTok      [256]int32 // token spelled by each byte's single character, -1 when missing

	mu    sync.RWMutex
	cache map[string][]int32
}

var _ interface {
	Tokenizer
	SpecialEncoder
} = (*BPETokenizer)(nil)

type mergePair struct{ left, right string }

const (
	maxCachedWord   = 64      // longer pre-tokens are rare; not worth caching
	maxCacheEntries = 1 << 16 // bounds memory; the cache is reset when full
)

func newBPE(b *base, v *Vocab) (*BPETokenizer, error) {
	split, ignore, ok := preTokenizer(v.Pre)
	if !ok {
		return nil, fmt.Errorf("tokenizer: unsupported gpt2 pre-tokenizer %q", v.Pre)
	}
	if len(v.Merges) > 1<<24 { // ranks are compared as float32 scores
		return nil, fmt.Errorf("tokenizer: too many merges (%d)", len(v.Merges))
	}
	t := &BPETokenizer{
		base:         b,
		ranks:        make(map[mergePair]int32, len(v.Merges)),
		split:        split,
		ignoreMerges: ignore,
		cache:        make(map[string][]int32),
	}
	for i, m := range v.Merges {
		// The left part may itself start with a space, so the separator
		// is searched from the second byte on, as llama.cpp does.
		p := -1
		if len(m) >= 3 {
			if k := strings.IndexByte(m[1:], ' '); k >= 0 {
				p = k + 1
			}
		}
		if p < 0 || p == len(m)-1 {
			return nil, fmt.Errorf("tokenizer: merge %d (%q) is not a pair \"a b\"", i, m)
		}
		k := mergePair{m[:p], m[p+1:]}
		if _, dup := t.ranks[k]; !dup {
			t.ranks[k] = int32(i)
		}
	}
	for c := range t.byteTok {
		t.byteTok[c] = -1
		if id, ok := b.ordinary[byteRuneText[c]]; ok {
			t.byteTok[c] = id
		}
	}
	b.renderPieces(v.Tokens, decodeByteLevel, true)
	return t, nil
}

// Encode tokenizes text; see Tokenizer.Encode.
func (t *BPETokenizer) Encode(text string, addSpecial bool) ([]int32, error) {
	return t.encode(t, text, addSpecial && t.addBOS, false)
}

// EncodeWithSpecials tokenizes text and recognises control tokens written in
// it; see SpecialEncoder.
func (t *BPETokenizer) EncodeWithSpecials(text string) ([]int32, error) {
	return t.encode(t, text, false, true)
}

func (t *BPETokenizer) encodeText(dst []int32, text string, _ bool) ([]int32, error) {
	var err error
	for i := 0; i < len(text); {
		j := t.split(text, i)
		if dst, err = t.encodeWord(dst, text[i:j]); err != nil {
			return nil, err
		}
		i = j
	}
	return dst, nil
}

// encodeWord tokenizes one pre-token, through the cache when it is short.
func (t *BPETokenizer) encodeWord(dst []int32, w string) ([]int32, error) {
	cacheable := len(w) <= maxCachedWord
	if cacheable {
		t.mu.RLock()
		ids, ok := t.cache[w]
		t.mu.RUnlock()
		if ok {
			return append(dst, ids...), nil
		}
	}
	start := len(dst)
	dst, err := t.bpe(dst, w)
	if err != nil {
		return nil, err
	}
	if cacheable {
		ids := append([]int32(nil), dst[start:]...)
		t.mu.Lock()
		if len(t.cache) >= maxCacheEntries {
			t.cache = make(map[string][]int32)
		}
		t.cache[strings.Clone(w)] = ids // w may point into a huge prompt
		t.mu.Unlock()
	}
	return dst, nil
}

// bpe merges the byte-level characters of w by rank and appends the ids.
func (t *BPETokenizer) bpe(dst []int32, w string) ([]int32, error) {
	var sb strings.Builder
	sb.Grow(2 * len(w))
	for i := 0; i < len(w); i++ {
		sb.WriteString(byteRuneText[w[i]])
	}
	s := sb.String()
	if t.ignoreMerges {
		if id, ok := t.ordinary[s]; ok {
			return append(dst, id), nil
		}
	}
	syms := splitChars(s)
	if len(syms) > 1 {
		q := make(workQueue, 0, len(syms))
		try := func(l, r int) {
			if l < 0 || r < 0 {
				return
			}
			a, b := &syms[l], &syms[r]
			if rank, ok := t.ranks[mergePair{s[a.start:a.end], s[b.start:b.end]}]; ok {
				q.push(bigram{score: -float32(rank), left: int32(l), right: int32(r), size: int32(b.end - a.start)})
			}
		}
		for i := 1; i < len(syms); i++ {
			try(i-1, i)
		}
		mergeLoop(syms, &q, try)
	}
	for i := 0; i >= 0 && len(syms) > 0; i = syms[i].next {
		piece := s[syms[i].start:syms[i].end]
		if id, ok := t.ordinary[piece]; ok {
			dst = append(dst, id)
			continue
		}
		// A merge produced a string that is not a token (an inconsistent
		// vocabulary) or a byte has no token: spell it byte by byte.
		for _, r := range piece {
			c, _ := byteOf(r)
			switch {
			case t.byteTok[c] >= 0:
				dst = append(dst, t.byteTok[c])
			case t.unk >= 0:
				dst = append(dst, t.unk)
			default:
				return nil, fmt.Errorf("tokenizer: cannot encode byte 0x%02X: the vocab has no token for it and no unknown token", c)
			}
		}
	}
	return dst, nil
}
