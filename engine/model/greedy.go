package model

import (
	"fmt"

	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/kernels"
)

// The greedy choice, found with the output projection.
//
// A decode step's logits are rows×vocab floats (26 rows of the 32,000-word
// vocabulary are 3.3 MB), written by the output projection and read again
// whole by the sampler: on a CPU that second read comes from the last-level
// cache or memory and took most of the time between two forward passes.
// With one rank, the projection runs in vocabulary chunks whose logits
// fit in the core's cache, and each chunk's largest logit per row is taken
// right after the chunk is computed; the sampler uses that for a greedy
// request instead of reading the row again. Each output element is the
// same dot product whatever the chunk (kernels compute every element with
// the canonical accumulation, as the tensor-parallel row split relies on),
// so the logits and the choice are those of the unchunked projection:
// TestGreedyChunksMatchLogits checks both.

// greedyChunkBytes bounds the logits of one chunk; a step whose logits fit
// is projected whole and its rows scanned right after.
const greedyChunkBytes = 256 << 10

// Greedy returns, for each logits row of the last forward pass, the index
// sample.Greedy would pick from it; nil with more than one rank (the logits
// are gathered from the ranks' vocabulary pieces, and the sampler reads
// them).
func (e *Exec) Greedy() []int32 { return e.ws.greedy }

// projectGreedy is the output projection with one rank: dst[:r·vocab]
// and the greedy choice of each row.
func (e *Exec) projectGreedy(dst, xn []float32, r int) error {
	ws, v := &e.ws, e.vocab
	ws.greedy = grow(ws.greedy, r)
	out := dst[:r*v]
	bound := greedyChunkBytes
	if e.chunkBytes > 0 {
		bound = e.chunkBytes
	}
	if 4*r*v <= bound {
		e.b.MatMul(out, xn, e.output, r)
		for i := range r {
			ws.greedy[i] = sample.Greedy(out[i*v : (i+1)*v])
		}
		return nil
	}
	cw := chunkWidth(r, bound)
	chunks, err := e.outputChunks(cw)
	if err != nil {
		return err
	}
	ws.lChunk = grow(ws.lChunk, r*cw)
	ws.greedyMax = grow(ws.greedyMax, r)
	for i := range r {
		ws.greedy[i] = -1
	}
	for c, w := range chunks {
		j0, n := c*cw, w.Rows
		part := ws.lChunk[:r*n]
		e.b.MatMul(part, xn, w, r)
		for i := range r {
			row := part[i*n : (i+1)*n]
			copy(out[i*v+j0:], row)
			k := sample.Greedy(row)
			if x := row[k]; x == x && (ws.greedy[i] < 0 || x > ws.greedyMax[i]) {
				ws.greedy[i], ws.greedyMax[i] = int32(j0)+k, x
			}
		}
	}
	for i := range r {
		ws.greedy[i] = max(ws.greedy[i], 0) // every logit NaN: sample.Greedy's 0
	}
	return nil
}

// chunkWidth is the vocabulary rows of a chunk for r logits rows within
// bound bytes: a power of two (so that few widths occur and their
// sub-matrices are kept), at least 64.
func chunkWidth(r, bound int) int {
	cw := 64
	for 4*r*cw*2 <= bound {
		cw *= 2
	}
	return cw
}

// outputChunks returns the output matrix cut into row chunks of cw rows
// (the last one shorter), made once per width.
func (e *Exec) outputChunks(cw int) ([]*kernels.Matrix, error) {
	if cs, ok := e.chunks[cw]; ok {
		return cs, nil
	}
	w, rb := e.output, e.output.RowBytes()
	var cs []*kernels.Matrix
	for j0 := 0; j0 < w.Rows; j0 += cw {
		j1 := min(j0+cw, w.Rows)
		s, err := kernels.NewMatrix(w.DType, j1-j0, w.Cols, w.Data[j0*rb:j1*rb])
		if err != nil {
			return nil, fmt.Errorf("model: output rows %d..%d: %w", j0, j1, err)
		}
		cs = append(cs, s)
	}
	if e.chunks == nil {
		e.chunks = make(map[int][]*kernels.Matrix)
	}
	e.chunks[cw] = cs
	return cs, nil
}
