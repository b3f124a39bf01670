// Package chattemplate renders a model's chat template: the Jinja source a
// GGUF file carries as tokenizer.chat_template (the chat_template of Hugging
// Face's tokenizer_config.json), which turns a conversation into the prompt
// text the model was trained on.
//
// # The Jinja implementation
//
// Templates are compiled and rendered by github.com/ardanlabs/jinja, a pure
// Go Jinja engine written for exactly this job (no dependencies, no cgo;
// compiled templates are safe for concurrent use). It was chosen over the
// other Go implementations by rendering real chat templates of 24 model
// families (Llama 2 and 3, Mistral v0.1 and later, ChatML/Qwen 2 and 3,
// Gemma, Phi-3, Zephyr, DeepSeek, GLM, gpt-oss, Kimi, LFM, Nemotron, ...)
// with five conversations each and comparing every prompt with Python's
// Jinja2 set up as transformers' apply_chat_template sets it up:
//
//   - github.com/ardanlabs/jinja rendered all but one family exactly. It has
//     what chat templates use built in, as Hugging Face defines it:
//     trim_blocks and lstrip_blocks, loop.first/last/index0, namespace(),
//     raise_exception, strftime_now, tojson with Python's separators and
//     without ASCII escaping, Python string methods (strip, split,
//     startswith, ...), slicing, {% generation %}, macros.
//   - github.com/nikolalohinski/gonja/v2 (a general Jinja port) could not
//     parse a quarter of them (a parenthesised inline if, multi-line
//     expressions, {% generation %}), writes tojson without Python's spaces
//     and with \u003c escapes, fails "x".rstrip() without arguments, and
//     brings logrus and four more modules.
//   - github.com/noirbizarre/gonja, gonja's unmaintained ancestor, is not
//     served by the Go module proxy; github.com/flosch/pongo2 is Django's
//     template language, not Jinja (no namespace(), no Python methods, no
//     whitespace control as Jinja does it).
//
// The module is pinned to v1.8.0, its newest release that builds with Go
// 1.26 (later ones require Go 1.27). Two of its deviations from Jinja2 are
// corrected here, on the template source, before compiling:
//
//   - Its whitespace control reaches past an expression: in
//     "{% for m in ms %}{{ m }}\n{% endfor %}" the "\n" after the expression
//     is trimmed as if it followed the tag (Jinja2 keeps it), and a "-"
//     next to an expression trims the text on the expression's far side.
//     Compile puts an invisible separator (a Unicode noncharacter that the
//     source does not contain) between every two tags that touch, so the
//     trimming of each tag stops where Jinja2's does, and Render removes it
//     from the output. Inside the bodies of {% macro %}, {% call %},
//     {% filter %} and block {% set %}, whose output a template may use as
//     a value, no separator is put.
//   - Jinja2 drops a single newline at the end of the template
//     (keep_trailing_newline is off); Compile drops it too, and turns CRLF
//     line ends into LF as Jinja2 does.
//
// Known remaining differences: {{ none }} prints "" where Jinja2 prints
// "None", and the format filter is missing (a template using it fails to
// render, which Check reports).
//
// # Rendering
//
// Render passes what apply_chat_template passes: messages (each with role
// and content, and name and tool_call_id when set, in that order),
// add_generation_prompt, bos_token and eos_token, and the functions
// raise_exception and strftime_now (on Options.Now's clock). A template's
// raise_exception is returned as a *RaiseError: the template refuses the
// conversation (roles that do not alternate, a system message the model
// does not take). Any other failure is the template's or the engine's.
//
// Compile and Render run in the calling process with no bound; a server
// renders a model's template through a Sandbox instead (sandbox.go), in
// worker processes under bounds of time, memory, stack and output.
package chattemplate

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// Message is one message of a conversation, as the template sees it.
type Message struct {
	Role    string
	Content string
	// Name and ToolCallID are passed to the template only when set.
	Name       string
	ToolCallID string
}

// Options are the values a template is rendered with besides the
// conversation.
type Options struct {
	// BOS and EOS are the spellings of the vocabulary's BOS and EOS tokens
	// (bos_token and eos_token); "" when the vocabulary has none.
	BOS, EOS string
	// Now is strftime_now's clock; nil means time.Now.
	Now func() time.Time
	// MaxOutput bounds a sandboxed render's output in bytes (0: the
	// Sandbox's Bounds.Output).
	MaxOutput int
}

// Template is a compiled chat template. It is safe for concurrent use.
type Template struct {
	// fixed is compiled from the source with touching tags separated by
	// marker; plain from the source as it is, for the conversations that
	// contain the marker themselves. fixed is nil when no marker could be
	// picked.
	fixed, plain *jinja.Template
	marker       string
	opts         Options
}

// RaiseError is a template's own refusal: it called raise_exception.
type RaiseError struct {
	Message string
}

func (e *RaiseError) Error() string { return e.Message }

// Compile parses src. A syntax error, or a construct the engine does not
// know, fails here.
func Compile(src string, o Options) (*Template, error) {
	if o.Now == nil {
		o.Now = time.Now
	}
	src = strings.ReplaceAll(src, "\r\n", "\n")
	src = strings.TrimSuffix(src, "\n")
	plain, err := jinja.Compile(src)
	if err != nil {
		return nil, fmt.Errorf("chat template: %w", err)
	}
	t := &Template{plain: plain, opts: o}
	if m, ok := pickMarker(src); ok {
		if fixed, err := jinja.Compile(separateTags(src, m)); err == nil {
			t.fixed, t.marker = fixed, m
		}
	}
	return t, nil
}

// Render renders the conversation msgs; with addGenerationPrompt the
// template ends the prompt with the opening of the assistant's reply.
func (t *Template) Render(msgs []Message, addGenerationPrompt bool) (string, error) {
	tmpl := t.fixed
	if tmpl == nil || mentions(msgs, t.marker) || strings.Contains(t.opts.BOS+t.opts.EOS, t.marker) {
		tmpl = t.plain
	}
	list := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		d := jinja.NewDict()
		dict := d.AsDict()
		dict.Set("role", jinja.NewString(m.Role))
		dict.Set("content", jinja.NewString(m.Content))
		if m.Name != "" {
			dict.Set("name", jinja.NewString(m.Name))
		}
		if m.ToolCallID != "" {
			dict.Set("tool_call_id", jinja.NewString(m.ToolCallID))
		}
		list[i] = d
	}
	var raised *RaiseError
	data := map[string]jinja.Value{
		"messages":              jinja.NewList(list),
		"add_generation_prompt": jinja.NewBool(addGenerationPrompt),
		"bos_token":             jinja.NewString(t.opts.BOS),
		"eos_token":             jinja.NewString(t.opts.EOS),
		"raise_exception": jinja.NewCallable("raise_exception", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			msg := "raise_exception called without a message"
			if len(args) > 0 {
				if msg = args[0].String(); args[0].IsString() {
					msg = args[0].AsString()
				}
			}
			raised = &RaiseError{Message: msg}
			return jinja.Undefined(), raised
		}),
		"strftime_now": jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			if len(args) != 1 || !args[0].IsString() {
				return jinja.Undefined(), errors.New("strftime_now takes one format string")
			}
			return jinja.NewString(strftime(t.opts.Now(), args[0].AsString())), nil
		}),
	}
	out, err := tmpl.RenderValues(data)
	if raised != nil {
		return "", raised
	}
	if err != nil {
		return "", fmt.Errorf("chat template: %w", err)
	}
	if tmpl == t.fixed {
		out = strings.ReplaceAll(out, t.marker, "")
	}
	return out, nil
}

// Probes are the conversations Check renders: one user message, with a
// system message, a second turn, both.
var Probes = [][]Message{
	{{Role: "user", Content: "Hello"}},
	{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hello"}},
	{{Role: "user", Content: "Hello"}, {Role: "assistant", Content: "Hi!"}, {Role: "user", Content: "How are you?"}},
	{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hello"}, {Role: "assistant", Content: "Hi!"}, {Role: "user", Content: "How are you?"}},
}

// Check renders the Probes with the generation prompt. It fails when one
// fails for another reason than the template's raise_exception (the
// template uses something the engine lacks), or when the template refuses
// them all.
func (t *Template) Check() error {
	return check(func(msgs []Message) (string, error) { return t.Render(msgs, true) })
}

// check is Check with render rendering a conversation.
func check(render func([]Message) (string, error)) error {
	var refusal error
	ok := false
	for _, p := range Probes {
		_, err := render(p)
		var re *RaiseError
		switch {
		case err == nil:
			ok = true
		case errors.As(err, &re):
			refusal = err
		default:
			return fmt.Errorf("rendering a %s conversation: %w", describe(p), err)
		}
	}
	if !ok {
		return fmt.Errorf("chat template refuses every test conversation: %w", refusal)
	}
	return nil
}

func describe(msgs []Message) string {
	roles := make([]string, len(msgs))
	for i, m := range msgs {
		roles[i] = m.Role
	}
	return strings.Join(roles, "/")
}

// mentions reports whether any text of msgs contains s.
func mentions(msgs []Message, s string) bool {
	for _, m := range msgs {
		if strings.Contains(m.Role, s) || strings.Contains(m.Content, s) ||
			strings.Contains(m.Name, s) || strings.Contains(m.ToolCallID, s) {
			return true
		}
	}
	return false
}

// pickMarker returns a Unicode noncharacter (U+FDD0 to U+FDEF, which text
// never needs) that src does not contain.
func pickMarker(src string) (string, bool) {
	for r := rune(0xFDD0); r <= 0xFDEF; r++ {
		m := string(r)
		if !strings.Contains(src, m) {
			return m, utf8.ValidString(m)
		}
	}
	return "", false
}

// separateTags puts marker between every two tags of src that touch ("}}"
// or "%}" or "#}" directly followed by "{{", "{%" or "{#"), outside the
// bodies of macro, call, filter and block set, and leaves raw blocks and
// string literals alone.
func separateTags(src, marker string) string {
	var b strings.Builder
	depth := 0 // nesting of bodies whose output may be used as a value
	i := 0
	for i < len(src) {
		j := nextTag(src, i)
		if j < 0 {
			b.WriteString(src[i:])
			break
		}
		b.WriteString(src[i:j])
		end, name, assigns := tagEnd(src, j)
		if end < 0 { // unterminated: the parser will say so
			b.WriteString(src[j:])
			break
		}
		b.WriteString(src[j:end])
		i = end
		switch name {
		case "raw":
			k := endRaw(src, i)
			if k < 0 {
				b.WriteString(src[i:])
				return b.String()
			}
			b.WriteString(src[i:k])
			i = k
		case "macro", "call", "filter":
			depth++
		case "set":
			if !assigns {
				depth++
			}
		case "endmacro", "endcall", "endfilter", "endset":
			depth = max(depth-1, 0)
		}
		if depth == 0 && nextTag(src, i) == i {
			b.WriteString(marker)
		}
	}
	return b.String()
}

// nextTag returns the index of the first "{{", "{%" or "{#" at or after i,
// or -1.
func nextTag(src string, i int) int {
	for {
		k := strings.IndexByte(src[i:], '{')
		if k < 0 || i+k+1 >= len(src) {
			return -1
		}
		switch src[i+k+1] {
		case '{', '%', '#':
			return i + k
		}
		i += k + 1
	}
}

// tagEnd returns the end of the tag that opens at j (-1 when it is not
// closed), the name of a statement ("for", "endset", ...) and whether the
// statement has an "=" outside string literals (a set that assigns).
func tagEnd(src string, j int) (end int, name string, assigns bool) {
	kind := src[j+1]
	if kind == '#' {
		k := strings.Index(src[j+2:], "#}")
		if k < 0 {
			return -1, "", false
		}
		return j + 2 + k + 2, "", false
	}
	closer := byte('}')
	if kind == '%' {
		closer = '%'
	}
	var quote byte
	for k := j + 2; k < len(src); k++ {
		c := src[k]
		switch {
		case quote != 0:
			if c == '\\' {
				k++
			} else if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"':
			quote = c
		case c == '=':
			assigns = true
		case c == closer && k+1 < len(src) && src[k+1] == '}':
			if kind == '%' {
				name = statementName(src[j+2 : k])
			}
			return k + 2, name, assigns
		}
	}
	return -1, "", false
}

// statementName returns the first word of a statement's body.
func statementName(body string) string {
	body = strings.TrimLeft(body, "-+ \t\n")
	n := 0
	for n < len(body) && (body[n] == '_' || 'a' <= body[n] && body[n] <= 'z' || 'A' <= body[n] && body[n] <= 'Z') {
		n++
	}
	return body[:n]
}

// endRaw returns the end of the first {% endraw %} at or after i, or -1.
func endRaw(src string, i int) int {
	for {
		j := strings.Index(src[i:], "{%")
		if j < 0 {
			return -1
		}
		j += i
		end, name, _ := tagEnd(src, j)
		if end < 0 {
			return -1
		}
		if name == "endraw" {
			return end
		}
		i = j + 2
	}
}
