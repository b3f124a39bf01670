package bench

import (
	"cmp"
	"io"
	"log/slog"
	"math/rand/v2"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
)

// setDefault sets *p to def when it is unset: zero, or for a number
// negative.
func setDefault[T cmp.Ordered](p *T, def T) {
	var zero T
	if *p <= zero {
		*p = def
	}
}

// openBuiltin opens the built-in model of spec, building it in the cache
// folder home first if it is not there yet; path is its file.
func openBuiltin(home string, spec builtin.Spec) (m *model.Model, path string, err error) {
	path, err = builtin.Ensure(home, spec)
	if err != nil {
		return nil, "", err
	}
	m, err = model.Open(path)
	if err != nil {
		return nil, "", err
	}
	return m, path, nil
}

// warnLog is a benchmark's logger: warnings and errors only, written to
// progress.
func warnLog(progress io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(progress, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// ratio is a over b, 0 when b is not positive (nothing measured).
func ratio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

// randTokens is n token ids drawn from rng, skipping the control tokens.
func randTokens(rng *rand.Rand, n, vocab int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(3 + rng.IntN(vocab-3))
	}
	return p
}
