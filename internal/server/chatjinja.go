package server

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/chattemplate"
	"github.com/pdkit/pdkit/engine/tokenizer"
)

// ChatJinja is the Name of the template rendered from the model's own
// tokenizer.chat_template.
const ChatJinja = "jinja"

// PickChatTemplate returns the template chat requests are rendered with for
// a model whose GGUF carries the Jinja chat template src (tokenizer.
// chat_template) and whose tokenizer is tok: src itself, rendered by
// engine/chattemplate in sb's worker processes under its bounds, when it
// compiles and renders the test conversations (chattemplate.Template.Check).
// A template that does not, or passes a bound doing it, is logged as a
// warning, with the reason, and the recognised family's template takes its
// place (DetectChatTemplate: the default template when no family is
// recognised). Without src the default template is used. maxOutput bounds
// a render's output (the most text a prompt that fits can have).
func PickChatTemplate(src string, tok tokenizer.Tokenizer, sb *chattemplate.Sandbox, maxOutput int, log *slog.Logger) ChatTemplate {
	if src == "" {
		return DefaultChatTemplate()
	}
	t, err := NewJinjaChatTemplate(src, tok, sb, maxOutput)
	if err == nil {
		return t
	}
	fallback := DetectChatTemplate(src)
	log.Warn("chat template: the model's tokenizer.chat_template cannot be rendered; chat requests use the "+
		fallback.Name()+" template instead, which may not be the format the model was trained on",
		"err", err, "fallback", fallback.Name())
	return fallback
}

// NewJinjaChatTemplate compiles the Jinja chat template src for a model
// whose tokenizer is tok, in sb (nil: chattemplate.Shared), and checks that
// it renders the test conversations. bos_token and eos_token are the
// spellings of tok's BOS and EOS.
func NewJinjaChatTemplate(src string, tok tokenizer.Tokenizer, sb *chattemplate.Sandbox, maxOutput int) (ChatTemplate, error) {
	if sb == nil {
		sb = chattemplate.Shared()
	}
	text := func(id int32) string {
		if tt, ok := tok.(interface{ TokenText(int32) string }); ok && id >= 0 {
			return tt.TokenText(id)
		}
		return ""
	}
	// Compiling and the test renders are bounded by the sandbox, each
	// render by its time bound; this bounds the waits for a worker too.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Duration(len(chattemplate.Probes)+1)*sb.Bounds().Time)
	defer cancel()
	t, err := sb.Compile(ctx, src, chattemplate.Options{BOS: text(tok.BOS()), EOS: text(tok.EOS()), MaxOutput: maxOutput})
	if err != nil {
		return nil, err
	}
	if err := t.Check(ctx); err != nil {
		return nil, err
	}
	return &jinjaTemplate{t: t, src: src, specials: newSpecials(tok)}, nil
}

// jinjaTemplate is a model's Jinja chat template.
type jinjaTemplate struct {
	t        *chattemplate.Sandboxed
	src      string
	specials *specials
}

func (j *jinjaTemplate) Name() string { return ChatJinja }

// Render renders msgs with the generation prompt, bounded by the
// sandbox's time bound. A conversation the template refuses (its
// raise_exception) is a *chattemplate.RaiseError, one that passes a
// bound a *chattemplate.BoundError; another failure is a *TemplateError.
func (j *jinjaTemplate) Render(msgs []openai.Message) (string, error) {
	return j.render(context.Background(), toTemplate(msgs))
}

func (j *jinjaTemplate) render(ctx context.Context, msgs []chattemplate.Message) (string, error) {
	s, err := j.t.Render(ctx, msgs, true)
	if err != nil {
		_, raised := errors.AsType[*chattemplate.RaiseError](err)
		_, bound := errors.AsType[*chattemplate.BoundError](err)
		if raised || bound || ctx.Err() != nil {
			return "", err
		}
		return "", &TemplateError{Err: err}
	}
	return s, nil
}

// TemplateError is a chat template that failed to render a conversation
// for a reason of its own, not the conversation's: the server answers 500.
type TemplateError struct{ Err error }

func (e *TemplateError) Error() string { return "rendering the chat template: " + e.Err.Error() }
func (e *TemplateError) Unwrap() error { return e.Err }

// chatError is the answer to a chat request whose prompt could not be made:
// a template's failure is the server's (500, logged to log), anything else (a role the
// template refuses, its raise_exception, a render past one of the
// template's bounds, text the tokenizer cannot encode) the request's
// (400, param messages).
func chatError(log *slog.Logger, err error) *openai.Error {
	if _, ok := errors.AsType[*TemplateError](err); ok {
		log.Error("chat request: the chat template failed", "err", err)
		return openai.ServerError(err.Error())
	}
	if be, ok := errors.AsType[*chattemplate.BoundError](err); ok {
		log.Warn("chat request: the chat template passed a bound on this conversation", "bound", be.Bound, "limit", be.Limit)
		return openai.InvalidRequest("messages", be.Error()+" on this conversation")
	}
	if re, ok := errors.AsType[*chattemplate.RaiseError](err); ok {
		return openai.InvalidRequest("messages", "the model's chat template refuses the conversation: "+re.Message)
	}
	return openai.InvalidRequest("messages", err.Error())
}

func toTemplate(msgs []openai.Message) []chattemplate.Message {
	out := make([]chattemplate.Message, len(msgs))
	for i, m := range msgs {
		out[i] = chattemplate.Message{Role: m.Role, Content: m.Content.String(), Name: m.Name, ToolCallID: m.ToolCallID}
	}
	return out
}

// encode renders msgs and tokenizes the prompt as tokenizing it with the
// control tokens recognised does, except that a control token's spelling
// inside a message stays text: before rendering, each such spelling is
// replaced by a private-use character that neither the template nor the
// conversation contains, and the character is encoded as the spelling's
// text. The tokenizer's BOS is put first when the vocabulary asks for one
// (add_bos_token) and the template did not write it, never twice.
func (j *jinjaTemplate) encode(ctx context.Context, t tokenizer.Tokenizer, msgs []openai.Message) ([]int32, error) {
	tm := toTemplate(msgs)
	masks, err := j.mask(tm)
	if err != nil {
		return nil, err
	}
	text, err := j.render(ctx, tm)
	if err != nil {
		return nil, err
	}
	enc := textRun{t: t}
	for i := 0; i < len(text); {
		if r, n := utf8.DecodeRuneInString(text[i:]); n > 1 {
			if s, ok := masks[r]; ok {
				enc.text(s)
				i += n
				continue
			}
		}
		if id, n := j.specials.match(text, i); n > 0 {
			if err := enc.token(id); err != nil {
				return nil, err
			}
			i += n
			continue
		}
		enc.text(text[i : i+1])
		i++
	}
	out, err := enc.end()
	if err != nil {
		return nil, err
	}
	if bos, _ := t.Encode("", true); len(bos) == 1 && (len(out) == 0 || out[0] != bos[0]) {
		out = append(bos, out...)
	}
	return out, nil
}

// mask replaces, in place, every control token's spelling in the text of
// msgs with a private-use character of its own, and returns the spelling
// of each character used.
func (j *jinjaTemplate) mask(msgs []chattemplate.Message) (map[rune]string, error) {
	var masks map[rune]string
	var byText map[string]rune
	next := rune(0xF0000) // Supplementary Private Use Area-A
	maskOne := func(s string) (string, error) {
		if !j.specials.in(s) {
			return s, nil
		}
		if masks == nil {
			masks, byText = map[rune]string{}, map[string]rune{}
		}
		var b strings.Builder
		for i := 0; i < len(s); {
			_, n := j.specials.match(s, i)
			if n == 0 {
				b.WriteByte(s[i])
				i++
				continue
			}
			sp := s[i : i+n]
			r, ok := byText[sp]
			if !ok {
				for ; next <= 0xFFFFD && j.uses(msgs, string(next)); next++ {
				}
				if next > 0xFFFFD {
					return "", errors.New("messages: too many distinct control tokens spelled in the conversation")
				}
				r = next
				next++
				masks[r], byText[sp] = sp, r
			}
			b.WriteRune(r)
			i += n
		}
		return b.String(), nil
	}
	for i := range msgs {
		m := &msgs[i]
		for _, f := range []*string{&m.Content, &m.Name, &m.ToolCallID} {
			s, err := maskOne(*f)
			if err != nil {
				return nil, err
			}
			*f = s
		}
	}
	return masks, nil
}

// uses reports whether the template or the conversation contains s.
func (j *jinjaTemplate) uses(msgs []chattemplate.Message, s string) bool {
	if strings.Contains(j.src, s) {
		return true
	}
	for _, m := range msgs {
		if strings.Contains(m.Role, s) || strings.Contains(m.Content, s) || strings.Contains(m.Name, s) || strings.Contains(m.ToolCallID, s) {
			return true
		}
	}
	return false
}

// specials are the spellings of a vocabulary's control and unknown tokens:
// those that tokenizing with control tokens recognised turns into one token
// and plain Encode does not (user-defined tokens, which Encode finds
// itself, are not among them).
type specials struct {
	byFirst map[byte][]special // longest first
}

type special struct {
	text string
	id   int32
}

func newSpecials(t tokenizer.Tokenizer) *specials {
	s := &specials{byFirst: map[byte][]special{}}
	se, ok := t.(tokenizer.SpecialEncoder)
	tt, ok2 := t.(interface{ TokenText(int32) string })
	if !ok || !ok2 {
		return s
	}
	for id := int32(0); int(id) < t.VocabSize(); id++ {
		if p := t.Piece(id); p != "" && p != "\uFFFD" { // only control, unused and unknown tokens print so
			continue
		}
		text := tt.TokenText(id)
		if text == "" {
			continue
		}
		if ids, err := se.EncodeWithSpecials(text); err != nil || len(ids) != 1 || ids[0] != id {
			continue
		}
		if ids, err := t.Encode(text, false); err == nil && len(ids) == 1 && ids[0] == id {
			continue
		}
		s.byFirst[text[0]] = append(s.byFirst[text[0]], special{text, id})
	}
	// The template's bos_token and eos_token are the BOS and EOS whatever
	// their type.
	for _, id := range []int32{t.BOS(), t.EOS()} {
		if text := tt.TokenText(id); id >= 0 && text != "" {
			if _, n := s.match(text, 0); n != len(text) {
				s.byFirst[text[0]] = append(s.byFirst[text[0]], special{text, id})
			}
		}
	}
	for _, l := range s.byFirst {
		slices.SortStableFunc(l, func(a, b special) int { return len(b.text) - len(a.text) })
	}
	return s
}

// match returns the longest special spelled at text[i:] and its length, or
// (-1, 0).
func (s *specials) match(text string, i int) (int32, int) {
	for _, sp := range s.byFirst[text[i]] {
		if strings.HasPrefix(text[i:], sp.text) {
			return sp.id, len(sp.text)
		}
	}
	return -1, 0
}

// in reports whether text spells any special.
func (s *specials) in(text string) bool {
	for i := 0; i < len(text); i++ {
		if _, n := s.match(text, i); n > 0 {
			return true
		}
	}
	return false
}
