package model

// SetGreedyChunkBytes sets the bound on one output chunk's logits
// (greedy.go), so that a tiny model's projection runs in chunks.
func (e *Exec) SetGreedyChunkBytes(n int) { e.chunkBytes = n }
