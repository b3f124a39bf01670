package ref_test

import (
	"testing"

	"github.com/pdkit/pdkit/kernels/kerneltest"
	"github.com/pdkit/pdkit/kernels/ref"
)

// TestConformance runs the suite on the reference itself: every bound must
// hold at zero distance, so this checks the suite (its cases, its
// tolerance arithmetic) more than the reference.
func TestConformance(t *testing.T) { kerneltest.Run(t, ref.New()) }
