package tokenizer

import (
	"fmt"
	"strings"
)

// spaceMarker is SentencePiece's visible stand-in for a space (U+2581).
const spaceMarker = "▁"

// SPMTokenizer implements the "llama" tokenizer model: SentencePiece BPE with
// byte fallback, run the way llama.cpp's SPM tokenizer runs it.
//
// Encoding replaces spaces by "▁", prepends "▁" when the vocabulary has
// AddSpacePrefix (at the start of the text and, as llama.cpp does, after
// each special token in EncodeWithSpecials), then repeatedly merges the
// adjacent pair whose concatenation is the highest-scoring token, the
// leftmost pair on ties. Characters that end up outside the vocabulary are
// spelled with "<0xXX>" byte tokens, or UNK when the vocabulary has none.
//
// A literal "▁" in the input is indistinguishable from a space after
// normalization and decodes as one; that is inherent to SentencePiece.
type SPMTokenizer struct {
	*base
	model          spmModel
	byteTok        [256]int32 // "<0xXX>" token per byte, -1 when missing
	addSpacePrefix bool
}

var _ interface {
	Tokenizer
	SpecialEncoder
} = (*SPMTokenizer)(nil)

func newSPM(b *base, v *Vocab) *SPMTokenizer {
	scores := v.Scores
	if scores == nil {
		scores = make([]float32, len(v.Tokens))
	}
	t := &SPMTokenizer{
		base:           b,
		model:          spmModel{ids: b.ordinary, scores: scores},
		addSpacePrefix: v.AddSpacePrefix,
	}
	b.stripSpace = v.AddSpacePrefix
	for i := range t.byteTok {
		t.byteTok[i] = -1
	}
	for i, s := range v.Tokens {
		if c, ok := parseByteToken(s); ok && b.typ[i] == TypeByte {
			t.byteTok[c] = int32(i)
		}
	}
	b.renderPieces(v.Tokens, func(s string) string { return strings.ReplaceAll(s, spaceMarker, " ") }, false)
	return t
}

// Encode tokenizes text; see Tokenizer.Encode.
func (t *SPMTokenizer) Encode(text string, addSpecial bool) ([]int32, error) {
	return t.encode(t, text, addSpecial && t.addBOS, false)
}

// EncodeWithSpecials tokenizes text and recognises control tokens written in
// it; see SpecialEncoder. Each text run that follows a special token gets
// its own space prefix, as in llama.cpp and Hugging Face's tokenizers, so
// "<s>[INST]" yields "▁[" like those do.
func (t *SPMTokenizer) EncodeWithSpecials(text string) ([]int32, error) {
	return t.encode(t, text, false, true)
}

func (t *SPMTokenizer) encodeText(dst []int32, text string, first bool) ([]int32, error) {
	s := strings.ReplaceAll(text, " ", spaceMarker)
	if first && t.addSpacePrefix {
		s = spaceMarker + s
	}
	syms := t.model.merge(s)
	if len(syms) == 0 {
		return dst, nil
	}
	for i := 0; i >= 0; i = syms[i].next { // symbol 0 is never merged away
		piece := s[syms[i].start:syms[i].end]
		if id, ok := t.model.ids[piece]; ok {
			dst = append(dst, id)
			continue
		}
		var err error
		if dst, err = t.fallback(dst, piece); err != nil {
			return nil, err
		}
	}
	return dst, nil
}

// fallback spells a character that is not in the vocabulary with byte
// tokens, or with UNK when some of its bytes have no byte token.
func (t *SPMTokenizer) fallback(dst []int32, piece string) ([]int32, error) {
	for k := 0; k < len(piece); k++ {
		if t.byteTok[piece[k]] < 0 {
			if t.unk < 0 {
				return nil, fmt.Errorf("tokenizer: cannot encode %q: the vocab has neither byte tokens for it nor an unknown token", piece)
			}
			return append(dst, t.unk), nil
		}
	}
	for k := 0; k < len(piece); k++ {
		dst = append(dst, t.byteTok[piece[k]])
	}
	return dst, nil
}

// spmModel is what the SentencePiece merge loop needs: which strings are
// mergeable tokens, and their scores. BuiltinVocab runs it on a vocabulary
// under construction.
type spmModel struct {
	ids    map[string]int32
	scores []float32
}

// merge splits s into characters and merges them as SentencePiece BPE does.
// It returns the symbol list; live symbols are reached from index 0.
func (m *spmModel) merge(s string) []symbol {
	syms := splitChars(s)
	if len(syms) < 2 {
		return syms
	}
	q := make(workQueue, 0, len(syms))
	try := func(l, r int) {
		if l < 0 || r < 0 {
			return
		}
		text := s[syms[l].start:syms[r].end]
		if id, ok := m.ids[text]; ok {
			q.push(bigram{score: m.scores[id], left: int32(l), right: int32(r), size: int32(len(text))})
		}
	}
	for i := 1; i < len(syms); i++ {
		try(i-1, i)
	}
	mergeLoop(syms, &q, try)
	return syms
}
