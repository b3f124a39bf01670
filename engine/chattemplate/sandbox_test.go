package chattemplate

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

func sandboxFor(t *testing.T, b Bounds) *Sandbox {
	s := NewSandbox(b)
	t.Cleanup(s.Close)
	return s
}

// A sandboxed render is the render of the same template in the process:
// the real templates, each probe conversation, refusals included.
func TestSandboxRendersAsInProcess(t *testing.T) {
	s := sandboxFor(t, Bounds{})
	ctx := t.Context()
	for name, src := range map[string]string{"llama3": llama3, "llama31": llama31, "chatml": chatML, "mistral": mistralV01} {
		o := Options{BOS: "<s>", EOS: "</s>", Now: func() time.Time { return time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC) }}
		in, err := Compile(src, o)
		if err != nil {
			t.Fatal(err)
		}
		out, err := s.Compile(ctx, src, o)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, p := range Probes {
			want, werr := in.Render(p, true)
			got, gerr := out.Render(ctx, p, true)
			if got != want || (werr == nil) != (gerr == nil) {
				t.Errorf("%s %s: sandboxed %q %v, in process %q %v", name, describe(p), got, gerr, want, werr)
			}
			var re *RaiseError
			if werr != nil && (!errors.As(gerr, &re) || gerr.Error() != werr.Error()) {
				t.Errorf("%s %s: sandboxed refusal %v, want %v", name, describe(p), gerr, werr)
			}
		}
		if err := out.Check(ctx); err != nil {
			t.Errorf("%s: Check %v", name, err)
		}
	}
	if _, err := s.Compile(ctx, "{% for %}", Options{}); err == nil || !strings.Contains(err.Error(), "chat template") {
		t.Errorf("a syntax error: %v", err)
	}
	if st := s.Stats(); st.Started != 1 || st.Bounded != 0 {
		t.Errorf("stats %+v: want one worker, for every template in turn", st)
	}
}

// trigger renders its messages, and loops for ever on one that says
// "trigger".
const trigger = `{% for m in messages %}{% if 'trigger' in m.content %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}`

// TestRedTeamHostileChatTemplates: templates that ask for unbounded time,
// memory, stack or output, at compile time, at every render, or only when
// a message says a word, are each refused with the bound they passed; the
// worker that ran them is killed (what it held goes with it) and the next
// render is served by a new one. Without the sandbox each of them takes
// the server down or holds it: 100 GB asked for at once, a stack overflow,
// a loop without end.
func TestRedTeamHostileChatTemplates(t *testing.T) {
	// Bounds other than time are given a minute, so that a slow machine
	// still meets them first.
	bounds := func(bound string) Bounds {
		b := Bounds{Time: time.Minute, Memory: 256 << 20, Stack: 4 << 20}
		if bound == BoundTime {
			b.Time = 300 * time.Millisecond
		}
		return b
	}
	ctx := t.Context()
	hello := []Message{{Role: "user", Content: "hello"}}
	for _, c := range []struct {
		name, src string
		msgs      []Message
		bound     string
		maxOutput int
	}{
		{"a string of 100 GB", `{{ 'x' * 100000000000 }}`, hello, BoundMemory, 0},
		{"a string doubled a hundred times", `{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}`, hello, BoundMemory, 0},
		{"a list of 10^11", `{% for i in range(100000000000) %}x{% endfor %}`, hello, BoundMemory, 0},
		{"a macro that calls itself", `{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}`, hello, BoundRecursion, 0},
		{"a loop without end", `{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}`, hello, BoundTime, 0},
		{"a trigger word", trigger, []Message{{Role: "user", Content: "say trigger"}}, BoundTime, 0},
		{"4 MB of output", `{% for i in range(4000) %}{{ 'x' * 1000 }}{% endfor %}`, hello, BoundOutput, 1 << 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := sandboxFor(t, bounds(c.bound))
			tmpl, err := s.Compile(ctx, c.src, Options{MaxOutput: c.maxOutput})
			if err != nil {
				t.Fatal(err)
			}
			_, err = tmpl.Render(ctx, c.msgs, true)
			var be *BoundError
			if !errors.As(err, &be) || be.Bound != c.bound || !strings.Contains(err.Error(), c.bound+" bound of ") {
				t.Fatalf("got %v, want the %s bound named", err, c.bound)
			}
			if st := s.Stats(); st.Bounded != 1 || st.Workers != 0 {
				t.Errorf("stats %+v: want one more bounded, and its worker gone", st)
			}
			good, err := s.Compile(ctx, chatML, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if out, err := good.Render(ctx, hello, true); err != nil || !strings.Contains(out, "hello") {
				t.Errorf("the next render: %q %v", out, err)
			}
		})
	}
	// The trigger template serves the conversations without its word.
	s := sandboxFor(t, bounds(BoundRecursion))
	tmpl, err := s.Compile(ctx, trigger, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := tmpl.Render(ctx, hello, true); err != nil || out != "hello" {
		t.Errorf("the trigger template without its word: %q %v", out, err)
	}
	// A nesting deep enough to overflow the parser's stack fails its
	// compile, in the worker.
	deep := "{{ " + strings.Repeat("(", 1<<17) + "1" + strings.Repeat(")", 1<<17) + " }}"
	var be *BoundError
	if _, err := s.Compile(ctx, deep, Options{}); !errors.As(err, &be) || be.Bound != BoundRecursion {
		t.Errorf("a nesting 2^17 deep: %v, want the recursion bound", err)
	}
}

// A render that runs long holds one worker and no other render: while
// the trigger loops, another conversation is rendered, and the trigger's
// render ends, its worker killed, when its request's context does.
func TestSandboxSlowsNoOtherRender(t *testing.T) {
	s := sandboxFor(t, Bounds{Time: time.Hour, Workers: 2})
	tmpl, err := s.Compile(t.Context(), trigger, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	ended := make(chan error, 1)
	go func() {
		_, err := tmpl.Render(ctx, []Message{{Role: "user", Content: "trigger"}}, true)
		ended <- err
	}()
	waitfor.For(t, "the trigger rendering", 20*time.Second, func() bool { return s.Stats().InFlight == 1 })
	if out, err := tmpl.Render(t.Context(), []Message{{Role: "user", Content: "hello"}}, true); err != nil || out != "hello" {
		t.Fatalf("beside the trigger: %q %v", out, err)
	}
	select {
	case err := <-ended:
		t.Fatalf("the trigger ended by itself: %v", err)
	default:
	}
	cancel()
	if err := waitfor.Recv(t, "the trigger's end", 20*time.Second, ended); !errors.Is(err, context.Canceled) {
		t.Fatalf("the trigger after its context ended: %v", err)
	}
	if st := s.Stats(); st.Workers != 1 || st.InFlight != 0 {
		t.Errorf("stats %+v: want the trigger's worker killed, the other idle", st)
	}
}
