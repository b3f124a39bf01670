package model

import (
	"math"

	"github.com/pdkit/pdkit/kernels"
)

// latentAttention is layer l's multi-head latent attention over ws.q (this
// rank's heads, each a position-free part then a RoPE part) into ws.a
// (this rank's heads' values), in the absorbed form for every token:
//
//  1. the latent row: the projection attn_kv_a_mqa gives the latent and
//     the shared RoPE key; the latent is RMS-normalised, the key rotated,
//     and the row (latent | key) written to the pool, once per token
//     whatever the number of heads;
//  2. each head's position-free query is absorbed into the latent's
//     space (its KB matrix) and its RoPE query rotated, so that one dot
//     product with a latent row is the head's whole score;
//  3. attention reads the latent rows as keys and as values: a
//     single-KV-head attention of head length latent+rope, whose output's
//     latent part is the head's output in the latent's space;
//  4. each head's output is expanded to its value (its VB matrix).
//
// The score's scale is that of the uncompressed head, 1/√(nope+rope). No
// head's key or value is ever materialised, so the KV a token costs is one
// row for all heads; this is the form DeepSeek decodes in, and it is used
// for prefill too, so that a token's logits do not depend on how its
// prompt was chunked or whether it was prefilled here or on another server.
func (e *Exec) latentAttention(l, n int) error {
	c := &e.m.Config
	ml := c.MLA
	w := &e.layers[l]
	hd := &e.mla[l]
	b := e.b
	ws := &e.ws
	rank, rope, nope, row := ml.KVRank, c.RopeDim, ml.NopeDim, e.kvDim
	heads := e.heads

	// 1. The latent row of every token, written to the pool.
	b.MatMul(ws.k[:n*row], ws.xn, w.KVA, n)
	for i := range n {
		copy(ws.mLat[i*rank:(i+1)*rank], ws.k[i*row:i*row+rank])
		copy(ws.mRope[i*rope:(i+1)*rope], ws.k[i*row+rank:(i+1)*row])
	}
	b.RMSNorm(ws.mIn[:n*rank], ws.mLat[:n*rank], w.KVANorm, n, c.NormEps)
	b.RoPE(ws.mRope[:n*rope], ws.pos, 1, rope, rope, c.RopeTheta)
	for i := range n {
		copy(ws.k[i*row:i*row+rank], ws.mIn[i*rank:(i+1)*rank])
		copy(ws.k[i*row+rank:(i+1)*row], ws.mRope[i*rope:(i+1)*rope])
		e.pool.WriteKV(l, ws.slot[i], ws.k[i*row:(i+1)*row], nil)
	}

	// 2. Absorbed queries: [token][head][latent | rope].
	hdim := c.HeadDim
	for i := range n {
		for h := range heads {
			src := ws.q[(i*heads+h)*hdim+nope : (i*heads+h+1)*hdim]
			copy(ws.mRope[(i*heads+h)*rope:(i*heads+h+1)*rope], src)
		}
	}
	b.RoPE(ws.mRope[:n*heads*rope], ws.pos, heads, rope, rope, c.RopeTheta)
	for h := range heads {
		for i := range n {
			copy(ws.mIn[i*nope:(i+1)*nope], ws.q[(i*heads+h)*hdim:(i*heads+h)*hdim+nope])
		}
		b.MatMul(ws.mOut[:n*rank], ws.mIn[:n*nope], hd.kb[h], n)
		for i := range n {
			q := ws.mq[(i*heads+h)*row : (i*heads+h+1)*row]
			copy(q[:rank], ws.mOut[i*rank:(i+1)*rank])
			copy(q[rank:], ws.mRope[(i*heads+h)*rope:(i*heads+h+1)*rope])
		}
	}

	// 3. Attention over the latent rows (keys and values alike).
	if err := e.narrowAndWait(l, n); err != nil {
		return err
	}
	aa := kernels.AttentionArgs{
		Out: ws.mo[:n*heads*row], Q: ws.mq[:n*heads*row], Slots: ws.attn[:n],
		NHeads: heads, NKVHeads: 1, HeadDim: row,
		Scale: float32(1 / math.Sqrt(float64(hdim))),
	}
	e.pool.AttentionKV(l, &aa) // the latent rows as K and as V
	b.Attention(&aa)

	// 4. Each head's latent output expanded to its value.
	vd := ml.VDim
	for h := range heads {
		for i := range n {
			copy(ws.mIn[i*rank:(i+1)*rank], ws.mo[(i*heads+h)*row:(i*heads+h)*row+rank])
		}
		b.MatMul(ws.mOut[:n*vd], ws.mIn[:n*rank], hd.vb[h], n)
		for i := range n {
			copy(ws.a[(i*heads+h)*vd:(i*heads+h+1)*vd], ws.mOut[i*vd:(i+1)*vd])
		}
	}
	return nil
}
