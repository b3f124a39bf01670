package tokenizer

// specialMatcher finds the spellings of special tokens in text with a byte
// trie, so splitting costs O(len(text) × longest special token) even for
// vocabularies with hundreds of reserved tokens.
//
// User-defined tokens are always matched: they are ordinary text pieces that
// the vocabulary wants kept whole (llama.cpp and SentencePiece do the same).
// Control and unknown tokens are matched only when asked for, because in
// user input "</s>" is text, not an end of sequence.
type specialMatcher struct {
	root    [256]int32 // child of the root per byte, -1 when none
	nodes   []trieNode
	hasUser bool // some user-defined token exists
	hasAny  bool // some special token exists
}

type trieNode struct {
	edges []trieEdge // few per node; searched linearly
	id    int32      // token spelled by the path to this node, or -1
	user  bool       // id is user-defined (matched even without allSpecials)
}

type trieEdge struct {
	b  byte
	to int32
}

func (m *specialMatcher) build(tokens []string, typ []int32) {
	for i := range m.root {
		m.root[i] = -1
	}
	for i, s := range tokens {
		t := typ[i]
		if s == "" || (t != TypeControl && t != TypeUnknown && t != TypeUserDefined) {
			continue
		}
		n := m.insert(s)
		m.nodes[n].id = int32(i) // a later duplicate wins, as in llama.cpp
		m.nodes[n].user = t == TypeUserDefined
		m.hasAny = true
		if t == TypeUserDefined {
			m.hasUser = true
		}
	}
}

// insert adds the path for s and returns its final node.
func (m *specialMatcher) insert(s string) int32 {
	n := m.root[s[0]]
	if n < 0 {
		n = m.newNode()
		m.root[s[0]] = n
	}
	for i := 1; i < len(s); i++ {
		next := m.child(n, s[i])
		if next < 0 {
			next = m.newNode()
			m.nodes[n].edges = append(m.nodes[n].edges, trieEdge{b: s[i], to: next})
		}
		n = next
	}
	return n
}

func (m *specialMatcher) newNode() int32 {
	m.nodes = append(m.nodes, trieNode{id: -1})
	return int32(len(m.nodes) - 1)
}

func (m *specialMatcher) child(n int32, b byte) int32 {
	for _, e := range m.nodes[n].edges {
		if e.b == b {
			return e.to
		}
	}
	return -1
}

// match returns the longest allowed special token starting at s[i] and its
// length in bytes, or (-1, 0).
func (m *specialMatcher) match(s string, i int, all bool) (int32, int) {
	n := m.root[s[i]]
	best, bestLen := int32(-1), 0
	for j := i + 1; n >= 0; j++ {
		nd := &m.nodes[n]
		if nd.id >= 0 && (all || nd.user) {
			best, bestLen = nd.id, j-i
		}
		if j == len(s) {
			break
		}
		n = m.child(n, s[j])
	}
	return best, bestLen
}

// exact returns the special token spelled exactly s, or -1.
func (m *specialMatcher) exact(s string) int32 {
	if s == "" {
		return -1
	}
	n := m.root[s[0]]
	for i := 1; i < len(s) && n >= 0; i++ {
		n = m.child(n, s[i])
	}
	if n < 0 {
		return -1
	}
	return m.nodes[n].id
}

// split walks s left to right and calls yield with either a run of plain text
// (id -1) or a special token (frag ""). It stops early when yield returns
// false.
func (m *specialMatcher) split(s string, all bool, yield func(frag string, id int32) bool) {
	if !m.hasAny || (!all && !m.hasUser) {
		if s != "" {
			yield(s, -1)
		}
		return
	}
	start := 0
	for i := 0; i < len(s); {
		if m.root[s[i]] >= 0 {
			if id, n := m.match(s, i, all); n > 0 {
				if start < i && !yield(s[start:i], -1) {
					return
				}
				if !yield("", id) {
					return
				}
				i += n
				start = i
				continue
			}
		}
		i++
	}
	if start < len(s) {
		yield(s[start:], -1)
	}
}
