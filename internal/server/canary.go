package server

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/canary"
)

// A colocated server's canaries: the router's correctness probes (package
// canary's method), run by the server on its own engine, since no router
// fronts it. Canaries are Probe requests: in no metric and no readiness
// window. They wait their turn as any request; one whose runs cannot all
// end within canaryBound is not judged.

// canaryTokens is each run's greedy length; canaryBound how long one
// canary may take.
const (
	canaryTokens = 16
	canaryBound  = 30 * time.Second
)

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
	seed := s.canaries.Next()
	prompt := s.canaryPrompt(seed)
	result, cached, computed, err := canary.Run(ctx, canary.Steps{
		Send: func(ctx context.Context, noCache bool) (string, error) { return s.canaryRun(ctx, prompt, noCache) },
		Offload: func(ctx context.Context) {
			if _, err := s.eng.Offload(ctx, prompt); err != nil {
				s.log.Debug("canary: no offload, comparing a device cache hit", "err", err)
			}
		},
	})
	var m *debug.CanaryMismatch
	switch result {
	case canary.Failed:
		s.log.Warn("canary not judged: a run of it failed", "err", err)
	case canary.Mismatch:
		m = &debug.CanaryMismatch{At: time.Now(), Prefill: "self", Seed: seed, Cached: cached, Computed: computed}
		s.log.Error("canary mismatch: the cached output differs from the computed one (corrupt KV)", "seed", seed,
			"cached", cached, "computed", computed)
	}
	s.canaries.Count(result, m)
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
// text.
func (s *Server) canaryRun(ctx context.Context, prompt []int32, noCache bool) (string, error) {
	st, err := s.eng.Submit(ctx, serve.Request{Prompt: prompt, MaxTokens: canaryTokens, IgnoreEOS: true, NoCache: noCache,
		Probe: true, Sampling: sample.Params{Temperature: 0}})
	if err != nil {
		return "", err
	}
	var toks []int32
	for ev := range st.Events {
		if ev.Finish != nil {
			if ev.Finish.Reason != serve.ReasonLength {
				return "", fmt.Errorf("canary ended %q", ev.Finish.Reason)
			}
			return s.tok.Decode(toks)
		}
		toks = append(toks, ev.Token)
	}
	return "", ctx.Err()
}
