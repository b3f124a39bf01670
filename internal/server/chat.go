package server

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/tokenizer"
)

// ChatTemplate turns the messages of a chat request into a prompt: the
// model's own Jinja template (NewJinjaChatTemplate), or one of this
// package's families, picked by DetectChatTemplate when the model's cannot
// be rendered; see the package doc for the exact format of each.
type ChatTemplate interface {
	// Name is "jinja" for the model's own template, else the family:
	// "default", "chatml", "llama3", "llama2", "mistral", "zephyr" or
	// "gemma".
	Name() string
	// Render returns the prompt text, the generation prompt for the
	// assistant included. It holds the BOS token's spelling only when the
	// template writes the BOS itself; otherwise the tokenizer adds it. A
	// role the template does not know is an error.
	Render(msgs []openai.Message) (string, error)
}

// Names of the chat template families.
const (
	ChatDefault = "default"
	ChatML      = "chatml"
	ChatLlama3  = "llama3"
	ChatLlama2  = "llama2"
	ChatMistral = "mistral"
	ChatZephyr  = "zephyr"
	ChatGemma   = "gemma"
)

// DetectChatTemplate picks the template family of a GGUF chat template
// (tokenizer.chat_template) from markers in its Jinja text, without
// interpreting the Jinja: the fallback of PickChatTemplate for a template
// that cannot be rendered. Checked in this order:
//
//	"<|start_header_id|>" and "<|eot_id|>"        → llama3
//	"<|im_start|>" and "<|im_end|>"               → chatml
//	"<start_of_turn>"                             → gemma
//	"[INST]" and "<<SYS>>"                        → llama2
//	"[INST]"                                      → mistral
//	"<|user|>", "<|assistant|>" and "</s>" or
//	eos_token, without "<|end|>" (Phi-3's turns)  → zephyr
//
// Anything else, the empty string included, gets the default template.
func DetectChatTemplate(jinja string) ChatTemplate {
	has := func(subs ...string) bool {
		for _, s := range subs {
			if !strings.Contains(jinja, s) {
				return false
			}
		}
		return true
	}
	switch {
	case has("<|start_header_id|>", "<|eot_id|>"):
		return chatTemplates[ChatLlama3]
	case has("<|im_start|>", "<|im_end|>"):
		return chatTemplates[ChatML]
	case has("<start_of_turn>"):
		return chatTemplates[ChatGemma]
	case has("[INST]", "<<SYS>>"):
		return chatTemplates[ChatLlama2]
	case has("[INST]"):
		return chatTemplates[ChatMistral]
	case has("<|user|>", "<|assistant|>") && (has("</s>") || has("eos_token")) && !has("<|end|>"):
		return chatTemplates[ChatZephyr]
	}
	return chatTemplates[ChatDefault]
}

// ChatTemplate is the template the server renders chat requests with,
// picked by New from the model's tokenizer.chat_template (PickChatTemplate).
func (s *Server) ChatTemplate() ChatTemplate { return s.tmpl }

// DefaultChatTemplate is the template of models whose chat template is
// missing or not recognised.
func DefaultChatTemplate() ChatTemplate { return chatTemplates[ChatDefault] }

// EncodeChat renders msgs with tmpl (nil: the default template) and
// tokenizes the prompt.
//
// Message content is encoded as plain text, so a message that spells a
// control token ("<|im_end|>", "</s>") cannot inject it. The control tokens
// the template itself writes become their token ids when the tokenizer is a
// tokenizer.SpecialEncoder and the vocabulary has them as control tokens;
// otherwise they are plain text too. The result equals tokenizing the
// rendered prompt with the control tokens recognised (as llama.cpp does),
// except inside message content. The BOS comes either from the template
// (the tokenizer's BOS id, whatever its spelling) or from the tokenizer
// (Encode with addSpecial, so only when the vocabulary asks for it), never
// both.
//
// The model's Jinja template keeps message content as text the same way;
// see jinjaTemplate.encode. Any other template is rendered and encoded with
// Encode(text, true).
func EncodeChat(t tokenizer.Tokenizer, tmpl ChatTemplate, msgs []openai.Message) ([]int32, error) {
	return encodeChat(context.Background(), t, tmpl, msgs)
}

// encodeChat is EncodeChat for a request: a render of the model's own
// template ends with ctx.
func encodeChat(ctx context.Context, t tokenizer.Tokenizer, tmpl ChatTemplate, msgs []openai.Message) ([]int32, error) {
	if tmpl == nil {
		tmpl = DefaultChatTemplate()
	}
	if jt, ok := tmpl.(*jinjaTemplate); ok {
		return jt.encode(ctx, t, msgs)
	}
	ct, ok := tmpl.(*chatTemplate)
	if !ok {
		text, err := tmpl.Render(msgs)
		if err != nil {
			return nil, err
		}
		return t.Encode(text, true)
	}
	parts, err := ct.parts(msgs)
	if err != nil {
		return nil, err
	}
	enc := textRun{t: t}
	if ct.tokenizerBOS {
		if enc.out, err = t.Encode("", true); err != nil {
			return nil, err
		}
	}
	se, _ := t.(tokenizer.SpecialEncoder)
	for _, p := range parts {
		switch p.kind {
		case partText:
			enc.text(p.text)
		case partBOS:
			if t.BOS() < 0 {
				continue
			}
			if err := enc.token(t.BOS()); err != nil {
				return nil, err
			}
		case partSpecial:
			id := controlToken(t, se, p.text)
			if id < 0 {
				enc.text(p.text)
				continue
			}
			if err := enc.token(id); err != nil {
				return nil, err
			}
		}
	}
	return enc.end()
}

// textRun encodes a chat prompt: plain text between control tokens is
// gathered and encoded as one run (the tokenizer sees whole words, never
// pieces cut at a control token), control tokens go in by id.
type textRun struct {
	t   tokenizer.Tokenizer
	buf strings.Builder
	out []int32
}

func (r *textRun) text(s string) { r.buf.WriteString(s) }

// token ends the text run and appends the control token id.
func (r *textRun) token(id int32) error {
	if err := r.flush(); err != nil {
		return err
	}
	r.out = append(r.out, id)
	return nil
}

func (r *textRun) flush() error {
	if r.buf.Len() == 0 {
		return nil
	}
	ids, err := r.t.Encode(r.buf.String(), false)
	r.buf.Reset()
	r.out = append(r.out, ids...)
	return err
}

// end encodes the last run and returns the tokens.
func (r *textRun) end() ([]int32, error) {
	if err := r.flush(); err != nil {
		return nil, err
	}
	return r.out, nil
}

// controlToken returns the id of the control token spelled s, or -1 when
// the vocabulary has none (or only a user-defined or ordinary token, which
// plain encoding finds by itself).
func controlToken(t tokenizer.Tokenizer, se tokenizer.SpecialEncoder, s string) int32 {
	if se == nil {
		return -1
	}
	ids, err := se.EncodeWithSpecials(s)
	if err != nil || len(ids) != 1 || t.Piece(ids[0]) != "" {
		return -1
	}
	return ids[0]
}

type partKind uint8

const (
	partText    partKind = iota // template text or message content
	partSpecial                 // a control token's spelling written by the template
	partBOS                     // the BOS token, written by the template
)

// chatPart is one piece of a rendered prompt.
type chatPart struct {
	kind partKind
	text string
}

// chatTemplate is one family's format.
type chatTemplate struct {
	name string
	// tokenizerBOS: the template writes no BOS; EncodeChat lets the
	// tokenizer add it (when the vocabulary asks for it).
	tokenizerBOS bool
	// roles the template accepts.
	roles []string
	build func(b *promptBuilder, msgs []openai.Message)
}

func (c *chatTemplate) Name() string { return c.name }

func (c *chatTemplate) Render(msgs []openai.Message) (string, error) {
	parts, err := c.parts(msgs)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(p.text)
	}
	return b.String(), nil
}

func (c *chatTemplate) parts(msgs []openai.Message) ([]chatPart, error) {
	for i, m := range msgs {
		if !slices.Contains(c.roles, m.Role) {
			return nil, fmt.Errorf("messages[%d]: role %q is not supported by the %s chat template (it takes %s)",
				i, m.Role, c.name, strings.Join(c.roles, ", "))
		}
	}
	b := &promptBuilder{}
	c.build(b, msgs)
	return b.parts, nil
}

type promptBuilder struct{ parts []chatPart }

func (b *promptBuilder) text(s ...string) {
	for _, x := range s {
		if x != "" {
			b.parts = append(b.parts, chatPart{partText, x})
		}
	}
}

func (b *promptBuilder) special(s string) { b.parts = append(b.parts, chatPart{partSpecial, s}) }
func (b *promptBuilder) bos(s string)     { b.parts = append(b.parts, chatPart{partBOS, s}) }

var (
	chatRoles    = []string{openai.RoleSystem, openai.RoleUser, openai.RoleAssistant}
	defaultRoles = []string{openai.RoleSystem, openai.RoleUser, openai.RoleAssistant, openai.RoleTool}
)

var chatTemplates = map[string]*chatTemplate{
	ChatDefault: {name: ChatDefault, tokenizerBOS: true, roles: defaultRoles, build: buildDefault},
	ChatML:      {name: ChatML, tokenizerBOS: true, roles: chatRoles, build: buildChatML},
	ChatLlama3:  {name: ChatLlama3, roles: chatRoles, build: buildLlama3},
	ChatLlama2:  {name: ChatLlama2, roles: chatRoles, build: buildLlama2},
	ChatMistral: {name: ChatMistral, roles: chatRoles, build: buildMistral},
	ChatZephyr:  {name: ChatZephyr, tokenizerBOS: true, roles: chatRoles, build: buildZephyr},
	ChatGemma:   {name: ChatGemma, roles: chatRoles, build: buildGemma},
}

func buildDefault(b *promptBuilder, msgs []openai.Message) {
	for _, m := range msgs {
		b.text("<|"+m.Role+"|>\n", m.Content.String(), "\n")
	}
	b.text("<|assistant|>\n")
}

func buildChatML(b *promptBuilder, msgs []openai.Message) {
	for _, m := range msgs {
		b.special("<|im_start|>")
		b.text(m.Role+"\n", m.Content.String())
		b.special("<|im_end|>")
		b.text("\n")
	}
	b.special("<|im_start|>")
	b.text("assistant\n")
}

func buildLlama3(b *promptBuilder, msgs []openai.Message) {
	header := func(role string) {
		b.special("<|start_header_id|>")
		b.text(role)
		b.special("<|end_header_id|>")
		b.text("\n\n")
	}
	b.bos("<|begin_of_text|>")
	for _, m := range msgs {
		header(m.Role)
		b.text(strings.TrimSpace(m.Content.String()))
		b.special("<|eot_id|>")
	}
	header(openai.RoleAssistant)
}

func buildZephyr(b *promptBuilder, msgs []openai.Message) {
	for _, m := range msgs {
		b.special("<|" + m.Role + "|>")
		b.text("\n", m.Content.String())
		b.special("</s>")
		b.text("\n")
	}
	b.special("<|assistant|>")
	b.text("\n")
}

func buildGemma(b *promptBuilder, msgs []openai.Message) {
	turn := func(role, content string) {
		b.special("<start_of_turn>")
		b.text(role+"\n", content)
		b.special("<end_of_turn>")
		b.text("\n")
	}
	b.bos("<bos>")
	foldSystem(msgs, foldPlain, func(role, content string) {
		if role == openai.RoleAssistant {
			role = "model"
		}
		turn(role, content)
	}, strings.TrimSpace)
	b.special("<start_of_turn>")
	b.text("model\n")
}

func buildLlama2(b *promptBuilder, msgs []openai.Message) {
	foldSystem(msgs, func(sys, content string) string {
		if sys == "" {
			return content
		}
		return "<<SYS>>\n" + sys + "\n<</SYS>>\n\n" + content
	}, func(role, content string) {
		if role == openai.RoleUser {
			b.bos("<s>")
			b.text("[INST] " + strings.TrimSpace(content) + " [/INST]")
			return
		}
		b.text(" " + content + " ")
		b.special("</s>")
	}, strings.TrimSpace)
}

func buildMistral(b *promptBuilder, msgs []openai.Message) {
	b.bos("<s>")
	foldSystem(msgs, foldPlain, func(role, content string) {
		if role == openai.RoleUser {
			b.text("[INST] " + content + " [/INST]")
			return
		}
		b.text(content)
		b.special("</s>")
	}, func(s string) string { return s })
}

// foldPlain puts the system prompt before the user's message, a blank
// line between.
func foldPlain(sys, content string) string {
	switch {
	case sys == "":
		return content
	case content == "":
		return sys
	}
	return sys + "\n\n" + content
}

// foldSystem calls turn for each user and assistant message with its
// content cleaned by clean. System messages (cleaned, several joined by a
// blank line) are folded into the next user message by fold; one that no
// user message follows becomes a user turn of its own.
func foldSystem(msgs []openai.Message, fold func(sys, content string) string,
	turn func(role, content string), clean func(string) string) {
	var sys []string
	flush := func() {
		if len(sys) > 0 {
			turn(openai.RoleUser, fold(strings.Join(sys, "\n\n"), ""))
			sys = nil
		}
	}
	for _, m := range msgs {
		c := clean(m.Content.String())
		switch m.Role {
		case openai.RoleSystem:
			sys = append(sys, c)
		case openai.RoleUser:
			turn(openai.RoleUser, fold(strings.Join(sys, "\n\n"), c))
			sys = nil
		default:
			flush()
			turn(m.Role, c)
		}
	}
	flush()
}
