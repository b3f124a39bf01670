package tokenizer

import (
	"fmt"
	"strings"
)

// Limits of BuiltinVocab. The minimum is the three special tokens and 256
// byte tokens plus 64 pieces, enough for "▁", the lowercase letters, digits
// and most uppercase ones; the maximum keeps construction well under a
// second.
const (
	MinBuiltinSize = 3 + 256 + 64
	MaxBuiltinSize = 1 << 18
)

const builtinFixed = 3 + 256 // ids before the first normal piece

// BuiltinVocab returns a deterministic "llama"-model vocab of exactly size
// tokens, for the project's built-in models that are generated from a seed
// and must not download anything:
//
//	id 0 "<unk>" (unknown, UNK), 1 "<s>" (control, BOS), 2 "</s>" (control, EOS),
//	3..258 the byte tokens "<0x00>".."<0xFF>",
//	then normal pieces.
//
// The normal pieces are, in order: "▁" and single characters (lowercase,
// punctuation, digits, uppercase), then common English subwords and
// "▁"-prefixed words, then systematically generated letter pairs and
// triples. Scores fall with that order (score = -rank), so common pieces win
// merges. Every multi-character piece is added only together with the
// intermediate pieces it needs and only if SentencePiece merging of its own
// text yields exactly that piece, which is what makes every piece reachable
// for llama.cpp as well. The vocabulary for a size is a prefix of the
// vocabulary for any larger size. It accepts sizes from MinBuiltinSize to
// MaxBuiltinSize.
func BuiltinVocab(size int) (Vocab, error) {
	if size < MinBuiltinSize || size > MaxBuiltinSize {
		return Vocab{}, fmt.Errorf("tokenizer: builtin vocab size %d out of range [%d, %d]", size, MinBuiltinSize, MaxBuiltinSize)
	}
	b := &vocabBuilder{
		limit:  size,
		tokens: make([]string, 0, size),
		scores: make([]float32, 0, size),
		types:  make([]int32, 0, size),
		ids:    make(map[string]int32, size),
	}
	b.append("<unk>", TypeUnknown, 0)
	b.append("<s>", TypeControl, 0)
	b.append("</s>", TypeControl, 0)
	for c := 0; c < 256; c++ {
		b.append(byteTokenText(byte(c)), TypeByte, 0)
	}
	for p := range builtinCandidates {
		if b.full() {
			break
		}
		b.addPiece(p)
	}
	if !b.full() { // unreachable below MaxBuiltinSize, but never return a short vocab
		return Vocab{}, fmt.Errorf("tokenizer: builtin vocab cannot reach size %d", size)
	}
	return Vocab{
		Model:          "llama",
		Tokens:         b.tokens,
		Scores:         b.scores,
		Types:          b.types,
		BOS:            1,
		EOS:            2,
		UNK:            0,
		PAD:            -1,
		AddBOS:         true,
		AddSpacePrefix: true,
	}, nil
}

// vocabBuilder grows a SentencePiece vocabulary one normal piece at a time.
type vocabBuilder struct {
	limit  int
	tokens []string
	scores []float32
	types  []int32
	ids    map[string]int32 // normal pieces only: what merging may produce
	normal int              // normal pieces so far; the next one's rank
}

func (b *vocabBuilder) full() bool { return len(b.tokens) >= b.limit }

func (b *vocabBuilder) append(s string, typ int32, score float32) {
	b.tokens = append(b.tokens, s)
	b.types = append(b.types, typ)
	b.scores = append(b.scores, score)
}

func (b *vocabBuilder) model() *spmModel { return &spmModel{ids: b.ids, scores: b.scores} }

// segment returns the pieces SentencePiece merging turns s into.
func (b *vocabBuilder) segment(s string) []string {
	syms := b.model().merge(s)
	var out []string
	for i := 0; len(syms) > 0 && i >= 0; i = syms[i].next {
		out = append(out, s[syms[i].start:syms[i].end])
	}
	return out
}

// addPiece adds p, first adding whatever intermediate pieces merging needs
// to reach it. Each new piece gets the lowest score so far, which cannot
// change how any earlier piece's text merges (a lowest-scored pair is only
// merged once nothing else can be), so earlier pieces stay reachable.
func (b *vocabBuilder) addPiece(p string) {
	for !b.full() {
		if _, ok := b.ids[p]; ok {
			return
		}
		segs := b.segment(p)
		for _, s := range segs {
			if _, ok := b.ids[s]; !ok {
				if len(segs) == 1 { // a single character: always addable
					b.tryAdd(s)
				}
				return // a character of p is not in the vocabulary yet
			}
		}
		// Merging got stuck at segs: add the leftmost adjacent pair whose
		// own text merges into it, then try again.
		added := false
		for k := 0; k+1 < len(segs) && !added; k++ {
			added = b.tryAdd(segs[k] + segs[k+1])
		}
		if !added {
			return
		}
	}
}

// tryAdd appends s as a normal piece and keeps it only if merging its own
// text produces exactly s.
func (b *vocabBuilder) tryAdd(s string) bool {
	id := int32(len(b.tokens))
	b.append(s, TypeNormal, -float32(b.normal))
	b.ids[s] = id
	if segs := b.segment(s); len(segs) == 1 {
		b.normal++
		return true
	}
	delete(b.ids, s)
	b.tokens = b.tokens[:id]
	b.types = b.types[:id]
	b.scores = b.scores[:id]
	return false
}

// Letters ordered by frequency in English text, so that generated pieces
// made of common letters come first.
const (
	lowerByFreq = "etaoinshrdlcumwfgypbvkjxqz"
	upperByFreq = "TAISOWHBCMFPDRLEGNYUKVJQXZ"
)

// builtinChars are the single-character pieces, most useful first. "▁"
// leads because without it every space would cost three byte tokens.
var builtinChars = func() []string {
	var out []string
	add := func(s string) {
		for _, r := range s {
			out = append(out, string(r))
		}
	}
	add(spaceMarker)
	add(lowerByFreq)
	add(".,")
	add("0123456789")
	add(upperByFreq)
	add("'\"-?!:;()/")
	add("[]{}<>&*%$#@+=_|~^`\\")
	return out
}()

// builtinSubwords are frequent English letter groups that are not words of
// their own, most frequent first.
var builtinSubwords = strings.Fields(`
th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha
as ou io le ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur
ing ion tion ent ers ter ly ment ness able ous ive ful less est ity ation
ight ould ther ally ence ance ect ver pro con com per ure ust ook ake ame ine
ore art ies ated ting ings ions led ers ted ism ist ize ise ward wards
's 't 're 've 'll 'd 'm
`)

// builtinWords are common English words, most frequent first; each enters
// the vocabulary as "▁"+word.
var builtinWords = strings.Fields(`
the of and to a in is it you that he was for on are with as I his they be at
one have this from or had by not word but what some we can out other were all
there when up use your how said an each she which do their time if will way
about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take
get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say
help low line differ turn cause much mean before move right boy old too same
tell does set three want air well also play small end put home read hand port
large spell add even land here must big high such follow act why ask men change
went light kind off need house picture try us again animal point mother world
near build self earth father head stand own page should country found answer
school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book
carry took science eat room friend began idea fish mountain stop once base hear
horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose
leave song measure door product black short class wind question happen
complete ship area half rock order fire south problem piece told knew pass
since top whole king space heard best hour better true during hundred five
remember step early hold west ground interest reach fast sing listen six table
travel less morning ten simple several toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold
notice voice unit power town fine certain fly fall lead cry dark machine note
wait plan figure star box field rest correct able done beauty drive stood
contain front teach week final gave green quick develop ocean warm free minute
strong special mind behind clear produce fact street nothing course stay wheel
full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane dry wonder laugh thousand ago ran check
game shape hot miss brought heat snow bring yes distant fill east paint
language among because however information important government company
program computer data model code function value user service business result
system public process level support report market include provide continue
`)

// builtinExtras are whitespace runs and punctuation groups common in text
// and code.
var builtinExtras = strings.Fields(`
▁▁ ▁▁▁▁ ▁▁▁ ▁▁▁▁▁▁▁▁ ▁( ▁" ▁- ▁' ▁[ ▁{ ▁= ▁+ ▁* ▁/ ▁< ▁> ▁&
). ), ." ," ... -- ") (" :// ::
`)

// builtinCandidates yields candidate pieces in priority order. The stream is
// far longer than any supported size needs; BuiltinVocab stops early.
func builtinCandidates(yield func(string) bool) {
	emit := func(list []string, prefix string) bool {
		for _, s := range list {
			if !yield(prefix + s) {
				return false
			}
		}
		return true
	}
	lower := strings.Split(lowerByFreq, "")
	upper := strings.Split(upperByFreq, "")
	capital := func(w string) string { return strings.ToUpper(w[:1]) + w[1:] }
	top := builtinWords[:100]
	caps := make([]string, len(top))
	for i, w := range top {
		caps[i] = capital(w)
	}

	ok := emit(builtinChars, "") &&
		emit(top, spaceMarker) &&
		emit(builtinSubwords, "") &&
		emit(builtinWords[100:], spaceMarker) &&
		emit(caps, spaceMarker) &&
		emit(builtinExtras, "") &&
		emit(lower, spaceMarker) &&
		emit(upper, spaceMarker) &&
		emit(strings.Split("0123456789", ""), spaceMarker) &&
		emit(caps, "") &&
		emit(builtinWords, "")
	if !ok {
		return
	}
	// Generated pieces: letter groups, commonest letters first (ordered by
	// the sum of the letters' frequency ranks).
	for _, g := range []struct {
		n      int
		prefix string
		first  []string
	}{
		{2, "", lower}, {2, spaceMarker, lower}, {2, spaceMarker, upper},
		{3, "", lower}, {3, spaceMarker, lower}, {3, spaceMarker, upper},
		{4, "", lower}, {4, spaceMarker, lower},
	} {
		if !letterGroups(g.n, g.first, lower, func(s string) bool { return yield(g.prefix + s) }) {
			return
		}
	}
}

// letterGroups yields every n-letter string whose first letter is from
// first and the rest from rest, by increasing sum of frequency ranks, then
// in index order.
func letterGroups(n int, first, rest []string, yield func(string) bool) bool {
	idx := make([]int, n)
	maxSum := len(first) - 1 + (n-1)*(len(rest)-1)
	var rec func(pos, remaining int) bool
	rec = func(pos, remaining int) bool {
		if pos == n-1 {
			limit := len(rest)
			if pos == 0 {
				limit = len(first)
			}
			if remaining >= limit {
				return true
			}
			idx[pos] = remaining
			var sb strings.Builder
			for i, k := range idx {
				if i == 0 {
					sb.WriteString(first[k])
				} else {
					sb.WriteString(rest[k])
				}
			}
			return yield(sb.String())
		}
		limit := len(rest)
		if pos == 0 {
			limit = len(first)
		}
		for k := 0; k < limit && k <= remaining; k++ {
			idx[pos] = k
			if !rec(pos+1, remaining-k) {
				return false
			}
		}
		return true
	}
	for sum := 0; sum <= maxSum; sum++ {
		if !rec(0, sum) {
			return false
		}
	}
	return true
}
