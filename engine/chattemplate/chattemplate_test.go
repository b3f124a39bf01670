package chattemplate

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// Chat templates of real models, as their tokenizer_config.json (and so
// their GGUF's tokenizer.chat_template) carries them; llama31 and
// mistralV03 are those of Llama 3.1 and Mistral v0.3 without their tool
// branches, deepSeekR1 DeepSeek-R1's without its tool branch. plainLines
// and trimAroundExpr are written for the tests: each puts a tag next to an
// expression, where the Jinja engine's own whitespace control is wrong.
const (
	llama3 = `{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
`
	llama31 = `{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
`
	chatML = `{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
`
	mistralV01 = `{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}
`
	mistralV03 = `{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set ns.index = ns.index + 1 %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
`
	llama2 = `{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}
`
	gemma = `{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}
`
	deepSeekR1 = `{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}
`
	zephyr = `{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>
' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>
' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>
'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}
`
	plainLines = `{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}
`
	trimAroundExpr = `{%- for message in messages -%}
{%- if message['role'] == 'system' -%}<|system|>Note: {{ message['content'] }}{%- else -%}<|{{ message['role'] }}|>{{ message['content'] }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}
`
)

var (
	// conversation is a system prompt and two user turns, with spaces
	// around some contents, which some templates trim.
	conversation = []Message{
		{Role: "system", Content: "You are terse."},
		{Role: "user", Content: "Hi"},
		{Role: "assistant", Content: "Hello! "},
		{Role: "user", Content: " Tell me a joke. "},
	}
	oneUser = []Message{{Role: "user", Content: "Hi"}}
	// twoUsers does not alternate user and assistant.
	twoUsers = []Message{{Role: "user", Content: "a"}, {Role: "user", Content: "b"}}
)

// clock is strftime_now's fixed time in the tests.
func clock() time.Time { return time.Date(2025, time.March, 7, 9, 30, 0, 0, time.UTC) }

func compile(t *testing.T, src string) *Template {
	t.Helper()
	tmpl, err := Compile(src, Options{BOS: "<s>", EOS: "</s>", Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	return tmpl
}

// Each template renders each conversation to exactly the prompt Python's
// Jinja2 renders under transformers' apply_chat_template (trim_blocks,
// lstrip_blocks, raise_exception), or refuses it with the template's own
// message.
func TestRenderRealTemplates(t *testing.T) {
	cases := []struct {
		name, src string
		msgs      []Message
		want      string // the prompt, or the RaiseError's message after "raise: "
	}{
		{"llama3", llama3, conversation, "<s><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama3 one user", llama3, oneUser, "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama31 strftime_now", llama31, conversation, "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 07 Mar 2025\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama31 no system", llama31, oneUser, "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 07 Mar 2025\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"chatml", chatML, conversation, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! <|im_end|>\n<|im_start|>user\n Tell me a joke. <|im_end|>\n<|im_start|>assistant\n"},
		{"chatml one user", chatML, oneUser, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},
		{"mistral v0.1", mistralV01, conversation[1:], "<s>[INST] Hi [/INST]Hello! </s>[INST]  Tell me a joke.  [/INST]"},
		{"mistral v0.1 system", mistralV01, conversation, "raise: Conversation roles must alternate user/assistant/user/assistant/..."},
		{"mistral v0.1 alternation", mistralV01, twoUsers, "raise: Conversation roles must alternate user/assistant/user/assistant/..."},
		{"mistral v0.3 namespace", mistralV03, conversation, "<s>[INST] Hi[/INST] Hello!</s>[INST] You are terse.\n\n Tell me a joke. [/INST]"},
		{"mistral v0.3 one user", mistralV03, oneUser, "<s>[INST] Hi[/INST]"},
		{"mistral v0.3 alternation", mistralV03, twoUsers, "raise: After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."},
		{"llama2", llama2, conversation, "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Tell me a joke. [/INST]"},
		{"llama2 alternation", llama2, twoUsers, "raise: Conversation roles must alternate user/assistant/user/assistant/..."},
		{"gemma", gemma, conversation[1:], "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nTell me a joke.<end_of_turn>\n<start_of_turn>model\n"},
		{"gemma system", gemma, conversation, "raise: System role not supported"},
		{"deepseek-r1 namespace", deepSeekR1, conversation, "<s>You are terse.<｜User｜>Hi<｜Assistant｜>Hello! <｜end▁of▁sentence｜><｜User｜> Tell me a joke. <｜Assistant｜><think>\n"},
		{"deepseek-r1 think", deepSeekR1, []Message{{Role: "user", Content: "Hi"}, {Role: "assistant", Content: "<think>hmm</think>Hello"}, {Role: "user", Content: "Joke?"}}, "<s><｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜><｜User｜>Joke?<｜Assistant｜><think>\n"},
		{"zephyr", zephyr, conversation, "<|system|>\nYou are terse.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello! </s>\n<|user|>\n Tell me a joke. </s>\n<|assistant|>\n"},
		{"tag next to expression keeps the newline", plainLines, conversation, "system: You are terse.\nuser: Hi\nassistant: Hello! \nuser:  Tell me a joke. \nassistant:"},
		{"trim marker next to expression", trimAroundExpr, conversation, "<|system|>Note: You are terse.<|user|>Hi<|assistant|>Hello! <|user|> Tell me a joke. <|assistant|>"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := compile(t, c.src).Render(c.msgs, true)
			if msg, ok := strings.CutPrefix(c.want, "raise: "); ok {
				var re *RaiseError
				if !errors.As(err, &re) || re.Message != msg {
					t.Fatalf("got %q, %v; want RaiseError %q", got, err, msg)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != c.want {
				t.Errorf("got  %q\nwant %q", got, c.want)
			}
		})
	}
}

// Without the generation prompt the template stops after the last message.
func TestRenderWithoutGenerationPrompt(t *testing.T) {
	got, err := compile(t, chatML).Render(oneUser, false)
	if want := "<|im_start|>user\nHi<|im_end|>\n"; err != nil || got != want {
		t.Errorf("got %q, %v; want %q", got, err, want)
	}
}

// Messages reach the template as OpenAI writes them: role, content, then
// name and tool_call_id only when set.
func TestRenderMessageFields(t *testing.T) {
	tmpl := compile(t, `{% for m in messages %}{{ m|tojson }} {{ m.name is defined }} {{ m['content'] }};{% endfor %}`)
	got, err := tmpl.Render([]Message{{Role: "user", Content: "Hi \"you\"", Name: "ann"}, {Role: "tool", Content: "42", ToolCallID: "call_1"}}, false)
	want := `{"role": "user", "content": "Hi \"you\"", "name": "ann"} True Hi "you";{"role": "tool", "content": "42", "tool_call_id": "call_1"} False 42;`
	if err != nil || got != want {
		t.Errorf("got  %q, %v\nwant %q", got, err, want)
	}
}

// Jinja2 drops one newline at the end of a template, and reads CRLF as LF.
func TestTrailingNewline(t *testing.T) {
	for src, want := range map[string]string{
		"{{ 'x' }}\n":         "x",
		"{{ 'x' }}\n\n":       "x\n",
		"a\r\nb{{ 'x' }}\r\n": "a\nbx",
	} {
		got, err := compile(t, src).Render(nil, true)
		if err != nil || got != want {
			t.Errorf("%q: got %q, %v; want %q", src, got, err, want)
		}
	}
}

// The separators put between touching tags never reach the output, and
// leave alone what they must not change: string literals that spell tags,
// raw blocks, and the bodies whose output a template uses as a value.
func TestSeparatedTags(t *testing.T) {
	for src, want := range map[string]string{
		`{{ '%}{{' }}{{ "}}{%" }}{# c #}{{ 1 }}`:                                                 "%}{{}}{%1",
		`{% raw %}{{ x }}{% endraw %}{{ 2 }}`:                                                    "{{ x }}2",
		`{% set c %}{% if true %}{{ ' a ' }}{% endif %}{% endset %}[{{ c|trim }}]{{ c|length }}`: "[a]3",
		`{% macro m(x) %}{% if x %}{{ x }}{% endif %}{% endmacro %}[{{ m(' q ')|trim }}]`:        "[q]",
		"{% for i in [1, 2] %}{{ i }}\n{% endfor %}":                                             "1\n2\n",
		"{% if true -%}{{ 'a' }} b{% endif %}":                                                   "a b",
		"A\n  {{ 'x' }}{% if true %}y{% endif %}":                                                "A\n  xy",
		"{% for i in [1, 2] %}{{ i }}{% if true %} {% endif %}{% endfor %}":                      "1 2 ",
		"{% if true %}{{ 'a' }}{% endif %}\n\nB":                                                 "a\nB",
	} {
		got, err := compile(t, src).Render(nil, true)
		if err != nil || got != want {
			t.Errorf("%q: got %q, %v; want %q", src, got, err, want)
		}
	}
}

// A conversation that contains the separator itself (a Unicode
// noncharacter) is rendered from the template as written, so that no
// character of it is lost.
func TestSeparatorInContent(t *testing.T) {
	tmpl := compile(t, chatML)
	if tmpl.marker == "" {
		t.Fatal("no separator picked")
	}
	content := "a" + tmpl.marker + "b"
	got, err := tmpl.Render([]Message{{Role: "user", Content: content}}, true)
	want := "<|im_start|>user\n" + content + "<|im_end|>\n<|im_start|>assistant\n"
	if err != nil || got != want {
		t.Errorf("got %q, %v; want %q", got, err, want)
	}
	// A template that spells the first noncharacter gets another.
	if m, ok := pickMarker("\uFDD0 \uFDD1"); !ok || m != "\uFDD2" {
		t.Errorf("pickMarker = %q, %v; want U+FDD2", m, ok)
	}
}

// Check passes templates that render the probe conversations (refusing
// some, as gemma refuses a system message) and fails those the engine
// cannot render or that refuse everything; a syntax error fails Compile.
func TestCheck(t *testing.T) {
	for name, src := range map[string]string{"llama3": llama3, "chatml": chatML, "mistral v0.1": mistralV01, "gemma": gemma, "deepseek-r1": deepSeekR1, "llama31": llama31} {
		if err := compile(t, src).Check(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for name, c := range map[string]struct{ src, want string }{
		"unknown filter": {`{% for m in messages %}{{ m.content|format(1) }}{% endfor %}`, `rendering a user conversation: chat template: unknown filter "format"`},
		"unknown call":   {`{{ messages|first|frobnicate }}`, `rendering a user conversation: chat template: unknown filter "frobnicate"`},
		"refuses all":    {`{{ raise_exception('only for tools') }}`, `chat template refuses every test conversation: only for tools`},
	} {
		err := compile(t, c.src).Check()
		if err == nil || err.Error() != c.want {
			t.Errorf("%s: Check = %v, want %q", name, err, c.want)
		}
	}
	for _, src := range []string{`{% for m in messages %}{{ m.content }}`, `{{ messages[0 }}`, `{% endfor %}`} {
		if _, err := Compile(src, Options{}); err == nil {
			t.Errorf("Compile(%q) succeeded", src)
		}
	}
}

// A compiled template renders from many goroutines at once.
func TestConcurrentRender(t *testing.T) {
	tmpl := compile(t, mistralV03)
	want, err := tmpl.Render(conversation, true)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				if got, err := tmpl.Render(conversation, true); err != nil || got != want {
					t.Errorf("got %q, %v", got, err)
					return
				}
				var re *RaiseError
				if _, err := tmpl.Render(twoUsers, true); !errors.As(err, &re) {
					t.Errorf("alternation not refused: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestStrftime(t *testing.T) {
	at := time.Date(2024, time.July, 5, 15, 4, 9, 0, time.UTC)
	for format, want := range map[string]string{
		"%d %b %Y":          "05 Jul 2024",
		"%-d %B %Y":         "5 July 2024",
		"%Y-%m-%d %H:%M:%S": "2024-07-05 15:04:09",
		"%A %a %I%p %j %y":  "Friday Fri 03PM 187 24",
		"%F %T %% %Q":       "2024-07-05 15:04:09 % %Q",
		"100%":              "100%",
	} {
		if got := strftime(at, format); got != want {
			t.Errorf("strftime(%q) = %q, want %q", format, got, want)
		}
	}
}
