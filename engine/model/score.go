package model

import (
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/kernels"
)

// ScorePrompt runs tokens through the model in one fresh sequence, chunk
// tokens at a time (0: all at once), and returns the logits of every
// position (len(tokens) × vocab). The pool stores K and V as kv (F32, BF16
// or F16). It is how the model is checked against an independent reference
// forward.
func (m *Model) ScorePrompt(b kernels.Backend, tokens []int32, indexK kernels.IndexKDType, kv kernels.DType, pageSize, chunk int) ([]float32, error) {
	if chunk <= 0 {
		chunk = len(tokens)
	}
	pages := (len(tokens) + pageSize - 1) / pageSize
	pc := m.PoolConfig(pageSize, max(pages, 1), 1, indexK)
	pc.KVType = kv
	pool, err := kvcache.NewPool(pc)
	if err != nil {
		return nil, err
	}
	e, err := m.NewExec(b, pool)
	if err != nil {
		return nil, err
	}
	seq, err := pool.NewSeq(0)
	if err != nil {
		return nil, err
	}
	defer pool.Release(seq)
	v := m.Config.VocabSize
	out := make([]float32, len(tokens)*v)
	for s := 0; s < len(tokens); s += chunk {
		part := tokens[s:min(s+chunk, len(tokens))]
		if err := e.Forward([]SeqInput{{Seq: seq, Tokens: part, NumLogits: len(part)}}, out[s*v:]); err != nil {
			return nil, err
		}
	}
	return out, nil
}
