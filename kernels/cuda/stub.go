//go:build !cuda

package cuda

import (
	"fmt"

	"github.com/pdkit/pdkit/kernels"
)

// Backend is the CUDA backend; in a build without the cuda tag there is
// none.
type Backend struct{}

// New reports that this build has no CUDA backend: the error wraps
// kernels.ErrUnavailable.
func New() (*Backend, error) {
	return nil, fmt.Errorf("%w: pdkit was built without the cuda tag", kernels.ErrUnavailable)
}

// Close does nothing.
func (*Backend) Close() error { return nil }

func (*Backend) unimplemented(op string) {
	panic("kernels/cuda: " + op + ": pdkit was built without the cuda tag")
}
