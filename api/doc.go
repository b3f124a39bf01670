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
package api
