package membw

import "encoding/binary"

// readBlocksGo is readBlocks in plain Go: eight independent 8-byte loads
// per 64 bytes.
func readBlocksGo(b []byte) uint64 {
	var a [8]uint64
	for i := 0; i+64 <= len(b); i += 64 {
		for j := range a {
			a[j] ^= binary.LittleEndian.Uint64(b[i+8*j:])
		}
	}
	return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7]
}
