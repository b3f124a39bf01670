package bench

import (
	"cmp"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"

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

// openWorkload checks a serving workload (client concurrency levels,
// prompts of promptLen tokens, maxTokens generated each) against the
// model of spec and opens that model.
func openWorkload(home string, spec builtin.Spec, conc []int, promptLen, maxTokens int) (m *model.Model, path string, err error) {
	for _, c := range conc {
		if c < 1 {
			return nil, "", fmt.Errorf("bench: concurrency %d must be ≥ 1", c)
		}
	}
	mc, err := builtin.Shape(spec.Arch, spec.Size)
	if err != nil {
		return nil, "", err
	}
	if promptLen+maxTokens > mc.ContextLen {
		return nil, "", fmt.Errorf("bench: prompt of %d tokens plus %d to generate exceeds the context length %d", promptLen, maxTokens, mc.ContextLen)
	}
	return openBuiltin(home, spec)
}

// pageSize is the KV page size of the benchmarks' engines.
const pageSize = 16

// kvTokens is the KV to give an engine for running requests of at most
// perReq tokens each, not for running full contexts (the engine's
// default).
func kvTokens(running, perReq int) int {
	return running * ((perReq + pageSize - 1) / pageSize * pageSize)
}

// newClient is a client of the completions endpoint under base that keeps
// a connection for each of conns concurrent requests.
func newClient(base, model string, conns, maxTokens int, timeout time.Duration) *client {
	tr := &http.Transport{MaxIdleConns: conns + 1, MaxIdleConnsPerHost: conns + 1, DisableCompression: true}
	return &client{http: &http.Client{Transport: tr}, url: base + "/v1/completions", model: model, maxTokens: maxTokens, timeout: timeout}
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
