// Package model holds the llama-family architectures pdkit runs: their
// configuration and weights read from GGUF, and the batched forward pass over
// a paged KV pool.
package model

import (
	"fmt"
	"math"
)

// MaxContextLen bounds the context length a model may declare: 16M
// tokens, past the longest context of any released model. A file that
// says more is refused at load, before a server sizes a KV pool by it.
const MaxContextLen = 1 << 24

// Architectures pdkit runs (GGUF general.architecture).
const (
	ArchLlama    = "llama"
	ArchLlamaDSA = "llama-dsa" // llama plus a DeepSeek-style sparse-attention indexer; see docs/llama-dsa.md
)

// Config is the shape of a model, read from GGUF metadata.
type Config struct {
	Arch       string
	VocabSize  int
	Dim        int // embedding length
	Layers     int
	Hidden     int // feed-forward length
	Heads      int
	KVHeads    int
	HeadDim    int
	RopeDim    int
	RopeTheta  float32
	NormEps    float32
	ContextLen int
	TiedOutput bool // output projection shares token_embd

	// Indexer is set for ArchLlamaDSA.
	Indexer *IndexerConfig
}

// IndexerConfig is the sparse-attention indexer of ArchLlamaDSA.
type IndexerConfig struct {
	Heads int // index-query heads
	Dim   int // index key (and query head) length
	TopK  int // tokens each query attends to once its context is longer
}

// KVDim is the width of one token's K (or V) row.
func (c *Config) KVDim() int { return c.KVHeads * c.HeadDim }

// QDim is the width of one token's query row.
func (c *Config) QDim() int { return c.Heads * c.HeadDim }

// Validate rejects shapes the forward pass cannot run.
func (c *Config) Validate() error {
	pos := []struct {
		name string
		v    int
	}{
		{"vocab size", c.VocabSize}, {"embedding length", c.Dim}, {"block count", c.Layers},
		{"feed-forward length", c.Hidden}, {"head count", c.Heads}, {"KV head count", c.KVHeads},
		{"head dim", c.HeadDim}, {"context length", c.ContextLen},
	}
	for _, p := range pos {
		if p.v <= 0 {
			return fmt.Errorf("model: %s is %d", p.name, p.v)
		}
	}
	if c.ContextLen > MaxContextLen {
		return fmt.Errorf("model: context length %d is more than the %d tokens pdkit takes", c.ContextLen, MaxContextLen)
	}
	if c.Heads%c.KVHeads != 0 {
		return fmt.Errorf("model: head count %d is not a multiple of KV head count %d", c.Heads, c.KVHeads)
	}
	if c.RopeDim <= 0 || c.RopeDim > c.HeadDim || c.RopeDim%2 != 0 {
		return fmt.Errorf("model: rope dimension %d must be even and in (0, head dim %d]", c.RopeDim, c.HeadDim)
	}
	if !(c.RopeTheta > 0) || math.IsInf(float64(c.RopeTheta), 0) {
		return fmt.Errorf("model: rope freq base %v must be positive and finite", c.RopeTheta)
	}
	if !(c.NormEps > 0) || math.IsInf(float64(c.NormEps), 0) {
		return fmt.Errorf("model: RMS norm epsilon %v must be positive and finite", c.NormEps)
	}
	switch c.Arch {
	case ArchLlama:
		if c.Indexer != nil {
			return fmt.Errorf("model: architecture %s has no indexer", c.Arch)
		}
	case ArchLlamaDSA:
		ix := c.Indexer
		if ix == nil {
			return fmt.Errorf("model: architecture %s needs indexer settings", c.Arch)
		}
		if ix.Heads <= 0 || ix.Dim <= 0 || ix.TopK <= 0 {
			return fmt.Errorf("model: indexer heads %d, key length %d, top-k %d must be positive", ix.Heads, ix.Dim, ix.TopK)
		}
		if ix.TopK > c.ContextLen {
			return fmt.Errorf("model: indexer top-k %d is more than the context length %d", ix.TopK, c.ContextLen)
		}
		if ix.Dim%2 != 0 || ix.Dim < 2 {
			return fmt.Errorf("model: indexer key length %d must be even (RoPE pairs)", ix.Dim)
		}
	default:
		return fmt.Errorf("model: unsupported architecture %q (pdkit runs %s and %s)", c.Arch, ArchLlama, ArchLlamaDSA)
	}
	return nil
}
