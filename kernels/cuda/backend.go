package cuda

import "github.com/pdkit/pdkit/kernels"

var _ kernels.Backend = (*Backend)(nil)

func (*Backend) Name() string { return "cuda" }

// The ops. New never returns a Backend yet, so none of these can be
// reached; each names itself if one is.

func (b *Backend) MatMul(dst, x []float32, w *kernels.Matrix, m int) { b.unimplemented("MatMul") }
func (b *Backend) RMSNorm(dst, x, weight []float32, rows int, eps float32) {
	b.unimplemented("RMSNorm")
}
func (b *Backend) RoPE(x []float32, pos []int32, nHeads, headDim, ropeDim int, theta float32) {
	b.unimplemented("RoPE")
}
func (b *Backend) SwiGLU(dst, gate, up []float32)       { b.unimplemented("SwiGLU") }
func (b *Backend) Softmax(x []float32, rows, cols int)  { b.unimplemented("Softmax") }
func (b *Backend) Attention(a *kernels.AttentionArgs)   { b.unimplemented("Attention") }
func (b *Backend) IndexScore(a *kernels.IndexScoreArgs) { b.unimplemented("IndexScore") }
func (b *Backend) TopK(dst []int32, scores []float32, k int) []int32 {
	b.unimplemented("TopK")
	return nil
}
func (b *Backend) QuantizeFP8(dst []uint8, src []float32) float32 {
	b.unimplemented("QuantizeFP8")
	return 0
}
func (b *Backend) DequantizeFP8(dst []float32, src []uint8, scale float32) {
	b.unimplemented("DequantizeFP8")
}
func (b *Backend) ToBF16(dst []uint16, src []float32)   { b.unimplemented("ToBF16") }
func (b *Backend) FromBF16(dst []float32, src []uint16) { b.unimplemented("FromBF16") }
