package tokenizer

import "unicode/utf8"

// symbol is a node of the doubly linked list that both merge loops work on:
// a byte range of the text being tokenized. A symbol that was merged into
// its left neighbour is empty (start == end).
type symbol struct {
	start, end int
	prev, next int // -1 at the ends
}

func (s *symbol) size() int { return s.end - s.start }

// splitChars cuts s into one symbol per UTF-8 character. An invalid byte
// becomes a symbol of its own, so it can still fall back to a byte token
// and survive a round trip.
func splitChars(s string) []symbol {
	syms := make([]symbol, 0, len(s))
	for i := 0; i < len(s); {
		_, n := utf8.DecodeRuneInString(s[i:])
		k := len(syms)
		syms = append(syms, symbol{start: i, end: i + n, prev: k - 1, next: k + 1})
		i += n
	}
	if len(syms) > 0 {
		syms[len(syms)-1].next = -1
	}
	return syms
}

// join merges the symbol at r into its left neighbour l.
func join(syms []symbol, l, r int) {
	left, right := &syms[l], &syms[r]
	left.end = right.end
	left.next = right.next
	if right.next >= 0 {
		syms[right.next].prev = l
	}
	right.end = right.start
}

// bigram is a candidate merge of the adjacent symbols left and right. Both
// merge loops use it: SentencePiece with the piece's score, byte-level BPE
// with the negated merge rank (exact in float32 below 2^24 merges). The
// int32 fields keep the queue compact, which matters for long prompts.
type bigram struct {
	score       float32
	left, right int32
	size        int32 // byte length of the merged text, to detect stale entries
}

// before reports whether a must be merged before b: higher score first, the
// leftmost pair on ties (as llama.cpp and SentencePiece do).
func (a *bigram) before(b *bigram) bool {
	return a.score > b.score || (a.score == b.score && a.left < b.left)
}

// workQueue is a binary heap of bigrams. Merge loops push every candidate
// pair and discard stale ones when popped, which keeps tokenization
// O(n log n) in the length of the text instead of rescanning all pairs after
// each merge.
type workQueue []bigram

func (q *workQueue) push(x bigram) {
	h := append(*q, x)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h[i].before(&h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	*q = h
}

func (q *workQueue) pop() bigram {
	h := *q
	top := h[0]
	last := len(h) - 1
	h[0] = h[last]
	h = h[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= len(h) {
			break
		}
		c := l
		if r := l + 1; r < len(h) && h[r].before(&h[l]) {
			c = r
		}
		if !h[c].before(&h[i]) {
			break
		}
		h[i], h[c] = h[c], h[i]
		i = c
	}
	*q = h
	return top
}

// mergeLoop merges symbols by popping q until it is empty. stale entries
// are recognised by size: symbols only grow, so equal sizes mean neither
// side changed since the pair was queued. After each merge, try is called
// for the two new neighbour pairs.
func mergeLoop(syms []symbol, q *workQueue, try func(l, r int)) {
	for len(*q) > 0 {
		bg := q.pop()
		left, right := int(bg.left), int(bg.right)
		l, r := &syms[left], &syms[right]
		if l.size() == 0 || r.size() == 0 || l.size()+r.size() != int(bg.size) {
			continue
		}
		join(syms, left, right)
		try(syms[left].prev, left)
		try(left, syms[left].next)
	}
}
