// Package pdproto is the wire protocol between the prefill and the decode
// servers of a PD-disaggregated deployment: the messages they exchange over
// their ZeroMQ sockets, as a pure-Go codec. Encode turns a Message into the
// frames of one multipart message and Decode turns frames back into a
// Message; sockets, goroutines and retries belong to the transport, which
// this package does not import.
//
// Every message has the same shape:
//
//	frame 0  guard: "PDKIT" followed by the protocol version byte (Version)
//	frame 1  type: the message's ASCII name, e.g. "KV_CHUNK"
//	frame 2  header: the message's fields, little-endian, fixed-width
//	         integers and u32-length-prefixed byte strings
//	frame 3… payload frames (KV_CHUNK only): one frame per K, V, index-K
//	         and index-K-scale buffer of each layer
//
// The KV bytes travel in their own frames so that a transport can hand the
// engine's buffers to the socket without copying them into a bigger one;
// Encode puts the caller's slices into the frame list as they are, and
// Decode returns payload slices that alias the received frames.
//
// Decoding is strict: a message decodes only if it is exactly what Encode
// would produce for some Message (no missing or extra frames, no trailing
// bytes, booleans 0 or 1, states in range, payload lengths as announced in
// the header), so anything that decodes re-encodes to the same frames. Every
// decode error is a *DecodeError naming the frame and field at fault, and
// matches ErrMalformed under errors.Is; a wrong guard or version also
// matches ErrVersion and an unknown type ErrUnknownType. A receiver counts
// such a message and drops it; nothing in Decode panics on any input.
//
// KVPoll is the transfer state of one request on one rank; Merge and
// MinState are the rules by which a rank updates it and by which the ranks
// of a TP group agree on it.
//
// docs/protocol.md describes the sockets, every field's byte layout and
// who sends what when.
package pdproto
