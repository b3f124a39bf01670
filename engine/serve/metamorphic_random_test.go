//go:build metamorphic

package serve

import (
	"flag"
	"math/rand/v2"
	"testing"
)

var metaRandom = flag.Int("metamorphic.seeds", 50, "random seeds TestMetamorphicRandom runs")

// TestMetamorphicRandom runs the metamorphic harness on random seeds, each
// printed with its variant and the command that replays it alone on a
// failure.
func TestMetamorphicRandom(t *testing.T) {
	seeds := make([]uint64, *metaRandom)
	for i := range seeds {
		seeds[i] = rand.Uint64()
	}
	t.Logf("seeds %v", seeds)
	runMetamorphic(t, seeds)
}
