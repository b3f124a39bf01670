//go:build cuda

package cuda

import (
	"errors"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

// TestNewFallsBack runs on a GPU machine only (the cu package exits the
// process at start-up without a driver): New must reach the device and
// still report the backend unavailable until the kernels exist.
func TestNewFallsBack(t *testing.T) {
	b, err := New()
	if b != nil {
		b.Close()
		t.Skip("the CUDA kernels exist: this seam test is obsolete")
	}
	if !errors.Is(err, kernels.ErrUnavailable) {
		t.Fatalf("New() error = %v, want one wrapping kernels.ErrUnavailable", err)
	}
	if !strings.Contains(err.Error(), "not implemented yet") {
		t.Fatalf("New() error = %v, want the device initialised and the kernels reported missing", err)
	}
	t.Log(err)
}
