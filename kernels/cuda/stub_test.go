//go:build !cuda

package cuda

import (
	"errors"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

func TestStubUnavailable(t *testing.T) {
	b, err := New()
	if !errors.Is(err, kernels.ErrUnavailable) {
		t.Fatalf("New() error = %v, want one wrapping kernels.ErrUnavailable", err)
	}
	if b != nil {
		t.Fatalf("New() returned a backend with its error")
	}
	if err := b.Close(); err != nil {
		t.Fatalf("Close on the nil backend: %v", err)
	}
}
