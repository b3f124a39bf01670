//go:build !amd64

package sample

func greedy(logits []float32) int32 { return greedyGo(logits) }
