// Package tokenizer turns text into token ids and back for models described by
// GGUF tokenizer metadata (the tokenizer.ggml.* keys). It follows llama.cpp's
// behaviour for SentencePiece-BPE ("llama") and byte-level BPE ("gpt2")
// vocabularies so that a model sees the same ids it would see under llama.cpp.
//
// The package deliberately does not read GGUF files: the model loader copies
// the metadata into a Vocab. That keeps the tokenizer testable on its own and
// lets built-in models supply a vocabulary without any file (see BuiltinVocab).
//
// Tokenizers returned by New are immutable apart from internal caches and are
// safe for concurrent use.
package tokenizer

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Vocab is the tokenizer part of a GGUF file's metadata (keys tokenizer.ggml.*).
type Vocab struct {
	Model          string    // tokenizer.ggml.model: "llama" (SentencePiece BPE with byte fallback) or "gpt2" (byte-level BPE)
	Pre            string    // tokenizer.ggml.pre (gpt2 pre-tokenizer name; "" or "default" → GPT-2 regex)
	Tokens         []string  // tokenizer.ggml.tokens
	Scores         []float32 // tokenizer.ggml.scores (llama); may be nil (all scores 0, as llama.cpp does)
	Types          []int32   // tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte; may be nil
	Merges         []string  // tokenizer.ggml.merges (gpt2): "a b" pairs in priority order
	BOS, EOS       int32     // -1 when absent
	UNK, PAD       int32     // -1 when absent
	AddBOS         bool      // tokenizer.ggml.add_bos_token (the loader decides defaults)
	AddSpacePrefix bool      // tokenizer.ggml.add_space_prefix (llama only; ignored for gpt2)
}

// Token types as stored in tokenizer.ggml.token_type.
const (
	TypeUndefined   int32 = 0 // treated like TypeNormal, as llama.cpp does
	TypeNormal      int32 = 1
	TypeUnknown     int32 = 2
	TypeControl     int32 = 3
	TypeUserDefined int32 = 4
	TypeUnused      int32 = 5
	TypeByte        int32 = 6
)

// Tokenizer converts between text and token ids.
type Tokenizer interface {
	// Encode tokenizes text. Control tokens written literally in text are
	// NOT recognised (so user input cannot inject "</s>"); user-defined
	// tokens are, because they are ordinary text pieces. addSpecial prepends
	// BOS when the vocabulary asks for it (Vocab.AddBOS).
	Encode(text string, addSpecial bool) ([]int32, error)
	// Decode renders a whole sequence. Control tokens (BOS, EOS, ...) are
	// skipped, and for "llama" vocabularies with AddSpacePrefix the space the
	// prefix added is removed from the first piece. An out-of-range id is an
	// error. The result holds the decoded bytes as they are, so a sequence
	// cut in the middle of a byte-fallback character is not valid UTF-8; use
	// a StreamDecoder when valid text is needed.
	Decode(ids []int32) (string, error)
	// Piece is the raw text of one token as it would be emitted while
	// streaming: "▁" becomes a space (and the space-prefix space is kept),
	// a byte token is its single byte (possibly half a character), control
	// and unused tokens are "", unknown tokens are U+FFFD, and out-of-range
	// ids are "".
	Piece(id int32) string
	VocabSize() int
	BOS() int32 // -1 when absent
	EOS() int32 // -1 when absent
	// IsEOG reports whether generation should stop at id: EOS and the usual
	// end-of-turn control tokens ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", ...).
	IsEOG(id int32) bool
}

// SpecialEncoder is implemented by the tokenizers of this package. Chat
// templates use it: their text contains control tokens such as "<s>" or
// "<|im_start|>" that must become the token ids, not their spelling.
type SpecialEncoder interface {
	// EncodeWithSpecials tokenizes text, turning every exact occurrence of a
	// control, unknown or user-defined token's text into that token (the
	// longest match wins at each position). No BOS is added: templates
	// write it themselves.
	EncodeWithSpecials(text string) ([]int32, error)
}

// New builds the tokenizer for v. It validates v so that a bad GGUF file
// fails at load time with a clear message instead of mis-tokenizing later.
// The slices of v are retained, not copied; the caller must not modify them.
func New(v Vocab) (Tokenizer, error) {
	switch v.Model {
	case "llama":
		b, err := newBase(&v)
		if err != nil {
			return nil, err
		}
		return newSPM(b, &v), nil
	case "gpt2":
		b, err := newBase(&v)
		if err != nil {
			return nil, err
		}
		return newBPE(b, &v)
	default:
		return nil, fmt.Errorf("tokenizer: unsupported tokenizer model %q", v.Model)
	}
}

// eogTexts are end-of-turn tokens that many chat models emit instead of (or as
// well as) EOS; llama.cpp stops generation on the same list.
var eogTexts = []string{
	"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
	"<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
}

// base holds what both tokenizer kinds share: token tables, special-token
// handling and decoding.
type base struct {
	text  []string // raw vocabulary strings
	typ   []int32  // effective token types (see newBase)
	piece []string // precomputed Piece output per id

	// ordinary maps text to the tokens the merge algorithms may produce:
	// normal, undefined and user-defined ones. Control, unknown, unused and
	// byte tokens are excluded so that no input text can turn into them.
	ordinary map[string]int32
	rest     map[string]int32 // byte and unused tokens, for TokenID only
	specials specialMatcher

	bos, eos, unk int32
	addBOS        bool
	// stripSpace is set when decoding must drop the space that the space
	// prefix added in front of the first piece.
	stripSpace bool
	eog        map[int32]struct{}
}

func newBase(v *Vocab) (*base, error) {
	n := len(v.Tokens)
	if n == 0 {
		return nil, errors.New("tokenizer: vocab has no tokens")
	}
	if n > 1<<31-1 {
		return nil, fmt.Errorf("tokenizer: vocab has too many tokens (%d)", n)
	}
	if v.Scores != nil && len(v.Scores) != n {
		return nil, fmt.Errorf("tokenizer: vocab has %d scores for %d tokens", len(v.Scores), n)
	}
	for i, sc := range v.Scores {
		if math.IsNaN(float64(sc)) { // would make merge order arbitrary
			return nil, fmt.Errorf("tokenizer: token %d (%q) has a NaN score", i, v.Tokens[i])
		}
	}
	if v.Types != nil && len(v.Types) != n {
		return nil, fmt.Errorf("tokenizer: vocab has %d token types for %d tokens", len(v.Types), n)
	}
	for _, s := range []struct {
		name string
		id   int32
	}{{"BOS", v.BOS}, {"EOS", v.EOS}, {"UNK", v.UNK}, {"PAD", v.PAD}} {
		if s.id < -1 || int(s.id) >= n {
			return nil, fmt.Errorf("tokenizer: %s id %d out of range [0, %d)", s.name, s.id, n)
		}
	}
	if v.AddBOS && v.BOS < 0 {
		return nil, errors.New("tokenizer: AddBOS is set but the vocab has no BOS token")
	}

	typ := make([]int32, n)
	if v.Types != nil {
		for i, t := range v.Types {
			if t < TypeUndefined || t > TypeByte {
				return nil, fmt.Errorf("tokenizer: token %d (%q) has invalid type %d", i, v.Tokens[i], t)
			}
			typ[i] = t
		}
	} else {
		// Without types, infer the ones that matter: special ids must not be
		// produced from text or rendered, and "<0xXX>" pieces of a
		// SentencePiece vocab are its byte-fallback tokens.
		for i, s := range v.Tokens {
			typ[i] = TypeNormal
			if v.Model == "llama" {
				if _, ok := parseByteToken(s); ok {
					typ[i] = TypeByte
				}
			}
		}
		for _, id := range []int32{v.BOS, v.EOS} {
			if id >= 0 {
				typ[id] = TypeControl
			}
		}
		if v.UNK >= 0 {
			typ[v.UNK] = TypeUnknown
		}
	}

	b := &base{
		text:     v.Tokens,
		typ:      typ,
		ordinary: make(map[string]int32, n),
		rest:     make(map[string]int32),
		bos:      v.BOS,
		eos:      v.EOS,
		unk:      v.UNK,
		addBOS:   v.AddBOS,
		eog:      make(map[int32]struct{}),
	}
	for i, s := range v.Tokens {
		switch typ[i] {
		case TypeNormal, TypeUndefined, TypeUserDefined:
			if s != "" {
				b.ordinary[s] = int32(i) // a later duplicate wins, as in llama.cpp
			}
		case TypeByte, TypeUnused:
			b.rest[s] = int32(i)
		}
	}
	b.specials.build(v.Tokens, typ)

	if v.EOS >= 0 {
		b.eog[v.EOS] = struct{}{}
	}
	wanted := make(map[string]bool, len(eogTexts))
	for _, s := range eogTexts {
		wanted[s] = true
	}
	for i, s := range v.Tokens {
		if wanted[s] { // whatever its stored type, as llama.cpp does
			b.eog[int32(i)] = struct{}{}
		}
	}
	return b, nil
}

// parseByteToken recognises SentencePiece byte-fallback pieces "<0xXX>".
func parseByteToken(s string) (byte, bool) {
	if len(s) != 6 || s[:3] != "<0x" || s[5] != '>' {
		return 0, false
	}
	v, err := strconv.ParseUint(s[3:5], 16, 8)
	if err != nil {
		return 0, false
	}
	return byte(v), true
}

// byteTokenText is the SentencePiece spelling of a byte-fallback token.
func byteTokenText(c byte) string {
	const hex = "0123456789ABCDEF"
	return string([]byte{'<', '0', 'x', hex[c>>4], hex[c&15], '>'})
}

// VocabSize returns the number of tokens in the vocabulary.
func (b *base) VocabSize() int { return len(b.text) }

// BOS returns the beginning-of-sequence token id, or -1.
func (b *base) BOS() int32 { return b.bos }

// EOS returns the end-of-sequence token id, or -1.
func (b *base) EOS() int32 { return b.eos }

// IsEOG reports whether id ends generation (EOS or an end-of-turn token).
func (b *base) IsEOG(id int32) bool {
	_, ok := b.eog[id]
	return ok
}

// Piece returns the streaming text of id; see Tokenizer.Piece.
func (b *base) Piece(id int32) string {
	if id < 0 || int(id) >= len(b.piece) {
		return ""
	}
	return b.piece[id]
}

// TokenText returns the vocabulary's spelling of id ("▁the", "<0x0A>",
// "<|im_end|>"), or "" when id is out of range. Unlike Piece it does not
// render the token; it is meant for logs and for matching stop strings.
func (b *base) TokenText(id int32) string {
	if id < 0 || int(id) >= len(b.text) {
		return ""
	}
	return b.text[id]
}

// TokenID looks a token up by its vocabulary spelling, including special
// tokens such as "<|eot_id|>".
func (b *base) TokenID(text string) (int32, bool) {
	if id, ok := b.ordinary[text]; ok {
		return id, true
	}
	if id := b.specials.exact(text); id >= 0 {
		return id, true
	}
	if id, ok := b.rest[text]; ok {
		return id, true
	}
	return -1, false
}

// Decode renders ids; see Tokenizer.Decode.
func (b *base) Decode(ids []int32) (string, error) {
	var sb strings.Builder
	atStart := b.stripSpace
	for _, id := range ids {
		if id < 0 || int(id) >= len(b.text) {
			return "", fmt.Errorf("tokenizer: token id %d out of range [0, %d)", id, len(b.text))
		}
		sb.WriteString(b.decodePiece(id, &atStart))
	}
	return sb.String(), nil
}

// decodePiece is Piece within a decode: while *atStart is set (no text has
// been produced yet), the first text piece loses one leading space, which
// undoes the space prefix of "llama" vocabularies. Decode and StreamDecoder
// share it so that they cannot disagree.
func (b *base) decodePiece(id int32, atStart *bool) string {
	p := b.Piece(id)
	if *atStart && p != "" {
		*atStart = false
		if t := b.typ[id]; t != TypeByte && t != TypeUnknown && p[0] == ' ' {
			p = p[1:]
		}
	}
	return p
}

func (b *base) stripsLeadingSpace() bool { return b.stripSpace }

// maxTextLen bounds Encode's input: the merge loops index the normalized
// text (up to 3× longer: " " becomes "▁") with int32.
const maxTextLen = 1 << 28

// fragmentEncoder tokenizes a run of text that contains no special tokens.
// first is true when the run starts the text or directly follows a special
// token, which is where SentencePiece adds its space prefix.
type fragmentEncoder interface {
	encodeText(dst []int32, text string, first bool) ([]int32, error)
}

// encode splits text at special tokens and tokenizes the text between them.
func (b *base) encode(e fragmentEncoder, text string, bos, allSpecials bool) ([]int32, error) {
	if len(text) > maxTextLen {
		return nil, fmt.Errorf("tokenizer: text of %d bytes is longer than the %d-byte limit", len(text), maxTextLen)
	}
	out := make([]int32, 0, len(text)/3+2)
	if bos {
		out = append(out, b.bos)
	}
	first := true
	var err error
	b.specials.split(text, allSpecials, func(frag string, id int32) bool {
		if id >= 0 {
			out = append(out, id)
			first = true
			return true
		}
		out, err = e.encodeText(out, frag, first)
		first = false
		return err == nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// renderPieces fills b.piece, what each token prints as: control and unused
// tokens nothing, the unknown token U+FFFD, byte tokens "<0xXX>" their byte,
// and the others their text as text renders it (user-defined tokens verbatim
// when userVerbatim).
func (b *base) renderPieces(tokens []string, text func(string) string, userVerbatim bool) {
	b.piece = make([]string, len(tokens))
	for i, s := range tokens {
		switch b.typ[i] {
		case TypeControl, TypeUnused:
		case TypeUnknown:
			b.piece[i] = "\uFFFD"
		case TypeUserDefined:
			if userVerbatim {
				b.piece[i] = s
			} else {
				b.piece[i] = text(s)
			}
		case TypeByte:
			if c, ok := parseByteToken(s); ok {
				b.piece[i] = string([]byte{c})
			} else {
				b.piece[i] = text(s)
			}
		default:
			b.piece[i] = text(s)
		}
	}
}
