// Package sample turns logits into a token: greedy, or temperature and
// nucleus (top-p) sampling from a seeded generator, so that a request with a
// seed is reproducible.
package sample

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// Params are a request's sampling settings.
type Params struct {
	Temperature float32 // 0: greedy
	TopP        float32 // (0, 1]; 0 means 1
	Seed        uint64
}

// Validate rejects settings no sampler can honour.
func (p Params) Validate() error {
	if p.Temperature < 0 || p.Temperature != p.Temperature || math.IsInf(float64(p.Temperature), 0) {
		return fmt.Errorf("temperature %v must be a finite number ≥ 0", p.Temperature)
	}
	if p.TopP < 0 || p.TopP > 1 || p.TopP != p.TopP {
		return fmt.Errorf("top_p %v must be in [0, 1]", p.TopP)
	}
	return nil
}

// Sampler draws tokens for one sequence. Not safe for concurrent use.
type Sampler struct {
	p    Params
	rng  *rand.Rand
	prob []float32
	idx  []int32
}

// New returns a sampler; each sequence gets its own so that its draws do not
// depend on its neighbours.
func New(p Params) *Sampler {
	return &Sampler{p: p, rng: rand.New(rand.NewPCG(p.Seed, 0xda3e39cb94b95bdb))}
}

// Greedy returns the index of the largest logit (the lowest index on ties;
// NaN never wins). It runs once per sequence per step over the whole
// vocabulary on the step's critical path, so amd64 has a vector version.
func Greedy(logits []float32) int32 { return greedy(logits) }

// greedyGo is Greedy in plain Go: the reference and the fallback.
func greedyGo(logits []float32) int32 {
	best := -1
	for i, v := range logits {
		if v != v {
			continue
		}
		if best < 0 || v > logits[best] {
			best = i
		}
	}
	return int32(max(best, 0))
}

// IsGreedy says Sample picks the largest logit (temperature 0), so a
// caller holding that choice already need not call it.
func (s *Sampler) IsGreedy() bool { return s.p.Temperature == 0 }

// Sample picks the next token.
func (s *Sampler) Sample(logits []float32) int32 {
	if s.p.Temperature == 0 {
		return Greedy(logits)
	}
	n := len(logits)
	if cap(s.prob) < n {
		s.prob = make([]float32, n)
		s.idx = make([]int32, n)
	}
	prob, idx := s.prob[:n], s.idx[:n]
	mx := logits[Greedy(logits)]
	var sum float64
	for i, v := range logits {
		e := math.Exp(float64((v - mx) / s.p.Temperature))
		if e != e {
			e = 0
		}
		prob[i] = float32(e)
		sum += e
	}
	for i := range idx {
		idx[i] = int32(i)
	}
	keep := n
	if top := s.p.TopP; top > 0 && top < 1 {
		slices.SortFunc(idx, func(a, b int32) int {
			if c := cmp.Compare(prob[b], prob[a]); c != 0 {
				return c
			}
			return cmp.Compare(a, b)
		})
		var acc float64
		for i, id := range idx {
			acc += float64(prob[id])
			if acc >= float64(top)*sum {
				keep = i + 1
				break
			}
		}
		sum = 0
		for _, id := range idx[:keep] {
			sum += float64(prob[id])
		}
	}
	r := s.rng.Float64() * sum
	var acc float64
	for _, id := range idx[:keep] {
		acc += float64(prob[id])
		if r < acc {
			return id
		}
	}
	return idx[keep-1]
}
