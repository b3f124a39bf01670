package server

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/serve"
)

// A colocated server's canaries: the correctness probes a router runs for
// its PD pairs (internal/router's canary.go), run by the server on its own
// engine, since no router fronts it. Each is a prompt of its own, sent
// once, greedy, so that it is cached; moved to the host tier when it is on;
// sent again (from the cache, loaded back from host) and with NoCache; the
// two outputs differing is corrupt KV. Canaries are Probe requests: in no
// metric and no readiness window. They wait their turn as any request, and
// a probe whose requests cannot all run within its bound is not judged.

// Canary results, as the router names them.
const (
	canaryMatch    = "match"
	canaryMismatch = "mismatch"
	canaryFailed   = "failed"
)

// canaryTokens is each send's greedy length; canaryBound how long one
// canary may take.
const (
	canaryTokens = 16
	canaryBound  = 30 * time.Second
)

// canaries keeps a server's canary outcomes.
type canaries struct {
	mu      sync.Mutex
	n       uint64
	results map[string]uint64
	last    *debug.CanaryMismatch
}

// RunCanaries sends a canary every interval until ctx ends; it returns
// then. Run it on a colocated server only: a prefill or decode server
// takes no request without its peer, and its router runs canaries.
func (s *Server) RunCanaries(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.canary(ctx)
	}
}

// canary sends one canary.
func (s *Server) canary(parent context.Context) {
	ctx, cancel := context.WithTimeout(parent, canaryBound)
	defer cancel()
	c := &s.canaries
	c.mu.Lock()
	c.n++
	seed := c.n
	c.mu.Unlock()
	prompt := s.canaryPrompt(seed)
	if _, err := s.canaryRun(ctx, prompt, false); err != nil {
		c.count(canaryFailed)
		return
	}
	if _, err := s.eng.Offload(ctx, prompt); err != nil {
		s.log.Debug("canary: no offload, comparing a device cache hit", "err", err)
	}
	cached, err := s.canaryRun(ctx, prompt, false)
	if err != nil {
		c.count(canaryFailed)
		return
	}
	computed, err := s.canaryRun(ctx, prompt, true)
	if err != nil {
		c.count(canaryFailed)
		return
	}
	if slices.Equal(cached, computed) {
		c.count(canaryMatch)
		return
	}
	c.count(canaryMismatch)
	text := func(toks []int32) string {
		t, err := s.tok.Decode(toks)
		if err != nil {
			return fmt.Sprint(toks)
		}
		return t
	}
	m := &debug.CanaryMismatch{At: time.Now(), Prefill: "self", Seed: seed, Cached: text(cached), Computed: text(computed)}
	c.mu.Lock()
	c.last = m
	c.mu.Unlock()
	s.log.Error("canary mismatch: the cached output differs from the computed one (corrupt KV)", "seed", seed,
		"cached", m.Cached, "computed", m.Computed)
}

// canaryPrompt is canary seed's prompt: random token ids, about a quarter
// of the context (several pages, more than an indexer's top-k), at most
// 512.
func (s *Server) canaryPrompt(seed uint64) []int32 {
	n := min(512, max(16, s.m.Config.ContextLen/4))
	r := rand.New(rand.NewPCG(seed, 0x243f6a8885a308d3))
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(r.IntN(s.m.Config.VocabSize))
	}
	return out
}

// canaryRun runs prompt once, greedy, marked a probe, and returns its
// tokens.
func (s *Server) canaryRun(ctx context.Context, prompt []int32, noCache bool) ([]int32, error) {
	st, err := s.eng.Submit(ctx, serve.Request{Prompt: prompt, MaxTokens: canaryTokens, IgnoreEOS: true, NoCache: noCache,
		Probe: true, Sampling: sample.Params{Temperature: 0}})
	if err != nil {
		return nil, err
	}
	var toks []int32
	for ev := range st.Events {
		if ev.Finish != nil {
			if ev.Finish.Reason != serve.ReasonLength {
				return nil, fmt.Errorf("canary ended %q", ev.Finish.Reason)
			}
			return toks, nil
		}
		toks = append(toks, ev.Token)
	}
	return nil, ctx.Err()
}

func (c *canaries) count(result string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.results == nil {
		c.results = map[string]uint64{}
	}
	c.results[result]++
}

// status is the canaries' outcome for the settings; nil before the first.
func (c *canaries) status() *debug.Canaries {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.results) == 0 {
		return nil
	}
	out := &debug.Canaries{Results: map[string]uint64{}}
	for k, v := range c.results {
		out.Results[k] = v
	}
	if c.last != nil {
		l := *c.last
		out.LastMismatch = &l
	}
	return out
}
