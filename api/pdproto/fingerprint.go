package pdproto

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
)

// Fingerprint identifies a prompt: the first 16 bytes of the SHA-256 of its
// token ids (each a little-endian int32). Both sides compute it from their
// own prompt; TRANSFER_INFO and every KV_CHUNK carry the sender's, so that
// KV computed for one prompt never lands in a request for another, even
// when two requests name one room. SHA-256 rather than a fast hash: the
// prompts come from clients, who must not be able to make two collide.
type Fingerprint [16]byte

// PromptFingerprint is the fingerprint of tokens.
func PromptFingerprint(tokens []int32) Fingerprint {
	h := sha256.New()
	var buf [4 * 256]byte
	for len(tokens) > 0 {
		n := min(len(tokens), len(buf)/4)
		for i, t := range tokens[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], uint32(t))
		}
		h.Write(buf[:4*n])
		tokens = tokens[n:]
	}
	var f Fingerprint
	copy(f[:], h.Sum(nil))
	return f
}

// String is the fingerprint in hex, for logs and errors.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }
