package main

import (
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
)

func newModelCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "model", Short: "Generate and inspect models"}
	cmd.AddCommand(newModelInitCmd(), newModelInfoCmd())
	return cmd
}

type modelInitOptions struct {
	arch, size, typ, out string
	seed                 uint64
}

func newModelInitCmd() *cobra.Command {
	o := modelInitOptions{}
	cmd := &cobra.Command{
		Use:   "init -o FILE",
		Short: "Write a built-in model (weights generated from a seed) as GGUF",
		Long: `Write a built-in model as a GGUF file. Its weights come deterministically from
the seed, so the same flags always give the same file. The llama architecture
loads in llama.cpp; llama-dsa adds a sparse-attention indexer (docs/llama-dsa.md).
deepseek2 is DeepSeek-V2/V3's multi-head latent attention with dense
feed-forward layers, written as llama.cpp's deepseek2 family (it loads there);
deepseek2-dsa adds DeepSeek-V3.2's indexer (docs/deepseek2.md). Their KV is
one latent row per token: at medium, DeepSeek-V3's 512-element latent plus a
64-element RoPE key, with 128-dimensional index keys.

Sizes: tiny (dim 64, 2 layers, vocab 512; for tests), small (the shape of
stories15M: dim 288, 6 layers, 6 heads, hidden 768, vocab 32000; 62 MB as F32)
and medium (the shape of stories110M: dim 768, 12 layers, 12 heads, hidden 2048,
vocab 32000; 460 MB as F32, generated in a few seconds). Small and medium have
context 2048 and tie the output projection to the embedding, as the stories
models do.`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error { return modelInitRun(cmd.ErrOrStderr(), o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.arch, "arch", model.ArchLlamaDSA, "architecture: "+model.ArchList())
	f.StringVar(&o.size, "size", builtin.SizeSmall, "size: "+builtin.SizeList())
	f.StringVar(&o.typ, "type", "f32", "weight type: f32, f16, bf16 or q8_0")
	f.Uint64Var(&o.seed, "seed", builtin.DefaultSeed, "seed of the weights")
	f.StringVarP(&o.out, "output", "o", "", "GGUF file to write (required)")
	return cmd
}

func modelInitRun(stderr io.Writer, o modelInitOptions) error {
	if o.out == "" {
		return usagef("-o FILE is required")
	}
	typ, err := builtin.ParseType(o.typ)
	if err != nil {
		return usageError{err}
	}
	spec := builtin.Spec{Arch: o.arch, Size: o.size, Seed: o.seed, Type: typ}
	if _, err := builtin.Shape(spec.Arch, spec.Size); err != nil {
		return usageError{err}
	}
	start := time.Now()
	if err := builtin.WriteFile(o.out, spec); err != nil {
		return err
	}
	fmt.Fprintf(stderr, "wrote %s (%s %s %s, seed %d) in %v\n", o.out, spec.Arch, spec.Size, o.typ, spec.Seed, time.Since(start).Round(time.Millisecond))
	return nil
}

func newModelInfoCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "info FILE",
		Short: "Print a GGUF model's architecture, shape and tokenizer",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := model.Open(args[0])
			if err != nil {
				return err
			}
			defer m.Close()
			printModelInfo(cmd.OutOrStdout(), m)
			return nil
		},
	}
}

func printModelInfo(w io.Writer, m *model.Model) {
	c := m.Config
	fmt.Fprintf(w, "name\t%s\narch\t%s\nvocab\t%d\ndim\t%d\nlayers\t%d\nhidden\t%d\nheads\t%d (kv %d, head dim %d, rope dim %d, theta %g)\ncontext\t%d\nweights\t%v, output tied: %v\n",
		m.Name, c.Arch, c.VocabSize, c.Dim, c.Layers, c.Hidden, c.Heads, c.KVHeads, c.HeadDim, c.RopeDim, c.RopeTheta, c.ContextLen, m.Layers[0].Q.DType, c.TiedOutput)
	if ml := c.MLA; ml != nil {
		fmt.Fprintf(w, "latent\t%d + rope key %d per token (query/key %d position-free, value %d per head)\n", ml.KVRank, c.RopeDim, ml.NopeDim, ml.VDim)
	}
	if ix := c.Indexer; ix != nil {
		fmt.Fprintf(w, "indexer\t%d heads × %d, top-k %d\n", ix.Heads, ix.Dim, ix.TopK)
	}
}
