// Package model holds the llama-family architectures pdkit runs: their
// configuration and weights read from GGUF, and the batched forward pass over
// a paged KV pool.
package model

import (
	"fmt"
	"math"
	"strings"
)

// MaxContextLen bounds the context length a model may declare: 16M
// tokens, past the longest context of any released model. A file that
// says more is refused at load, before a server sizes a KV pool by it.
const MaxContextLen = 1 << 24

// Architectures pdkit runs (GGUF general.architecture).
const (
	ArchLlama    = "llama"
	ArchLlamaDSA = "llama-dsa" // llama plus a DeepSeek-style sparse-attention indexer; see docs/llama-dsa.md
	// ArchDeepSeek2 is DeepSeek-V2/V3's multi-head latent attention with
	// dense feed-forward layers, written as llama.cpp's deepseek2 family;
	// see docs/deepseek2.md.
	ArchDeepSeek2 = "deepseek2"
	// ArchDeepSeek2DSA is ArchDeepSeek2 plus DeepSeek-V3.2's
	// sparse-attention indexer: the seed system's model family.
	ArchDeepSeek2DSA = "deepseek2-dsa"
)

// Archs lists the architectures pdkit runs.
var Archs = []string{ArchLlama, ArchLlamaDSA, ArchDeepSeek2, ArchDeepSeek2DSA}

// ArchList names the architectures for messages and help.
func ArchList() string {
	return strings.Join(Archs[:len(Archs)-1], ", ") + " or " + Archs[len(Archs)-1]
}

// HasIndexer says whether architecture arch has the sparse indexer.
func HasIndexer(arch string) bool { return arch == ArchLlamaDSA || arch == ArchDeepSeek2DSA }

// IsMLA says whether architecture arch uses multi-head latent attention.
func IsMLA(arch string) bool { return arch == ArchDeepSeek2 || arch == ArchDeepSeek2DSA }

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

	// Indexer is set for the architectures with the sparse indexer
	// (HasIndexer).
	Indexer *IndexerConfig
	// MLA is set for the multi-head latent attention architectures
	// (IsMLA). HeadDim is then the query and key length of a head, its
	// position-free part and its RoPE part (RopeDim) together, and
	// KVHeads is 1: every head reads the one latent row of a token.
	MLA *MLAConfig
}

// MLAConfig is DeepSeek's multi-head latent attention. A token's KV is one
// row: the compressed latent (KVRank elements, RMS-normalised) followed by
// the RoPE key shared by all heads (RopeDim elements). Heads never expand
// it: each query head's position-free part is absorbed into the latent's
// space (KB), its attention output is read in that space and expanded to
// the head's value (VB), so one row per token serves every head, and every
// tensor-parallel rank holds the whole row.
type MLAConfig struct {
	KVRank  int // kv_lora_rank: the latent's length
	NopeDim int // qk_nope_head_dim: a head's query/key length without position
	VDim    int // v_head_dim: a head's value length
}

// IndexerConfig is the sparse-attention indexer of ArchLlamaDSA.
type IndexerConfig struct {
	Heads int // index-query heads
	Dim   int // index key (and query head) length
	TopK  int // tokens each query attends to once its context is longer
}

// KVDim is the width of one token's K (or V) row: with MLA, of its one
// latent row (latent and RoPE key).
func (c *Config) KVDim() int {
	if c.MLA != nil {
		return c.MLA.KVRank + c.RopeDim
	}
	return c.KVHeads * c.HeadDim
}

// RankKVDim is the width of the K (or latent) row one rank of a
// tensor-parallel group of n stores: its KV heads' share, or the whole
// latent row, which every rank holds.
func (c *Config) RankKVDim(n int) int {
	if c.MLA != nil {
		return c.KVDim()
	}
	return c.KVDim() / max(n, 1)
}

// QDim is the width of one token's query row.
func (c *Config) QDim() int { return c.Heads * c.HeadDim }

// AttnOutDim is the width of one token's attention output, the output
// projection's input: every head's value.
func (c *Config) AttnOutDim() int {
	if c.MLA != nil {
		return c.Heads * c.MLA.VDim
	}
	return c.QDim()
}

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
	if err := c.validateMLA(); err != nil {
		return err
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
	case ArchLlama, ArchLlamaDSA, ArchDeepSeek2, ArchDeepSeek2DSA:
	default:
		return fmt.Errorf("model: unsupported architecture %q (pdkit runs %s)", c.Arch, ArchList())
	}
	if !HasIndexer(c.Arch) {
		if c.Indexer != nil {
			return fmt.Errorf("model: architecture %s has no indexer", c.Arch)
		}
		return nil
	}
	{
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
	}
	return nil
}

// validateMLA checks the latent attention's shape against the
// architecture: set exactly for the MLA architectures, one KV head, and a
// head's key split into a position-free part and a RoPE part.
func (c *Config) validateMLA() error {
	m := c.MLA
	if !IsMLA(c.Arch) {
		if m != nil {
			return fmt.Errorf("model: architecture %s has no latent attention", c.Arch)
		}
		return nil
	}
	if m == nil {
		return fmt.Errorf("model: architecture %s needs latent-attention settings", c.Arch)
	}
	if m.KVRank <= 0 || m.NopeDim <= 0 || m.VDim <= 0 {
		return fmt.Errorf("model: latent rank %d, position-free key length %d, value length %d must be positive", m.KVRank, m.NopeDim, m.VDim)
	}
	if c.KVHeads != 1 {
		return fmt.Errorf("model: latent attention reads one KV row per token, not %d KV heads", c.KVHeads)
	}
	if c.HeadDim != m.NopeDim+c.RopeDim {
		return fmt.Errorf("model: head key length %d is not the position-free %d plus the RoPE %d", c.HeadDim, m.NopeDim, c.RopeDim)
	}
	return nil
}
