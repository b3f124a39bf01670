//go:build amd64

package membw

import "golang.org/x/sys/cpu"

//go:noescape
func readBlocksAVX2(p *byte, n int) uint64

var hasAVX2 = cpu.X86.HasAVX2

// readBlocks reads b (a whole number of blocks) and returns a value that
// depends on every byte.
func readBlocks(b []byte) uint64 {
	if !hasAVX2 || len(b) < block {
		return readBlocksGo(b)
	}
	return readBlocksAVX2(&b[0], len(b)/block)
}
