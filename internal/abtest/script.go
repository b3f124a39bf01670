package abtest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"

	"github.com/pdkit/pdkit/api/openai"
)

// Script is a workload's prompts: conversations of turns, each turn's
// prompt complete (the history and the new message), sent as it is.
type Script struct {
	Convs [][]openai.Prompt // conversation → turn → prompt
}

// Requests is the number of prompts in s.
func (s Script) Requests() int {
	n := 0
	for _, c := range s.Convs {
		n += len(c)
	}
	return n
}

// MaxTurns is the turns of s's longest conversation.
func (s Script) MaxTurns() int {
	n := 0
	for _, c := range s.Convs {
		n = max(n, len(c))
	}
	return n
}

// Lengths are the shortest, longest and mean prompt in tokens; ok is false
// when a prompt is text (its length is the server's tokenizer's to say).
func (s Script) Lengths() (lo, hi, mean int, ok bool) {
	lo, n, sum := 1<<62, 0, 0
	for _, c := range s.Convs {
		for _, p := range c {
			if p.Tokens == nil {
				return 0, 0, 0, false
			}
			lo, hi = min(lo, len(p.Tokens)), max(hi, len(p.Tokens))
			sum += len(p.Tokens)
			n++
		}
	}
	if n == 0 {
		return 0, 0, 0, false
	}
	return lo, hi, sum / n, true
}

// The token ids of a built-in script: ids every vocabulary has (the
// built-in tiny model's has 512), above the ones tokenizers keep for
// control tokens.
const (
	TokenLo = 16
	TokenHi = 496
)

// Pool is what the servers report about the KV they cache prefixes in: the
// pools the workload must overflow.
type Pool struct {
	// DeviceTokens is a rank's device KV pool in tokens (the smallest of
	// the servers that cache prefixes).
	DeviceTokens int
	// HostTokens is a rank's host tier in tokens; 0 when not known.
	HostTokens int
	// PageSize is the KV page size in tokens.
	PageSize int
	// ContextTokens is the model's context length: a prompt and its
	// generated tokens together.
	ContextTokens int
}

// Plan is the shape of a built-in script, sized by Size.
type Plan struct {
	Sessions  int // conversations at once
	Requests  int // prompts in all
	Turns     int // a conversation's turns on average (from Turns/2 to Turns×3/2)
	MaxTokens int // greedy tokens per request
	// System is the shared prefix every conversation starts with.
	System int
	// PerTurn is the tokens a turn adds on average: a scripted reply and
	// a user message.
	PerTurn int
	// MaxPrompt is the longest prompt a conversation may reach.
	MaxPrompt int
	// WorkingSet is the tokens the sessions' histories hold halfway
	// through their conversations, the shared prefix once: what a rank's
	// prefix cache would need to keep them all.
	WorkingSet int
	Pool       Pool
}

// Spills says the sessions' histories do not fit the device pool, so they
// leave it between a session's turns.
func (p Plan) Spills() bool { return p.WorkingSet > p.Pool.DeviceTokens }

// FitsHost says the sessions' histories fit the host tier (true when its
// size is not known).
func (p Plan) FitsHost() bool { return p.Pool.HostTokens == 0 || p.WorkingSet <= p.Pool.HostTokens }

// minPerTurn is the fewest tokens a turn adds: a reply and a message of at
// least a token each, with room to vary.
const minPerTurn = 4

// Size shapes a built-in script for sessions concurrent conversations
// against pool: the sessions' histories, halfway through, about 1.5 times
// the device pool (at most 4/5 of the host tier when its size is known,
// and at least 6/5 of the device pool), so that a session's prefix has left
// the device by its next turn and comes back from host. requests ≤ 0 means
// two conversations per session; turns ≤ 0 means 6.
func Size(pool Pool, sessions, requests, turns, maxTokens int) (Plan, error) {
	if turns <= 0 {
		turns = 6
	}
	if requests <= 0 {
		requests = 2 * sessions * turns
	}
	p := Plan{Sessions: sessions, Requests: requests, Turns: turns, MaxTokens: maxTokens, Pool: pool}
	switch {
	case sessions < 1:
		return p, fmt.Errorf("%d sessions: want at least 1", sessions)
	case maxTokens < 1:
		return p, fmt.Errorf("%d tokens to generate: want at least 1", maxTokens)
	case pool.DeviceTokens <= 0 || pool.PageSize <= 0 || pool.ContextTokens <= 0:
		return p, fmt.Errorf("the servers report no KV pool to size a workload by (device %d tokens, page %d, context %d)",
			pool.DeviceTokens, pool.PageSize, pool.ContextTokens)
	}
	maxTurns := turns + turns/2
	// The longest prompt: within the context with its generated tokens,
	// and within half the device pool, so that it is admitted beside
	// others.
	limit := min(pool.ContextTokens, pool.DeviceTokens/2) - maxTokens
	page := pool.PageSize
	p.System = min(max(limit/4/page*page, page), 256)
	if p.System+maxTurns*minPerTurn > limit {
		p.System = limit - maxTurns*minPerTurn
	}
	if p.System < 1 {
		return p, fmt.Errorf("a prompt of %d turns of at least %d tokens and %d generated tokens does not fit the context (%d tokens) and half the device pool (%d tokens): lower --turns or --max-tokens",
			maxTurns, minPerTurn, maxTokens, pool.ContextTokens, pool.DeviceTokens)
	}
	target := pool.DeviceTokens * 3 / 2
	if pool.HostTokens > 0 {
		target = min(target, pool.HostTokens*4/5)
	}
	target = max(target, pool.DeviceTokens*6/5)
	// Halfway through, a conversation has (turns+1)/2 turns' worth of
	// history beyond the shared prefix.
	half := float64(turns+1) / 2
	p.PerTurn = int(float64(target-p.System)/(float64(sessions)*half) + 0.999)
	p.PerTurn = min(max(p.PerTurn, minPerTurn), (limit-p.System)/maxTurns)
	p.MaxPrompt = p.System + maxTurns*p.PerTurn
	p.WorkingSet = p.System + int(float64(sessions*p.PerTurn)*half)
	return p, nil
}

// Generate writes p's script from seed: every conversation starts with the
// same System tokens; each turn adds a scripted reply (after the first) and
// a user message, PerTurn tokens together; conversations have from
// Turns/2 to Turns×3/2 turns, so that the sessions do not move in step.
func Generate(p Plan, seed uint64) Script {
	rng := rand.New(rand.NewPCG(seed, 0))
	sys := randTokens(rng, p.System)
	maxTurns := p.Turns + p.Turns/2
	minTurns := max(1, p.Turns-p.Turns/2)
	var s Script
	for c, left := 0, p.Requests; left > 0; c++ {
		rng := rand.New(rand.NewPCG(seed, uint64(c)+1))
		turns := min(minTurns+rng.IntN(maxTurns-minTurns+1), left)
		prompt := slices.Clone(sys)
		conv := make([]openai.Prompt, 0, turns)
		for t := range turns {
			// A reply and a message of PerTurn tokens together, split
			// at random: the longest prompt stays within MaxPrompt.
			reply, msg := split(rng, p.PerTurn)
			if t > 0 {
				prompt = append(prompt, randTokens(rng, reply)...)
			}
			prompt = append(prompt, randTokens(rng, msg)...)
			conv = append(conv, openai.Prompt{Tokens: slices.Clone(prompt)})
		}
		s.Convs = append(s.Convs, conv)
		left -= turns
	}
	return s
}

// split divides a turn of n tokens (n ≥ minPerTurn) into a reply and a
// message of at least one token each, n in all, each about n/2 ± n/8.
func split(rng *rand.Rand, n int) (reply, msg int) {
	q := n / 4
	reply = n/2 - q/2 + rng.IntN(q+1)
	return max(reply, 1), max(n-reply, 1)
}

func randTokens(rng *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = TokenLo + rng.IntN(TokenHi-TokenLo)
	}
	return out
}

// MaxPromptsLine bounds one line of a prompts file.
const MaxPromptsLine = 16 << 20

// ReadPrompts reads a user's script: JSON Lines, one conversation per
// line, either an array of its turns' prompts or a single prompt (a
// one-turn conversation). A prompt is a string (text, which the server
// tokenizes) or an array of token ids. Each turn's prompt is sent as it is,
// so a multi-turn conversation repeats its history in every turn. Blank
// lines are skipped.
func ReadPrompts(r io.Reader) (Script, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var s Script
	for line := 1; ; line++ {
		b, err := readLine(br)
		if err != nil && !errors.Is(err, io.EOF) {
			return s, fmt.Errorf("line %d: %w", line, err)
		}
		if t := bytes.TrimSpace(b); len(t) > 0 {
			conv, perr := parseConversation(t)
			if perr != nil {
				return s, fmt.Errorf("line %d: %w", line, perr)
			}
			s.Convs = append(s.Convs, conv)
		}
		if errors.Is(err, io.EOF) {
			break
		}
	}
	if len(s.Convs) == 0 {
		return s, errors.New("no prompts: want one conversation per line, a JSON array of prompts (strings or arrays of token ids)")
	}
	return s, nil
}

// readLine reads one line of at most MaxPromptsLine bytes, without its
// newline; io.EOF with the last line.
func readLine(br *bufio.Reader) ([]byte, error) {
	var out []byte
	for {
		b, err := br.ReadSlice('\n')
		out = append(out, b...)
		if len(out) > MaxPromptsLine {
			return nil, fmt.Errorf("longer than %d bytes", MaxPromptsLine)
		}
		switch {
		case err == nil:
			return out[:len(out)-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		default:
			return out, err
		}
	}
}

// parseConversation reads one line of a prompts file.
func parseConversation(b []byte) ([]openai.Prompt, error) {
	const want = "want a JSON array of prompts, a string or an array of token ids"
	switch b[0] {
	case '"':
		p, err := parsePrompt(b)
		if err != nil {
			return nil, err
		}
		return []openai.Prompt{p}, nil
	case '[':
	default:
		return nil, errors.New(want)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(b, &items); err != nil {
		return nil, fmt.Errorf("%s: %v", want, err)
	}
	if len(items) == 0 {
		return nil, errors.New("an empty conversation: " + want)
	}
	if t := bytes.TrimSpace(items[0]); len(t) > 0 && t[0] != '"' && t[0] != '[' {
		// An array of numbers: one prompt of token ids.
		p, err := parsePrompt(b)
		if err != nil {
			return nil, err
		}
		return []openai.Prompt{p}, nil
	}
	conv := make([]openai.Prompt, len(items))
	for i, it := range items {
		p, err := parsePrompt(it)
		if err != nil {
			return nil, fmt.Errorf("turn %d: %w", i+1, err)
		}
		conv[i] = p
	}
	return conv, nil
}

// parsePrompt reads a prompt: a non-empty string or a non-empty array of
// non-negative token ids.
func parsePrompt(b []byte) (openai.Prompt, error) {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return openai.Prompt{}, err
		}
		if s == "" {
			return openai.Prompt{}, errors.New("an empty prompt")
		}
		return openai.Prompt{Text: s}, nil
	}
	var ids []int
	if err := json.Unmarshal(b, &ids); err != nil {
		return openai.Prompt{}, fmt.Errorf("a prompt is a string or an array of token ids: %v", err)
	}
	if len(ids) == 0 {
		return openai.Prompt{}, errors.New("an empty prompt")
	}
	for i, id := range ids {
		if id < 0 {
			return openai.Prompt{}, fmt.Errorf("token %d at %d: want a non-negative id", id, i)
		}
	}
	return openai.Prompt{Tokens: ids}, nil
}
