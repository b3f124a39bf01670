// Package api is pdkit's public wire surface: the types that servers send and
// receive and the Go client that talks to them. It is the only part of the
// module that pdctl, the TUI and diag import, so it depends on neither the
// engine nor the kernels and never on cgo; pdctl builds with CGO_ENABLED=0.
//
// Subpackages:
//
//   - openai: the OpenAI-compatible request and response types, strict
//     request decoding with OpenAI-style error bodies, and server-sent event
//     helpers for streaming.
//   - debug: the JSON answers of a server's debug API (/debug/v1/...):
//     per-rank step records, flight recorders, requests per queue.
//   - pdproto: the PD wire protocol: the multipart ZeroMQ messages between
//     prefill and decode ranks (encode, strict decode, KVPoll rules) and the
//     bootstrap registry's JSON types with the handshake's compatibility
//     check. docs/protocol.md describes both field by field.
//   - client: the Go client of a server's or router's debug and admin APIs
//     (/debug/v1/..., /pd/v1/info, /health, /admin/v1/...) and cluster
//     discovery through a router; pdctl's only way to the servers.
//   - zmtp: a minimal pure-Go ZeroMQ peer (ZMTP 3.0, NULL and PLAIN
//     mechanisms, PUSH and PULL over TCP), with which pdctl sends PD frames
//     such as a synthetic ABORT and receives the ABORT_ACK without cgo.
//   - clusterauth: a PD cluster's shared secret and the keys derived from
//     it (the PD sockets' credential, the registry's request signatures),
//     which servers and pdctl alike hold.
package api
