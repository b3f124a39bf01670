//go:build stress

package serve

// The full equality matrix of the overlap loop: 200 prompts at TP 1, 2 and
// 4 (go test -tags stress -run TestOverlap ./engine/serve/).
func init() { overlapPrompts, overlapTPs = 200, []int{1, 2, 4} }
