package chattemplate

import (
	"testing"
)

// The cost of bounding a render: the same template and conversation
// rendered in the process and in a sandbox's worker (a pipe round trip
// and the conversation's JSON each way).
func BenchmarkRender(b *testing.B) {
	msgs := Probes[len(Probes)-1]
	b.Run("in-process", func(b *testing.B) {
		t, err := Compile(llama31, Options{})
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if _, err := t.Render(msgs, true); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("sandboxed", func(b *testing.B) {
		s := NewSandbox(Bounds{})
		defer s.Close()
		t, err := s.Compile(b.Context(), llama31, Options{})
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if _, err := t.Render(b.Context(), msgs, true); err != nil {
				b.Fatal(err)
			}
		}
	})
}
