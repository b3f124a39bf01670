package tokenizer

import (
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestBuiltinVocabLayout(t *testing.T) {
	for _, size := range []int{MinBuiltinSize, 512, 32000} {
		v, err := BuiltinVocab(size)
		if err != nil {
			t.Fatal(err)
		}
		if len(v.Tokens) != size || len(v.Scores) != size || len(v.Types) != size {
			t.Fatalf("size %d: got %d tokens, %d scores, %d types", size, len(v.Tokens), len(v.Scores), len(v.Types))
		}
		if v.Model != "llama" || v.UNK != 0 || v.BOS != 1 || v.EOS != 2 || v.PAD != -1 || !v.AddBOS || !v.AddSpacePrefix {
			t.Errorf("size %d: header fields %+v", size, Vocab{Model: v.Model, BOS: v.BOS, EOS: v.EOS, UNK: v.UNK, PAD: v.PAD})
		}
		want := []struct {
			s   string
			typ int32
		}{{"<unk>", TypeUnknown}, {"<s>", TypeControl}, {"</s>", TypeControl}}
		for id, w := range want {
			if v.Tokens[id] != w.s || v.Types[id] != w.typ {
				t.Errorf("token %d = %q type %d", id, v.Tokens[id], v.Types[id])
			}
		}
		for c := range 256 {
			id := 3 + c
			if v.Tokens[id] != byteTokenText(byte(c)) || v.Types[id] != TypeByte {
				t.Errorf("token %d = %q type %d, want byte %02X", id, v.Tokens[id], v.Types[id], c)
			}
		}
		if v.Tokens[3+0x0A] != "<0x0A>" {
			t.Errorf("byte tokens must be uppercase hex: %q", v.Tokens[3+0x0A])
		}
		if v.Tokens[builtinFixed] != "▁" {
			t.Errorf("first normal piece = %q, want ▁", v.Tokens[builtinFixed])
		}
		for id := builtinFixed; id < size; id++ {
			if v.Types[id] != TypeNormal {
				t.Fatalf("token %d (%q) has type %d", id, v.Tokens[id], v.Types[id])
			}
			if id > builtinFixed && !(v.Scores[id] < v.Scores[id-1]) {
				t.Fatalf("scores not strictly decreasing at %d", id)
			}
			p := v.Tokens[id]
			if p == "" || !utf8.ValidString(p) || strings.Contains(strings.TrimLeft(p, "▁"), "▁") {
				t.Fatalf("bad piece %d %q", id, p)
			}
		}
	}
}

func TestBuiltinVocabCoversASCII(t *testing.T) {
	tk := builtinTokenizer(t, 512)
	for c := byte('!'); c <= '~'; c++ {
		if _, ok := tk.TokenID(string(c)); !ok {
			t.Errorf("BuiltinVocab(512) lacks %q", c)
		}
	}
	// Chat-template style text: control tokens only with EncodeWithSpecials.
	got, err := tk.EncodeWithSpecials("<s>hi</s>")
	if err != nil || got[0] != 1 || got[len(got)-1] != 2 {
		t.Errorf("EncodeWithSpecials = %v, %v", got, err)
	}
}

func TestBuiltinVocabDeterministic(t *testing.T) {
	a, _ := BuiltinVocab(32000)
	b, _ := BuiltinVocab(32000)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("BuiltinVocab(32000) differs between calls")
	}
	small, _ := BuiltinVocab(512)
	if !reflect.DeepEqual(small.Tokens, a.Tokens[:512]) || !reflect.DeepEqual(small.Scores, a.Scores[:512]) {
		t.Error("BuiltinVocab(512) is not a prefix of BuiltinVocab(32000)")
	}
}

func TestBuiltinVocabDistinct(t *testing.T) {
	v, _ := BuiltinVocab(32000)
	seen := make(map[string]int, len(v.Tokens))
	for id, s := range v.Tokens {
		if prev, dup := seen[s]; dup {
			t.Fatalf("token %q at %d and %d", s, prev, id)
		}
		seen[s] = id
	}
}

// TestBuiltinVocabReachable checks what SentencePiece BPE (and llama.cpp)
// need to ever produce a piece: it is the concatenation of two tokens, and
// merging its own text ends in exactly that piece.
func TestBuiltinVocabReachable(t *testing.T) {
	for _, size := range []int{512, 32000} {
		v, _ := BuiltinVocab(size)
		index := make(map[string]bool, size)
		for id := builtinFixed; id < size; id++ {
			index[v.Tokens[id]] = true
		}
		v.AddSpacePrefix = false
		tk := mustNew(t, v)
		for id := builtinFixed; id < size; id++ {
			p := v.Tokens[id]
			if utf8.RuneCountInString(p) > 1 {
				found := false
				for k := range p {
					if k > 0 && index[p[:k]] && index[p[k:]] {
						found = true
						break
					}
				}
				if !found {
					t.Errorf("size %d: piece %q is not the concatenation of two pieces", size, p)
				}
			}
			text := strings.ReplaceAll(p, "▁", " ")
			if got := mustEncode(t, tk, text, false); len(got) != 1 || got[0] != int32(id) {
				t.Errorf("size %d: Encode(%q) = %v, want [%d]", size, text, got, id)
			}
		}
	}
}

func TestBuiltinVocabSizes(t *testing.T) {
	for _, size := range []int{-1, 0, 258, MinBuiltinSize - 1, MaxBuiltinSize + 1} {
		if _, err := BuiltinVocab(size); err == nil {
			t.Errorf("BuiltinVocab(%d) succeeded", size)
		}
	}
	sizes := []int{MinBuiltinSize, 1000, 4096, 50000}
	if !testing.Short() {
		sizes = append(sizes, MaxBuiltinSize)
	}
	for _, size := range sizes {
		v, err := BuiltinVocab(size)
		if err != nil {
			t.Fatalf("BuiltinVocab(%d): %v", size, err)
		}
		if len(v.Tokens) != size {
			t.Fatalf("BuiltinVocab(%d) has %d tokens", size, len(v.Tokens))
		}
		if _, err := New(v); err != nil {
			t.Fatalf("New(BuiltinVocab(%d)): %v", size, err)
		}
	}
}
