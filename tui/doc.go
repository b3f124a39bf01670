// Package tui is the Bubble Tea application behind "pdctl top": a live view
// of a cluster's servers (and its router) with the requests each failed,
// their index-K precision and host tier (HiCache), of the ranks, their
// steps and phases, their sequence numbers on the control and the forward
// communicator, the collective each waits in (named with its
// communicator), the PD queues, and any divergence between the ranks of a
// tensor-parallel group, with the findings of the diag rules over the last
// few seconds of samples beneath.
//
// The package does not read the cluster itself: the caller's Fetch takes
// one Sample, a diag.Sample (the same reading "pdctl diagnose" and "pdctl
// bundle" take) with each server's host tier beside it, and Frame renders a
// window of them, styled for a terminal or plain. Like the rest of pdctl's
// operator side it reaches the cluster only through package api
// (internal/lint enforces it).
package tui
