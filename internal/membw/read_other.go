//go:build !amd64

package membw

func readBlocks(b []byte) uint64 { return readBlocksGo(b) }
