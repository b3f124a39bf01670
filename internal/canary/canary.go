// Package canary is how pdkit probes its own correctness without being
// asked: a prompt of its own, sent once so that it is cached, moved to the
// host tier where one is on, sent again (from the cache, loaded back from
// host) and sent without the cache. Greedy decoding is batch-invariant, so
// the last two differing is corrupt KV (the HiCache index-K race of
// incident 3). The router runs canaries through its PD pairs
// (internal/router), a colocated server on its own engine
// (internal/server); both do the I/O, this package the method and the
// tally.
package canary

import (
	"context"
	"maps"
	"sync"

	"github.com/pdkit/pdkit/api/debug"
)

// Results, as pdkit_router_canaries_total and the debug API name them.
const (
	Match    = "match"    // the cached or host-loaded output equals the computed one
	Mismatch = "mismatch" // it does not: corrupt KV
	Skipped  = "skipped"  // no room, or admission paused: not sent
	Failed   = "failed"   // a step of it failed: not judged
)

// Steps are one canary's I/O.
type Steps struct {
	// Send sends the canary's prompt, greedy, from the cache or (noCache)
	// computed whole, and returns its output.
	Send func(ctx context.Context, noCache bool) (string, error)
	// Offload moves the prompt's cached prefix to the host tier; best
	// effort: without a tier the canary compares a device cache hit.
	Offload func(ctx context.Context)
}

// Run runs one canary and returns its result (Match, Mismatch or Failed,
// with the step's error), and the two outputs it compared.
func Run(ctx context.Context, s Steps) (result, cached, computed string, err error) {
	if _, err = s.Send(ctx, false); err != nil {
		return Failed, "", "", err
	}
	s.Offload(ctx)
	if cached, err = s.Send(ctx, false); err != nil {
		return Failed, "", "", err
	}
	if computed, err = s.Send(ctx, true); err != nil {
		return Failed, "", "", err
	}
	if cached != computed {
		return Mismatch, cached, computed, nil
	}
	return Match, cached, computed, nil
}

// Tally keeps a prober's results and its last mismatch. Safe for
// concurrent use.
type Tally struct {
	mu      sync.Mutex
	n       uint64
	results map[string]uint64
	last    *debug.CanaryMismatch
}

// Next is the seed of the next canary: 1, 2, ...
func (t *Tally) Next() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.n++
	return t.n
}

// Count records a result; m, with Mismatch, is its record.
func (t *Tally) Count(result string, m *debug.CanaryMismatch) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.results == nil {
		t.results = map[string]uint64{}
	}
	t.results[result]++
	if m != nil {
		t.last = m
	}
}

// Status is the results and the last mismatch, for the debug API; nil
// before the first result.
func (t *Tally) Status() *debug.Canaries {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.results) == 0 {
		return nil
	}
	out := &debug.Canaries{Results: maps.Clone(t.results)}
	if t.last != nil {
		l := *t.last
		out.LastMismatch = &l
	}
	return out
}
