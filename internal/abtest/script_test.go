package abtest

import (
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/openai"
)

// Size shapes the built-in script from the pools: make run's cluster (the
// small model: 16384 device tokens, a host tier of twice that, 2048 of
// context) and the tests' tiny one; the histories overflow the device pool
// and fit the host tier, and the longest prompt fits the context with its
// generated tokens.
func TestSize(t *testing.T) {
	tests := []struct {
		name     string
		pool     Pool
		sessions int
		want     Plan
	}{
		{
			name:     "make run",
			pool:     Pool{DeviceTokens: 16384, HostTokens: 32768, PageSize: 16, ContextTokens: 2048},
			sessions: 60,
			want:     Plan{Sessions: 60, Requests: 720, Turns: 6, MaxTokens: 8, System: 256, PerTurn: 116, MaxPrompt: 1300, WorkingSet: 24616},
		},
		{
			name:     "tiny",
			pool:     Pool{DeviceTokens: 256, HostTokens: 1024, PageSize: 4, ContextTokens: 512},
			sessions: 8,
			want:     Plan{Sessions: 8, Requests: 96, Turns: 6, MaxTokens: 8, System: 28, PerTurn: 10, MaxPrompt: 118, WorkingSet: 308},
		},
		{
			// A host tier smaller than the device pool: the histories still
			// overflow the device pool.
			name:     "small host tier",
			pool:     Pool{DeviceTokens: 1000, HostTokens: 500, PageSize: 10, ContextTokens: 4096},
			sessions: 10,
			want:     Plan{Sessions: 10, Requests: 120, Turns: 6, MaxTokens: 8, System: 120, PerTurn: 31, MaxPrompt: 399, WorkingSet: 1205},
		},
		{
			// Few sessions, a short context: the turns are as long as the
			// context allows, and the histories fit the device pool.
			name:     "capped by the context",
			pool:     Pool{DeviceTokens: 100000, PageSize: 16, ContextTokens: 512},
			sessions: 2,
			want:     Plan{Sessions: 2, Requests: 24, Turns: 6, MaxTokens: 8, System: 112, PerTurn: 43, MaxPrompt: 499, WorkingSet: 413},
		},
	}
	for _, tc := range tests {
		p, err := Size(tc.pool, tc.sessions, 0, 0, 8)
		tc.want.Pool = tc.pool
		if err != nil || p != tc.want {
			t.Errorf("%s: Size = %+v, %v\nwant %+v", tc.name, p, err, tc.want)
			continue
		}
		if p.MaxPrompt+p.MaxTokens > tc.pool.ContextTokens {
			t.Errorf("%s: the longest prompt %d and %d tokens exceed the context %d", tc.name, p.MaxPrompt, p.MaxTokens, tc.pool.ContextTokens)
		}
		if spills := tc.name != "capped by the context"; p.Spills() != spills {
			t.Errorf("%s: Spills %v, want %v", tc.name, p.Spills(), spills)
		}
	}
	for _, bad := range []struct {
		pool              Pool
		sessions, maxToks int
		err               string
	}{
		{Pool{DeviceTokens: 256, PageSize: 4, ContextTokens: 512}, 0, 8, "0 sessions"},
		{Pool{DeviceTokens: 256, PageSize: 4, ContextTokens: 512}, 4, 0, "0 tokens to generate"},
		{Pool{PageSize: 4, ContextTokens: 512}, 4, 8, "report no KV pool"},
		{Pool{DeviceTokens: 64, PageSize: 4, ContextTokens: 512}, 4, 8, "does not fit the context"},
	} {
		if _, err := Size(bad.pool, bad.sessions, 0, 0, bad.maxToks); err == nil || !strings.Contains(err.Error(), bad.err) {
			t.Errorf("Size(%+v, %d sessions, %d tokens) = %v, want an error with %q", bad.pool, bad.sessions, bad.maxToks, err, bad.err)
		}
	}
}

// Generate writes Requests prompts in conversations of Turns/2 to
// Turns×3/2 turns, all starting with the same System tokens; each turn's
// prompt extends the previous one by PerTurn tokens (the first by a
// message alone), never past MaxPrompt, with ids in [TokenLo, TokenHi);
// the same seed writes the same script.
func TestGenerate(t *testing.T) {
	p, err := Size(Pool{DeviceTokens: 256, HostTokens: 1024, PageSize: 4, ContextTokens: 512}, 8, 50, 4, 4)
	if err != nil {
		t.Fatal(err)
	}
	s := Generate(p, 7)
	if s.Requests() != 50 {
		t.Fatalf("%d requests, want 50", s.Requests())
	}
	sys := s.Convs[0][0].Tokens[:p.System]
	for ci, conv := range s.Convs {
		if len(conv) < 2 || len(conv) > 6 && ci < len(s.Convs)-1 {
			t.Errorf("conversation %d: %d turns, want 2 to 6", ci, len(conv))
		}
		var prev []int
		for ti, pr := range conv {
			tok := pr.Tokens
			switch {
			case pr.Text != "" || len(tok) > p.MaxPrompt:
				t.Errorf("conversation %d turn %d: %q, %d tokens (max %d)", ci, ti, pr.Text, len(tok), p.MaxPrompt)
			case !slices.Equal(tok[:p.System], sys):
				t.Errorf("conversation %d turn %d does not start with the shared prefix", ci, ti)
			case ti > 0 && (!slices.Equal(tok[:len(prev)], prev) || len(tok) != len(prev)+p.PerTurn):
				t.Errorf("conversation %d turn %d: %d tokens, does not extend the previous turn (%d) by %d", ci, ti, len(tok), len(prev), p.PerTurn)
			}
			for _, id := range tok {
				if id < TokenLo || id >= TokenHi {
					t.Fatalf("conversation %d turn %d: token %d", ci, ti, id)
				}
			}
			prev = tok
		}
	}
	if again := Generate(p, 7); !slices.EqualFunc(again.Convs, s.Convs, func(a, b []openai.Prompt) bool {
		return slices.EqualFunc(a, b, func(x, y openai.Prompt) bool { return slices.Equal(x.Tokens, y.Tokens) })
	}) {
		t.Error("the same seed wrote another script")
	}
	if lo, hi, mean, ok := s.Lengths(); !ok || lo < p.System || hi > p.MaxPrompt || mean < lo || mean > hi {
		t.Errorf("Lengths = %d, %d, %d, %v", lo, hi, mean, ok)
	}
}

func TestReadPrompts(t *testing.T) {
	in := `["system: be brief. user: hi", "system: be brief. user: hi assistant: hello user: bye"]

[[20, 21, 22], [20, 21, 22, 23, 24]]
"one prompt alone"
[30, 31, 32]
`
	s, err := ReadPrompts(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := [][]openai.Prompt{
		{{Text: "system: be brief. user: hi"}, {Text: "system: be brief. user: hi assistant: hello user: bye"}},
		{{Tokens: []int{20, 21, 22}}, {Tokens: []int{20, 21, 22, 23, 24}}},
		{{Text: "one prompt alone"}},
		{{Tokens: []int{30, 31, 32}}},
	}
	eq := func(a, b []openai.Prompt) bool {
		return slices.EqualFunc(a, b, func(x, y openai.Prompt) bool { return x.Text == y.Text && slices.Equal(x.Tokens, y.Tokens) })
	}
	if !slices.EqualFunc(s.Convs, want, eq) {
		t.Errorf("ReadPrompts = %+v\nwant %+v", s.Convs, want)
	}
	if s.Requests() != 6 || s.MaxTurns() != 2 {
		t.Errorf("%d requests, %d turns at most", s.Requests(), s.MaxTurns())
	}
	if _, _, _, ok := s.Lengths(); ok {
		t.Error("Lengths ok with text prompts")
	}
	for _, bad := range []struct{ in, err string }{
		{"", "no prompts"},
		{"\n\n", "no prompts"},
		{"{\"prompt\": 1}", "line 1: want a JSON array"},
		{"[]", "line 1: an empty conversation"},
		{"\"a\"\n[\"\"]", "line 2: turn 1: an empty prompt"},
		{"[[1, -2]]", "line 1: turn 1: token -2 at 1"},
		{"[\"a\", 3]", "line 1: turn 2: a prompt is a string or an array of token ids"},
		{"[1, 2", "line 1: want a JSON array"},
	} {
		if _, err := ReadPrompts(strings.NewReader(bad.in)); err == nil || !strings.Contains(err.Error(), bad.err) {
			t.Errorf("ReadPrompts(%q) = %v, want an error with %q", bad.in, err, bad.err)
		}
	}
}
